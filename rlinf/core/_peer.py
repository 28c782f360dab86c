"""Per-peer sessions: what this communicator keeps for one remote incarnation it sends to.

A :class:`PeerSession` is the unit of per-peer state: the link(s) to the peer and its
:class:`~rlinf.core._outbox.Outbox` (ordering, coalescing, backpressure), the lookup or
dial task that gets the link, the route memo, and its failure. :class:`PeerSessions`
is the communicator's small registry of them: it opens a session on first use, dials
it, and is the one place a departed or restarted peer's state goes, its session's and
what the shared-memory, pull and CUDA IPC sessions hold for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Iterator

from ..control import client as control, devices
from ..errors import AuthenticationError, ClosedError, CommTimeoutError, PeerLostError, RlinfError
from ..info import WorkerInfo, parse_address
from ..transports import tcp_bulk
from ..transports.shm import PullSession, ShmSession
from ..transports.stream import StreamTransport
from ..transports.zeromq import ZmqTransport
from ..util.bounded import Recent
from . import routing, wire
from ._gpu_paths import GpuPaths
from ._mailbox import Mailbox
from ._outbox import Outbox
from .stats import Counters

__all__ = ["PeerSession", "PeerSessions", "DEAD_KEPT"]

log = logging.getLogger("rlinf.core.communicator")

#: Incarnations of peers known gone (their late frames are dropped), and closed sessions
#: (sends to them fail at once), that are remembered, the oldest forgotten first: a peer
#: restarted under one name adds one each time.
DEAD_KEPT = 4096
#: How many addresses the hot path remembers as already checked.
_VALID_KEPT = 100_000


class PeerSession:
    """One remote incarnation, as this communicator sends to it (loop thread only).

    Lifecycle: opened on the first message to ``address`` (a send, a multicast, a
    notice we owe it); its incarnation is known once the peer is (``info``: at once
    when it is in the roster, else after the lookup). Closed exactly once
    (:meth:`close`): when that incarnation leaves or is lost, when the peer restarts
    (another incarnation joins under its address: the next message opens a new
    session), or when we close.

    Invariants kept today:

    * At most one session per address in the registry; ``info`` never changes to
      another incarnation (a restart closes this session instead).
    * Messages enter the outbox in call order and leave it in that order, across the
      ZeroMQ, stream and bulk links (see :mod:`rlinf.core._outbox`).
    * ``error`` set means nothing more is sent: every queued send failed with it, and
      every later one raises it at once (for a closed session, until the registry
      forgets it). A failure of the link alone sets it too, without closing the session.
    * ``shm_route`` is the route memo for ``info``; any membership change drops it.
    * ``task`` (the lookup, or the dial of a stream link) is cancelled when the session
      fails; it is None once the outbox has its link.

    Not here yet: the receive side of the peer (its messages queued in the mailbox, its
    arrival order) and the per-peer bookkeeping the shared-memory, pull and CUDA IPC
    sessions keep by address (slots it holds, releases we owe it, mappings of its
    slots). :meth:`PeerSessions.peer_gone` is the one place they learn that a peer
    incarnation is gone, and the send path reaches them with the session's address.

    This is where the next steps of the delivery protocol go: per-peer sequence numbers
    (stamped in the order messages enter the outbox), acknowledgements and resends
    (kept here until acknowledged, sent again on a new link of the same incarnation),
    the credit window the receiver grants (waited for before the outbox), and with
    them the receive side (a session then opens on the first frame set received too).
    """

    __slots__ = ("address", "outbox", "shm_route", "task", "closed")

    def __init__(self, address: str, outbox: Outbox) -> None:
        self.address = address
        self.outbox = outbox
        self.shm_route: bool | None = None    # large CPU payloads to it go by shared memory
        self.task: asyncio.Task | None = None
        self.closed = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else "failed" if self.error else "open"
        return f"<PeerSession {self.address} {state} {self.outbox!r}>"

    @property
    def info(self) -> WorkerInfo | None:
        """The peer incarnation this session is for (None while it is looked up)."""
        return self.outbox.info

    @property
    def error(self) -> BaseException | None:
        return self.outbox.error

    def fail(self, exc: BaseException) -> None:
        """Fail every queued send with ``exc`` and refuse new ones (the link broke, or
        the peer cannot be reached); the session stays until it is closed."""
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.outbox.fail(exc)

    def close(self, error: BaseException) -> None:
        """Close once: fail what is queued with ``error`` (later calls do nothing)."""
        if not self.closed:
            self.closed = True
            self.fail(error)


class PeerSessions:
    """The sessions of one communicator, by address, and how they are dialled.

    Args:
        address, incarnation: the communicator's. header: its header packer (one for
            every outbox). counters: its traffic counters. config: its routing config.
        roster: the peers it knows by address (read here; membership writes it).
        mailbox: its mailbox (a peer it knows lost gets no new session).
        gpu: its GPU paths (told of membership changes).
    """

    def __init__(self, address: str, incarnation: str, header: wire.HeaderPacker, counters: Counters,
                 config: routing.RoutingConfig, roster: dict[str, WorkerInfo], mailbox: Mailbox, gpu: GpuPaths) -> None:
        self._address = address
        self.identity = f"{address}|{incarnation}".encode()     # how our links present us
        self._header = header
        self._counters = counters
        self._config = config
        self._roster = roster
        self._mailbox = mailbox
        self._gpu = gpu
        self._sessions: dict[str, PeerSession] = {}
        self.get = self._sessions.get          # the hot path: one dict lookup
        self._closed_kept = Recent()           # addresses of closed sessions, oldest first
        self._dropped: list[Outbox] = []       # outboxes of forgotten sessions with tasks left
        self.valid: set[str] = set()           # addresses already checked (hot-path memo)
        # set by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._me: WorkerInfo | None = None
        self._zmq: ZmqTransport | None = None
        self._stream: StreamTransport | None = None
        self._bulk: tcp_bulk.BulkTransport | None = None
        self._control: control.ControlClient | None = None
        self._shm: ShmSession | None = None
        self._pull: PullSession | None = None

    def start(self, loop: asyncio.AbstractEventLoop, me: WorkerInfo, *, zmq: ZmqTransport,
              stream: StreamTransport | None, bulk: tcp_bulk.BulkTransport | None, control_client: control.ControlClient,
              shm: ShmSession | None, pull: PullSession | None) -> None:
        """What dialling and departures need, once the communicator has it."""
        self._loop, self._me, self._zmq, self._stream, self._bulk = loop, me, zmq, stream, bulk
        self._control, self._shm, self._pull = control_client, shm, pull

    def __iter__(self) -> Iterator[PeerSession]:
        return iter(self._sessions.values())

    def check_address(self, address: str) -> None:
        """Raise ``ValueError``/``TypeError`` unless ``address`` is ``"group:rank"``."""
        if address not in self.valid:
            parse_address(address)
            if len(self.valid) < _VALID_KEPT:
                self.valid.add(address)

    def connected(self) -> set[str]:
        return {s.address for s in self._sessions.values() if s.outbox.link is not None}

    def pending(self) -> int:
        return sum(len(s.outbox.queue) for s in self._sessions.values())

    # -- opening and dialling ---------------------------------------------------------------
    def open(self, address: str) -> PeerSession:
        """A new session to ``address``, dialled at once when the peer is known, else
        after a lookup (which waits for it to join).

        Raises:
            PeerLostError: ``address`` is known to have left or been lost.
        """
        lost = self._mailbox.is_lost(address)
        if lost is not None:
            raise PeerLostError(str(lost), peer=address)
        session = self._sessions[address] = PeerSession(address, Outbox(address, self._header, self._counters))
        info = self._roster.get(address)
        if info is not None:
            self._connect(session, info)
        else:
            session.task = self._loop.create_task(self._resolve(session))
        return session

    def _connect(self, session: PeerSession, info: WorkerInfo) -> None:
        """Give the session its link to ``info``: at once for ZeroMQ; for a stream, once
        it is connected and authenticated (sends queue meanwhile). A link that cannot be
        made fails the session (its sends raise; none waits for a link that never comes)."""
        try:
            self._dial(session, info)
        except RlinfError as exc:
            self._cannot_connect(session, exc)

    def _cannot_connect(self, session: PeerSession, exc: RlinfError) -> None:
        session.task = None
        error = exc if isinstance(exc, PeerLostError) else PeerLostError(
            f"cannot connect to {session.address}: {exc}", peer=session.address)
        if exc is not error:
            error.__cause__ = exc
        session.fail(error)

    def _dial(self, session: PeerSession, info: WorkerInfo) -> None:
        outbox = session.outbox
        scheme = routing.select_scheme(self._me, info, config=self._config)
        if self._bulk is not None:
            probe = devices.BufferInfo("cpu", max(1, self._config.bulk_threshold))
            if routing.select_transport(self._me, info, probe, config=self._config).transport == routing.BULK:
                outbox.bulk = functools.partial(self._bulk.connect, info.endpoints[tcp_bulk.SCHEME],
                                                identity=self.identity)
        if scheme == routing.STREAM and self._stream is not None:
            outbox.info = info
            session.task = self._loop.create_task(self._dial_stream(session, info))
            return
        session.task = None
        outbox.attach(self._zmq_link(info, scheme), info)

    def _zmq_link(self, info: WorkerInfo, scheme: str):
        endpoint = info.endpoints.get(scheme) or info.endpoints.get("ipc") or info.endpoints["tcp"]
        if not devices.ipc_visible(endpoint) and "tcp" in info.endpoints:   # its /tmp is not ours: TCP
            endpoint = info.endpoints["tcp"]
        return self._zmq.connect_now(endpoint, identity=self.identity)

    async def _dial_stream(self, session: PeerSession, info: WorkerInfo) -> None:
        """Open the stream link of ``session``; a stream that cannot be opened (a peer
        that refuses or stopped listening) is not an error: ZeroMQ carries the messages."""
        try:
            link = await self._stream.connect(info.endpoints[routing.STREAM], identity=self.identity)
        except (PeerLostError, AuthenticationError) as exc:
            if control.process_gone_here(info):   # it died: what waits for the link must fail, not go to ZeroMQ
                session.task = None
                session.fail(PeerLostError(f"{session.address} was lost", peer=session.address))
                return
            log.warning("rlinf %s: no stream to %s (%s); using ZeroMQ", self._address, session.address, exc)
            try:
                link = self._zmq_link(info, "ipc")
            except RlinfError as fallback_failed:
                self._cannot_connect(session, fallback_failed)
                return
        session.task = None
        if session.error is not None:
            link.close()
            return
        session.outbox.attach(link, info)

    async def _resolve(self, session: PeerSession) -> None:
        """Find a peer that is not in our roster yet (waits for it to join)."""
        outbox = session.outbox
        while outbox.link is None and outbox.error is None:
            info = self._roster.get(session.address)
            if info is None:
                try:
                    info = await self._control.lookup(session.address, wait=True, timeout=2.0)
                except CommTimeoutError:
                    continue   # manager slow or restarting: ask again
                except ClosedError as exc:
                    session.task = None
                    session.fail(exc)
                    return
            if info is not None and outbox.link is None and outbox.error is None:
                self._roster.setdefault(info.address, info)
                self._connect(session, info)
                return

    def shm_route(self, session: PeerSession) -> bool:
        """Whether a message whose host payload reaches the shm threshold goes to the
        session's peer through shared memory. The payload of one message is routed as
        one CPU buffer (its buffers share one slot), and ``select_transport`` is pure,
        so its answer is kept in the session (dropped when the roster changes)."""
        route = session.shm_route
        if route is None:
            probe = devices.BufferInfo("cpu", max(1, self._config.shm_threshold))
            chosen = routing.select_transport(self._me, session.info, probe, config=self._config)
            route = session.shm_route = chosen.transport == routing.SHM
        return route

    # -- membership -------------------------------------------------------------------------
    def changed(self, address: str) -> None:
        """``address``'s membership changed: its routes are chosen again."""
        session = self._sessions.get(address)
        if session is not None:
            session.shm_route = None
        self._gpu.changed(address)

    def joined(self, address: str, old: WorkerInfo | None, info: WorkerInfo) -> None:
        """``info`` joined under ``address`` (``old``: the incarnation known before, if
        any). A failed session, or one for an earlier incarnation, is closed and
        forgotten: the next message opens one to the new incarnation."""
        self._gpu.joined(address, info)    # restarted, maybe: its old slots go
        session = self._sessions.get(address)
        if session is not None and (session.error is not None or (old and old.incarnation != info.incarnation)):
            self._drop(address)
            session.close(PeerLostError(f"{address} restarted", peer=address))

    def peer_gone(self, address: str, incarnation: str, kind: str, current: WorkerInfo | None,
                  error: PeerLostError | None) -> None:
        """``address``'s ``incarnation`` left (``kind`` ``"left"``) or was lost: what we
        hold for it goes, and its session closes with ``error``. ``current`` is the
        roster's entry; ``error`` is None when a newer incarnation joined meanwhile (then
        only the pulls of the old one end)."""
        if self._pull is not None:
            self._pull.gone(address, incarnation)
        if error is None:
            return
        session = self._sessions.get(address)
        info = current if current is not None else session.info if session is not None else None
        gone_here = info is not None and info.incarnation == incarnation and control.process_gone_here(info)
        if self._shm is not None:
            self._shm.peer_gone(address, alive=not gone_here)
        self._gpu.gone(address, incarnation, left=kind == "left", process_gone=gone_here)
        if session is not None and (session.info is None or session.info.incarnation == incarnation):
            session.close(error)
            forgotten = self._closed_kept.add(address, DEAD_KEPT)
            old = self._sessions.get(forgotten) if forgotten is not None else None
            if old is not None and old.error is not None:
                self._drop(forgotten)   # bounded: a send there now waits for it to join

    # -- our close --------------------------------------------------------------------------
    def close_all(self, linger_ms: int, error: BaseException) -> list:
        """Close every session (we close): what was flushed still goes out for up to
        ``linger_ms``; the rest fails with ``error``. Returns what to await for the links
        whose own loop writes what they buffered (stream links)."""
        flushing = []
        for session in self._sessions.values():
            if session.closed:     # failed its sends already
                continue
            outbox = session.outbox
            outbox.flush()
            session.closed = True
            if session.task is not None:
                session.task.cancel()
                session.task = None
            flushed = outbox.close(linger_ms, error)
            if flushed is not None:
                flushing.append(flushed)
        return flushing

    def _drop(self, address: str) -> None:
        """Forget ``address``'s session; its outbox's tasks (a release still awaited)
        stay owned here until they end, so our close still cancels them."""
        session = self._sessions.pop(address)
        self._dropped = [o for o in self._dropped if o.tasks]
        if session.outbox.tasks:
            self._dropped.append(session.outbox)

    def tasks(self) -> Iterator[asyncio.Task]:
        """Every task the sessions run (lookups, dials, the outboxes'), not yet done."""
        for session in self._sessions.values():
            if session.task is not None and not session.task.done():
                yield session.task
            yield from session.outbox.tasks
        for outbox in self._dropped:
            yield from outbox.tasks

    def cancel_tasks(self) -> None:
        """After :meth:`close_all` and the transports closed: cancel what the outboxes
        still await (nothing, normally: the transports released every buffer), those of
        forgotten sessions included."""
        for session in self._sessions.values():
            session.outbox.cancel_tasks()
        for outbox in self._dropped:
            outbox.cancel_tasks()
        self._dropped.clear()
