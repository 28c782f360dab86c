"""Plain records that describe workers and membership changes.

These are frozen snapshots: the manager keeps a roster of :class:`WorkerInfo`, every
communicator caches a copy, and :func:`rlinf.routing.select_transport` reads them to
choose a path. They travel over the control plane as msgpack maps (``to_wire`` /
``from_wire``), so they hold only plain values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DeviceInfo", "WorkerInfo", "MembershipEvent", "parse_address", "check_plain", "check_timeout",
           "PLAIN_DEPTH", "MAX_REASON", "failure_summary"]


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"group:rank"`` into ``(group, rank)``.

    Raises:
        TypeError: ``address`` is not a str.
        ValueError: it is not of the form ``name:non-negative-int``.
    """
    if not isinstance(address, str):
        raise TypeError(f"a worker address must be a str like 'rollout:3', got {type(address).__name__}")
    group, sep, rank = address.rpartition(":")
    if not sep or not group or not (rank.isascii() and rank.isdigit()) or (rank[0] == "0" and rank != "0"):
        raise ValueError(f"a worker address must look like 'group:rank' (e.g. 'rollout:3', a rank without "
                         f"leading zeros), got {address!r}")
    return group, int(rank)


def check_timeout(timeout: Any, default: float | None = None) -> float | None:
    """The timeout an operation runs with, from its ``timeout=`` argument: seconds >= 0
    (``inf``: wait), or, when it is None, ``default``.

    This is the one place the rule "``timeout=None``: ``RLINF_TIMEOUT`` if set, else
    forever" is applied: an operation passes its owner's ``Settings.timeout`` as
    ``default`` (a communicator's, through ``Core.timeout_of`` for the subsystems).

    Args:
        timeout: what the caller passed.
        default: the timeout when it passed None (None: wait forever).

    Raises:
        TypeError: not a real number (a bool, a str...).
        ValueError: negative or NaN (a NaN deadline would never expire).
    """
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) and not hasattr(timeout, "__float__"):
        raise TypeError(f"timeout must be None or a number of seconds, got {type(timeout).__name__}")
    seconds = float(timeout)
    if not seconds >= 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One accelerator of a worker: ``kind`` ("cuda"), its index and a stable uuid."""

    kind: str
    index: int
    uuid: str = ""
    total_memory: int = 0

    @property
    def name(self) -> str:
        """``"cuda:0"``-style name."""
        return f"{self.kind}:{self.index}"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Where a worker lives and how to reach it (one incarnation of an address).

    Attributes:
        address: ``"group:rank"``.
        incarnation: random id of this process's registration; a restart under the same
            address gets a new one, and frames from an old one are dropped.
        node_id: host identity (``RLINF_NODE_ID`` overrides it); equal ids mean "same node".
        host, pid: where the process runs.
        endpoints: data endpoints by scheme, e.g. ``{"ipc": "ipc:///tmp/..", "tcp": "tcp://.."}``.
        devices: the accelerators the worker can use.
        transports: names of the transports available in that process.
        start_time: registration time (seconds since the epoch, the manager's clock).
        meta: free-form extra data (e.g. ``{"kind": "channel", "channel": "rollouts"}``).
    """

    address: str
    incarnation: str
    node_id: str
    host: str = ""
    pid: int = 0
    endpoints: dict[str, str] = field(default_factory=dict)
    devices: tuple[DeviceInfo, ...] = ()
    transports: tuple[str, ...] = ("zmq",)
    start_time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire = dataclasses.asdict(self)
        wire["devices"] = [dataclasses.asdict(d) for d in self.devices]
        wire["transports"] = list(self.transports)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WorkerInfo:
        """Build from a control-plane map, checking every field's type (a member's bad
        record must not break whoever keeps it). ``meta`` must be plain data (see
        :func:`check_plain`). Raises ``ValueError`` / ``TypeError`` on bad fields."""
        if not isinstance(wire, dict):
            raise TypeError("worker info must be a map")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in wire.items() if k in known}
        devices = wire.get("devices", ())
        if not isinstance(devices, (list, tuple)) or not all(isinstance(d, dict) for d in devices):
            raise TypeError("worker info 'devices' must be a list of maps")
        kwargs["devices"] = tuple(DeviceInfo(**d) for d in devices)
        transports = wire.get("transports", ("zmq",))
        if not isinstance(transports, (list, tuple)):
            raise TypeError("worker info 'transports' must be a list")
        kwargs["transports"] = tuple(transports)
        info = cls(**kwargs)
        info._check()
        return info

    def _check(self) -> None:
        parse_address(self.address)
        for name in ("incarnation", "node_id", "host"):
            _expect(name, getattr(self, name), str)
        _expect("pid", self.pid, int)
        if self.pid < 0:
            raise ValueError(f"worker info 'pid' must be >= 0, got {self.pid}")
        _expect("start_time", self.start_time, (int, float))
        if not math.isfinite(self.start_time):
            raise ValueError("worker info 'start_time' must be finite")
        _expect("endpoints", self.endpoints, dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.endpoints.items()):
            raise TypeError("worker info 'endpoints' must map str to str")
        if not all(isinstance(t, str) for t in self.transports):
            raise TypeError("worker info 'transports' must be strs")
        for d in self.devices:
            for name, kind in (("kind", str), ("index", int), ("uuid", str), ("total_memory", int)):
                _expect(f"device {name}", getattr(d, name), kind)
        _expect("meta", self.meta, dict)
        check_plain(self.meta, "worker info 'meta'")


#: Deepest nesting :func:`check_plain` accepts.
PLAIN_DEPTH = 16
_SCALARS = (bool, int, float, str, bytes)   # and None


def check_plain(value: Any, what: str, depth: int = 0) -> None:
    """Check that ``value`` is plain data the control plane can carry and re-encode: None,
    bool, int, float, str, bytes, and lists and maps of them (keyed by those scalars),
    nested at most :data:`PLAIN_DEPTH` deep.

    Raises:
        TypeError: another type, or a map key that is not a scalar.
        ValueError: nested too deep.
    """
    if depth > PLAIN_DEPTH:
        raise ValueError(f"{what} is nested deeper than {PLAIN_DEPTH}")
    if value is None or isinstance(value, _SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            check_plain(item, what, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not (key is None or isinstance(key, _SCALARS)):
                raise TypeError(f"{what} has a map key that is not a scalar: {type(key).__name__}")
            check_plain(item, what, depth + 1)
        return
    raise TypeError(f"{what} holds a {type(value).__name__}, not plain data")


def _expect(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TypeError(f"worker info {name!r} has the wrong type: {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """A change in the cluster's membership, as seen from ``comm.events()``.

    ``kind`` is ``"joined"`` (registered), ``"left"`` (closed cleanly: its function
    returned, or its communicator was closed), ``"failed"`` (closed cleanly because its
    code raised: a spawned worker's function, or the body of its ``async with``;
    ``reason`` is the exception's one-line summary, e.g. ``"RuntimeError: boom"``) or
    ``"lost"`` (killed, crashed, or silent for longer than the peer timeout). A
    ``"failed"`` worker delivered what it sent before, as one that left does.
    """

    kind: Literal["joined", "left", "failed", "lost"]
    address: str
    incarnation: str = ""
    info: WorkerInfo | None = None
    reason: str = ""


#: The longest ``MembershipEvent.reason`` (characters); a longer summary is cut.
MAX_REASON = 300


def failure_summary(exc: BaseException) -> str:
    """The one-line summary of ``exc`` that a ``"failed"`` event carries: its type's
    name and the first line of its message, at most :data:`MAX_REASON` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def socket_dirs(info: WorkerInfo | None) -> list[str]:
    """The private directories of a worker's socket files (its ``ipc://`` and ``unix://``
    endpoints), which whoever started it removes if it dies before it can."""
    dirs = set()
    for endpoint in (info.endpoints.values() if info is not None else ()):
        scheme, _, path = endpoint.partition("://")
        if scheme in ("ipc", "unix") and path:
            dirs.add(path.rsplit("/", 1)[0])
    return sorted(dirs)
