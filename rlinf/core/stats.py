"""Traffic counters and their frozen snapshots (``comm.stats()``).

Counting is a few integer additions on the hot path; percentiles are computed only when
a snapshot is taken, from a bounded window of recent send latencies.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("rlinf.core.stats")

__all__ = ["PeerStats", "TransportStats", "CommStats", "Counters", "StatsReports"]

_WINDOW = 2048


@dataclass(frozen=True, slots=True)
class PeerStats:
    """Traffic with one peer. Latencies are send-call-to-completion times, in seconds.

    ``bytes_out``/``bytes_in`` count what crossed a socket (headers and payload: ZeroMQ,
    the stream and bulk links); ``shared_out``/``shared_in`` the payload that moved
    through memory instead (shared-memory slots, pulls, CUDA IPC): only its descriptor
    crossed a socket.

    Flow control (our user messages to it, see ``docs/concepts.md``): ``credit_msgs`` and
    ``credit_bytes`` of its window in use (in flight, or held by it not yet received),
    ``credit_waiting`` messages waiting for room now, ``credit_waits`` messages that had
    to wait and ``credit_wait_s`` seconds spent waiting, in all.
    """

    msgs_out: int = 0
    bytes_out: int = 0
    msgs_in: int = 0
    bytes_in: int = 0
    latency_p50: float | None = None
    latency_p99: float | None = None
    connected: bool = False
    credit_msgs: int = 0
    credit_bytes: int = 0
    credit_waiting: int = 0
    credit_waits: int = 0
    credit_wait_s: float = 0.0
    shared_out: int = 0
    shared_in: int = 0


@dataclass(frozen=True, slots=True)
class TransportStats:
    """What we sent per path: "zmq", "stream", "tcp_stream", "bulk" (bytes written to that socket) and
    "shm", "pull", "cuda_ipc" (payload bytes moved through memory)."""

    msgs: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class CommStats:
    """A snapshot of one communicator's traffic (see ``Communicator.stats``)."""

    address: str
    uptime: float
    peers: dict[str, PeerStats] = field(default_factory=dict)
    transports: dict[str, TransportStats] = field(default_factory=dict)
    connections: int = 0
    dropped_frames: int = 0
    #: frame sets sent again (a link was dialled anew, a gap, no acknowledgement in time)
    resent_frames: int = 0
    #: frame sets received twice (a resend of what had arrived), dropped
    duplicate_frames: int = 0

    @property
    def msgs_out(self) -> int:
        """Messages sent to all peers."""
        return sum(p.msgs_out for p in self.peers.values())

    @property
    def msgs_in(self) -> int:
        """Messages received from all peers."""
        return sum(p.msgs_in for p in self.peers.values())

    @property
    def bytes_out(self) -> int:
        """Bytes sent to all peers (headers and payload)."""
        return sum(p.bytes_out for p in self.peers.values())

    @property
    def bytes_in(self) -> int:
        """Bytes received from all peers (headers and payload)."""
        return sum(p.bytes_in for p in self.peers.values())

    @property
    def shared_out(self) -> int:
        """Payload bytes sent to all peers through memory (not through a socket)."""
        return sum(p.shared_out for p in self.peers.values())

    @property
    def shared_in(self) -> int:
        """Payload bytes received from all peers through memory."""
        return sum(p.shared_in for p in self.peers.values())

    def to_dict(self) -> dict:
        return {
            "address": self.address, "uptime": self.uptime, "connections": self.connections,
            "dropped_frames": self.dropped_frames, "resent_frames": self.resent_frames,
            "duplicate_frames": self.duplicate_frames,
            "msgs_out": self.msgs_out, "msgs_in": self.msgs_in,
            "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
            "shared_out": self.shared_out, "shared_in": self.shared_in,
            "transports": {k: {"msgs": v.msgs, "bytes": v.bytes} for k, v in self.transports.items()},
            "waiting_for_credit": {k: p.credit_waiting for k, p in self.peers.items() if p.credit_waiting},
        }

    def __str__(self) -> str:
        lines = [f"CommStats {self.address}: {self.connections} connections, up {self.uptime:.1f} s"]
        for peer, s in sorted(self.peers.items()):
            lat = f" p50={s.latency_p50 * 1e6:.0f}us p99={s.latency_p99 * 1e6:.0f}us" if s.latency_p50 else ""
            shared = f" (+{s.shared_out} B / +{s.shared_in} B through memory)" if s.shared_out or s.shared_in else ""
            lines.append(f"  {peer:<20} out {s.msgs_out} msgs/{s.bytes_out} B  in {s.msgs_in} msgs/{s.bytes_in} B"
                         f"{shared}{lat}")
        for name, t in sorted(self.transports.items()):
            lines.append(f"  via {name:<8} {t.msgs} msgs/{t.bytes} B")
        return "\n".join(lines)


class _Peer:
    __slots__ = ("msgs_out", "bytes_out", "msgs_in", "bytes_in", "shared_out", "shared_in", "latencies")

    def __init__(self) -> None:
        self.msgs_out = self.bytes_out = self.msgs_in = self.bytes_in = self.shared_out = self.shared_in = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=_WINDOW)


class Counters:
    """Mutable counters owned by one communicator (loop thread only)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.started = time.monotonic()
        self.peers: dict[str, _Peer] = collections.defaultdict(_Peer)
        self.transports: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.dropped_frames = 0
        self.resent_frames = 0
        self.duplicate_frames = 0

    def sent(self, peer: str, nbytes: int, transport: str = "zmq", shared: int = 0, msgs: int = 1) -> None:
        """A message to ``peer`` went (``msgs`` of them): ``nbytes`` through a socket,
        ``shared`` through memory; ``transport`` is the path their payload took."""
        p = self.peers[peer]
        p.msgs_out += msgs
        p.bytes_out += nbytes
        t = self.transports[transport]
        t[0] += msgs
        if shared:
            p.shared_out += shared
            t[1] += shared
        else:
            t[1] += nbytes

    def dropped(self) -> None:
        """A frame set (or one of its messages) was dropped as malformed."""
        self.dropped_frames += 1

    def resent(self, peer: str) -> None:
        """A frame set to ``peer`` was sent again."""
        self.resent_frames += 1

    def duplicate(self) -> None:
        """A frame set that had arrived before arrived again (and was dropped)."""
        self.duplicate_frames += 1

    def received(self, peer: str, nbytes: int, shared: int = 0, msgs: int = 1) -> None:
        """A message from ``peer`` arrived (``msgs`` of them): ``nbytes`` through a socket,
        ``shared`` through memory."""
        p = self.peers[peer]
        p.msgs_in += msgs
        p.bytes_in += nbytes
        p.shared_in += shared

    def latency(self, peer: str, seconds: float) -> None:
        self.peers[peer].latencies.append(seconds)

    def snapshot(self, connected: set[str], credits: dict[str, Any] | None = None) -> CommStats:
        """``credits``: the flow-control state of our sessions by peer (``rlinf.core._credit.Credit``)."""
        peers = {}
        credits = credits or {}
        for name in self.peers.keys() | credits.keys():
            p = self.peers[name]
            lat = sorted(p.latencies)
            p50 = lat[len(lat) // 2] if lat else None
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
            c = credits.get(name)
            flow = () if c is None else (*c.used, len(c.waiting), c.waits, c.waited)
            peers[name] = PeerStats(p.msgs_out, p.bytes_out, p.msgs_in, p.bytes_in, p50, p99, name in connected,
                                    *flow, shared_out=p.shared_out, shared_in=p.shared_in)
        transports = {k: TransportStats(v[0], v[1]) for k, v in self.transports.items()}
        return CommStats(self.address, time.monotonic() - self.started, peers, transports,
                         len(connected), self.dropped_frames, self.resent_frames, self.duplicate_frames)


#: The names the CommStats part of a report takes.
_BUILT_IN = frozenset(CommStats("", 0.0).to_dict())


class StatsReports:
    """What a worker reports with its heartbeats: its :class:`CommStats` and the named
    reports of its subsystems (a channel server's ``"channel"``, the pulls' ``"pull"``).

    Args:
        address: the worker's (for log lines). snapshot: its ``stats()``.
    """

    def __init__(self, address: str, snapshot: Callable[[], CommStats]) -> None:
        self._address = address
        self._snapshot = snapshot
        self._providers: dict[str, Callable[[], Any]] = {}

    def add(self, name: str, provider: Callable[[], Any]) -> None:
        """Report ``provider()`` under ``name``.

        Raises:
            ValueError: ``name`` is taken (by another provider or a built-in counter).
        """
        if name in self._providers or name in _BUILT_IN:
            raise ValueError(f"stats name {name!r} is already reported by {self._address}")
        self._providers[name] = provider

    def collect(self) -> dict:
        """The report (on the loop thread); a provider that fails is logged and left out."""
        report = self._snapshot().to_dict()
        for name, provider in self._providers.items():
            try:
                report[name] = provider()
            except Exception:   # one broken provider must not stop the worker's reports
                log.exception("rlinf %s: stats provider %r failed", self._address, name)
        return report
