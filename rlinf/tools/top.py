"""``rlinf top``: a live terminal view of a running cluster.

It asks the manager for a snapshot once a second (the ``"snapshot"`` request over a
CURVE-authenticated DEALER, the same credentials as any cluster client, without
registering as a worker) and shows:

* workers: address, node, devices, state (heartbeat silence), age, and messages/s and
  bytes/s in and out — rates computed from the traffic counters each worker sends with
  its heartbeats (about once a second), between consecutive reports;
* channels: roster entries registered with ``meta["kind"] == "channel"``, with the
  :class:`~rlinf.channel.stats.ChannelStats` the server sends with its heartbeats
  (``stats["channel"]``: length, total weight, and per consumer pending items, measured
  speed and busy share), or its traffic until the first report;
* recent membership events (joined / left / failed, with why / lost).

``rlinf top --once --json`` prints one snapshot as JSON for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

from ..config import DEFAULTS, Settings
from ..control import client as control
from ..channel.stats import ConsumerStats
from ..errors import AuthenticationError, CommTimeoutError
from ..control.security import ClusterKeys

__all__ = ["SnapshotClient", "fetch_snapshot", "RateTracker", "View", "render", "format_bytes", "main"]

class SnapshotClient:
    """A read-only session with a manager: asks for snapshots, never registers.

    Args:
        manager: the manager's endpoint, e.g. ``"tcp://10.0.0.5:5555"``.
        token: the cluster token.

    Use as a context manager; one client can serve many ``snapshot()`` calls.
    """

    def __init__(self, manager: str, token: str) -> None:
        if not manager:
            raise ValueError("no manager: pass --manager tcp://host:port or set RLINF_MANAGER")
        if not token:
            raise ValueError("no cluster token: pass --token or set RLINF_TOKEN")
        self.manager = manager
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.linger = 0
        ClusterKeys(token).secure_client(self._sock)
        self._monitor = self._sock.get_monitor_socket()
        try:
            self._sock.connect(manager)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"bad manager address {manager!r} (expected tcp://host:port): {exc}") from None
        self._ids = 0
        self._handshake_ok = False

    def __enter__(self) -> SnapshotClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the sockets. Idempotent."""
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._context.term()

    def snapshot(self, timeout: float = 3.0) -> dict[str, Any]:
        """Ask for one snapshot (roster, latest stats per worker, recent events).

        Raises:
            AuthenticationError: the manager refused the token.
            CommTimeoutError: no answer within ``timeout`` seconds.
        """
        self._ids += 1
        request_id = self._ids
        self._sock.sndtimeo = int(timeout * 1000)
        try:
            self._sock.send(control.pack({"op": "snapshot", "id": request_id}))
        except zmq.Again:
            raise CommTimeoutError(f"could not send a request to the manager at {self.manager} "
                                   f"within {timeout} s") from None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if ready.get(self._monitor):
                self._check_handshake()
            if ready.get(self._sock):
                reply = control.unpack(self._sock.recv())
                if reply.get("op") == "reply" and reply.get("id") == request_id and "snapshot" in reply:
                    return reply["snapshot"]
                # a late answer to an earlier, timed-out request: keep waiting for ours
        raise CommTimeoutError(f"no answer from the manager at {self.manager} within {timeout} s "
                               "(is it running, and is the address right?)")

    def _check_handshake(self) -> None:
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_ok = True
            elif event["event"] in control.HANDSHAKE_FAILED and not self._handshake_ok:
                raise AuthenticationError(
                    f"the manager at {self.manager} refused the handshake: wrong cluster token")


def fetch_snapshot(manager: str, token: str, timeout: float = 3.0) -> dict[str, Any]:
    """One snapshot from ``manager`` (see :meth:`SnapshotClient.snapshot`)."""
    with SnapshotClient(manager, token) as client:
        return client.snapshot(timeout)


# ----------------------------------------------------------------------------- model
@dataclass
class Rates:
    """Per-second traffic of one worker; ``known`` is False until two reports arrived."""

    msgs_in: float = 0.0
    msgs_out: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    known: bool = False


_COUNTERS = ("msgs_in", "msgs_out", "bytes_in", "bytes_out")


@dataclass
class RateTracker:
    """Per-worker traffic rates from consecutive stats reports.

    Workers send cumulative counters with their ``uptime``; a rate is the difference
    between two reports divided by the uptime between them, so it does not depend on
    when the snapshots were taken. A worker keeps its last rate until a newer report.
    """

    _last: dict[tuple[str, str], dict] = field(default_factory=dict)
    _rates: dict[tuple[str, str], Rates] = field(default_factory=dict)

    def update(self, snapshot: dict[str, Any]) -> dict[str, Rates]:
        seen = set()
        out: dict[str, Rates] = {}
        for w in snapshot.get("workers", ()):
            key = (w.get("address", "?"), w.get("incarnation", ""))
            seen.add(key)
            stats = w.get("stats") or {}
            prev = self._last.get(key)
            uptime = stats.get("uptime")
            if prev is not None and uptime is not None and uptime > prev.get("uptime", uptime):
                dt = uptime - prev["uptime"]
                self._rates[key] = Rates(*(max(0.0, (stats.get(c, 0) - prev.get(c, 0)) / dt) for c in _COUNTERS),
                                         known=True)
            if uptime is not None and (prev is None or uptime > prev.get("uptime", -1)):
                self._last[key] = stats
            out[key[0]] = self._rates.get(key, Rates())
        for key in set(self._last) - seen:
            self._last.pop(key, None)
            self._rates.pop(key, None)
        return out


def channels(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The roster entries that serve a data channel (``meta["kind"] == "channel"``):
    name, address, meta, ``channel`` (its last reported ``ChannelStats.to_dict()``, {}
    before the first report) and ``stats`` (its traffic counters)."""
    out = []
    for w in snapshot.get("workers", ()):
        meta = w.get("meta") or {}
        if meta.get("kind") == "channel":
            stats = w.get("stats") or {}
            traffic = {k: v for k, v in stats.items() if k != "channel"}
            out.append({"name": meta.get("channel") or meta.get("name") or w.get("address"),
                        "address": w.get("address"), "meta": meta,
                        "channel": stats.get("channel") or {}, "stats": traffic})
    return out


def to_json(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with a ``channels`` list added (what ``--once --json`` prints)."""
    return {**snapshot, "channels": channels(snapshot)}


# ----------------------------------------------------------------------------- view
def format_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e4:
        return f"{n / 1e3:.0f}k"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def _devices(w: dict) -> str:
    devs = w.get("devices") or []
    return ",".join(f"{d.get('kind', '?')}:{d.get('index', '?')}" for d in devs) or "cpu"


def _state(w: dict, heartbeat: float) -> str:
    silence = w.get("silence")
    if silence is not None and silence > 4 * heartbeat:
        return f"[yellow]silent {silence:.1f}s[/]"
    blocked = (w.get("stats") or {}).get("waiting_for_credit") or {}
    if blocked:     # sends waiting for a receiver's credit window (flow control)
        peer, n = max(blocked.items(), key=lambda kv: kv[1])
        more = f" +{len(blocked) - 1}" if len(blocked) > 1 else ""
        return f"[yellow]blocked on {peer} ({n}){more}[/]"
    return "[green]alive[/]"


def _channel_cells(ch: dict, rates: Rates) -> tuple[str, str, str]:
    """(length, weight, consumers) cells. The channel figures are ``ChannelStats`` fields
    (``ChannelStats.to_dict()``: consumers as dicts; positional rows, as on the channel's
    wire, are read too); until the server's first report the consumers cell shows its
    traffic."""
    cs = ch["channel"]
    parts = []
    for c in cs.get("consumers") or ():
        if isinstance(c, (list, tuple)):
            c = dict(zip(_CONSUMER_FIELDS, c))
        if not isinstance(c, dict):
            continue
        bits = [str(c.get("name", "?"))]
        if c.get("pending_count") is not None:
            weight = c.get("pending_weight")
            bits.append(f"pending {c['pending_count']}" + ("" if weight is None else f" (w {weight:.4g})"))
        if c.get("consumed_count") is not None:
            bits.append(f"done {c['consumed_count']}")
        if "speed" in c:     # None until the channel has measured it
            bits.append("speed -" if c["speed"] is None else f"speed {c['speed']:.3g}")
        if c.get("busy_fraction") is not None:
            bits.append(f"busy {c['busy_fraction']:.0%}")
        if c.get("staleness_max") is not None:      # versions behind, of what it got
            bits.append(f"stale mean {c.get('staleness_mean') or 0:.2f} max {c['staleness_max']}")
        parts.append(" ".join(bits))
    if cs.get("max_staleness") is not None or cs.get("version"):   # asynchronous RL
        parts.insert(0, f"version {cs.get('version', 0)} (max staleness {cs.get('max_staleness')}): "
                        f"stale dropped {cs.get('stale_dropped', 0)}, admitted {cs.get('admitted', 0)} "
                        f"({cs.get('admissions_waiting', 0)} waiting)")
    if not parts:
        parts.append(f"traffic in {_count(rates.msgs_in)}/s out {_count(rates.msgs_out)}/s" if rates.known else "-")
    length, weight = cs.get("length"), cs.get("weight")
    return ("-" if length is None else str(length), "-" if weight is None else f"{weight:.4g}", "; ".join(parts))


#: Field order of a consumer row on the channel's wire (``ChannelStats.from_dict``).
_CONSUMER_FIELDS = tuple(f.name for f in dataclasses.fields(ConsumerStats))


@dataclass
class View:
    """State kept between refreshes: rates, event arrival times, recently gone workers."""

    tracker: RateTracker = field(default_factory=RateTracker)
    rates: dict[str, Rates] = field(default_factory=dict)
    event_times: list[float | None] = field(default_factory=list)
    version: int | None = None
    error: str | None = None
    snapshot: dict[str, Any] | None = None

    def update(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot
        self.error = None
        self.rates = self.tracker.update(snapshot)
        events = snapshot.get("events", [])
        version = snapshot.get("version")
        # The manager's version grows by one per event, so the difference says how many
        # of the listed events are new since the last refresh; those are stamped now.
        new = len(events) if self.version is None or version is None else version - self.version
        new = max(0, min(len(events), new)) if self.version is not None else 0
        old = len(events) - new
        kept = self.event_times[-old:] if old else []
        self.event_times = [None] * (old - len(kept)) + kept + [time.time()] * new
        self.version = version


def render(view: View, *, events: int = 8, heartbeat: float = DEFAULTS.heartbeat_interval):
    """A rich renderable of the current view; ``heartbeat``: the workers' heartbeat
    interval (``RLINF_HEARTBEAT_INTERVAL``), which tells a silent worker from a live one."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    snap = view.snapshot or {}
    rates = view.rates
    workers = sorted(snap.get("workers", []), key=lambda w: w.get("address", ""))
    title = Text.from_markup(
        f"[bold]rlinf top[/]  manager [cyan]{snap.get('manager', '?')}[/]  "
        f"{len(workers)} workers  {time.strftime('%H:%M:%S')}")
    parts: list[Any] = [title]
    if view.error:
        parts.append(Text.from_markup(f"[red]{view.error}[/]"))

    table = Table(title="workers", title_justify="left", expand=False)
    for col in ("address", "node", "pid", "devices", "state", "age"):
        table.add_column(col)
    for col in ("msgs/s in", "msgs/s out", "bytes/s in", "bytes/s out", "conns"):
        table.add_column(col, justify="right")
    for w in workers:
        r = rates.get(w.get("address"), Rates())
        stats = w.get("stats") or {}
        traffic = (("-",) * 4 if not r.known   # a rate needs two reports (about two seconds)
                   else (_count(r.msgs_in), _count(r.msgs_out), format_bytes(r.bytes_in), format_bytes(r.bytes_out)))
        table.add_row(w.get("address", "?"), str(w.get("node_id", "?")), str(w.get("pid", "")), _devices(w),
                      _state(w, heartbeat), _duration(w.get("age", 0.0)), *traffic,
                      str(stats.get("connections", "-")))
    parts.append(table)

    chans = channels(snap)
    if chans:
        ct = Table(title="channels", title_justify="left")
        for col in ("channel", "served by", "length", "weight", "consumers"):
            ct.add_column(col)
        for ch in chans:
            length, weight, consumers = _channel_cells(ch, rates.get(ch["address"], Rates()))
            ct.add_row(str(ch["name"]), str(ch["address"]), length, weight, consumers)
        parts.append(ct)

    evs = snap.get("events", [])
    if evs:
        et = Table(title="recent membership events", title_justify="left")
        et.add_column("seen")
        et.add_column("event")
        et.add_column("address")
        colours = {"joined": "green", "left": "yellow", "failed": "magenta", "lost": "red"}
        for e, t in list(zip(evs, view.event_times or [None] * len(evs)))[-events:][::-1]:
            seen = time.strftime("%H:%M:%S", time.localtime(t)) if t else "earlier"
            kind = e.get("kind", "?")
            reason = f" ({e['reason']})" if e.get("reason") else ""     # plain text: no markup in it
            et.add_row(seen, f"[{colours.get(kind, 'white')}]{kind}[/]", Text(f"{e.get('address', '?')}{reason}"))
        parts.append(et)
    return Group(*parts)


# ----------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manager", default=None,
                        help="manager endpoint, e.g. tcp://10.0.0.5:5555 (default $RLINF_MANAGER)")
    parser.add_argument("--token", default=None,
                        help="cluster token (default $RLINF_TOKEN)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for the manager's answer (default 3)")
    parser.add_argument("--once", action="store_true", help="take one snapshot, print it and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    parser.add_argument("--events", type=int, default=8, help="membership events to show (default 8)")


def run(args: argparse.Namespace) -> int:
    """Run ``rlinf top`` with parsed arguments; returns the exit status."""
    try:
        settings = Settings.from_env()      # here, not in the parser: --help works with a bad knob
        client = SnapshotClient(args.manager or settings.manager, args.token or settings.token)
    except ValueError as exc:
        print(f"rlinf top: {exc}", file=sys.stderr)
        return 2
    with client:
        if args.once:
            try:
                snap = client.snapshot(args.timeout)
            except (CommTimeoutError, AuthenticationError) as exc:
                print(f"rlinf top: {exc}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(to_json(snap), indent=2, default=str))
            else:
                from rich.console import Console

                view = View()
                view.update(snap)
                Console().print(render(view, events=args.events, heartbeat=settings.heartbeat_interval))
            return 0
        return _live(client, args, settings.heartbeat_interval)


def _live(client: SnapshotClient, args: argparse.Namespace, heartbeat: float) -> int:
    from rich.live import Live

    view = View()
    try:
        with Live(render(view, heartbeat=heartbeat), refresh_per_second=4, screen=False) as live:
            while True:
                started = time.monotonic()
                try:
                    view.update(client.snapshot(args.timeout))
                except CommTimeoutError as exc:
                    view.error = f"manager unreachable: {exc}"
                except AuthenticationError as exc:
                    live.stop()
                    print(f"rlinf top: {exc}", file=sys.stderr)
                    return 1
                live.update(render(view, events=args.events, heartbeat=heartbeat))
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlinf top", description="Live view of a running rlinf cluster.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
