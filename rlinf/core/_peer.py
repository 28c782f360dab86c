"""Per-peer sessions: what this communicator keeps for one remote incarnation.

A :class:`PeerSession` is the unit of per-peer state: the link(s) to the peer and its
:class:`~rlinf.core._outbox.Outbox` (ordering, coalescing, backpressure, the numbered
log of what was sent), the lookup or dial task that gets the link, the route memo, and
its failure. :class:`PeerSessions` is the communicator's registry of them and of what
arrived from each sender incarnation (the receive side of the delivery protocol, see
:mod:`rlinf.core._delivery`): it opens a session on first use, dials it (again, when a
link breaks), runs the resend timers and sends the acknowledgements, and is the one
place a departed or restarted peer's state goes, its session's and what the
shared-memory, pull and CUDA IPC sessions hold for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Iterator

from ..control import client as control, devices
from ..errors import (AuthenticationError, ClosedError, CommTimeoutError, PeerLostError, RlinfError,
                      TransportUnavailableError)
from ..info import WorkerInfo, parse_address
from ..transports import tcp_bulk
from ..transports.cuda import CudaIpcSession, CudaPeer
from ..transports.shm import PullPeer, PullSession, ShmPeer, ShmSession
from ..transports.stream import StreamTransport
from ..transports.zeromq import ZmqTransport
from ..util.bounded import Recent
from . import routing, wire
from ._credit import DEFAULT_WINDOW, Window
from ._delivery import ACK_DELAY, GAP_DELAY, RTO, TICK, Inflow
from ._gpu_paths import GpuPaths
from ._mailbox import Mailbox
from ._outbox import Outbox
from .stats import Counters

__all__ = ["PeerSession", "PeerSessions", "DEAD_KEPT", "UNREGISTERED_WARNING"]

log = logging.getLogger("rlinf.core.communicator")

#: Incarnations of peers known gone (their late frames are dropped), and closed sessions
#: (sends to them fail at once), that are remembered, the oldest forgotten first: a peer
#: restarted under one name adds one each time.
DEAD_KEPT = 4096
#: How many addresses the hot path remembers as already checked.
_VALID_KEPT = 100_000
#: Seconds a send waits for an address the manager does not know before a warning is
#: logged (once per address): a typo in an address, or a worker that never started,
#: otherwise shows only as a send that never completes.
UNREGISTERED_WARNING = 10.0
#: Seconds one lookup of a peer not yet known waits for the manager's answer before it
#: is asked again (a manager that restarted forgot the question).
_LOOKUP_RETRY = 2.0


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
    * ``unregistered``: the manager answered that no worker holds ``address`` (set
      before ``info``; a session for such an address is dropped as soon as no message
      waits in it). ``no_wait``: futures of messages queued with ``wait_for_peer=False``
      before that answer; they are withdrawn and failed if the answer is "unknown".

    Delivery (:mod:`rlinf.core._delivery`): the outbox numbers what it sends in its
    ``log`` and keeps it until acknowledged; a link that breaks while the peer may live
    is dialled again (``redials``, with a back-off) and the kept frame sets go first on
    the new one. What arrives *from* the peer is its :class:`~rlinf.core._delivery.Inflow`,
    kept by the registry per sender incarnation (it outlives sessions: a peer declared
    lost that comes back resumes it), and linked to the outbox, whose frame sets carry
    its acknowledgement.

    What the transports keep about the peer: ``shm`` (a
    :class:`~rlinf.transports.shm.ShmPeer`: slots of ours it holds, releases we owe it,
    its segments we map) and ``pull`` (a :class:`~rlinf.transports.shm.PullPeer`: the
    pull agreement with this incarnation, its process, its reads), attached once the
    incarnation is known. They are :class:`~rlinf.transports.base.PeerState` objects
    with a lifecycle of their own: closing the session (a broken link, a restart seen
    first as a join) leaves them be, because the peer may live and hold our slots; they
    close once, when the incarnation is gone (:meth:`PeerSessions.peer_gone`, the one
    place the transports learn of it). Likewise ``cuda`` (a
    :class:`~rlinf.transports.cuda.CudaPeer`: notices we owe it about GPU slots), once
    this communicator has a CUDA IPC session; it closes when the peer left or its
    process is gone (a peer only taken for lost may come back to its slots; see
    :meth:`~rlinf.core._gpu_paths.GpuPaths.gone`). Not here yet: the mailbox's lost-state.
    """

    __slots__ = ("address", "outbox", "shm_route", "task", "closed", "redials", "unregistered", "no_wait",
                 "shm", "pull", "cuda")

    def __init__(self, address: str, outbox: Outbox) -> None:
        self.address = address
        self.outbox = outbox
        self.shm_route: bool | None = None    # large CPU payloads to it go by shared memory
        self.task: asyncio.Task | None = None
        self.closed = False
        self.redials = 0                      # links dialled again after one broke
        self.unregistered = False             # the manager said no worker holds the address
        self.no_wait: list[asyncio.Future] = []   # sends that must not wait for it to register
        self.shm: ShmPeer | None = None       # what the transports keep about it (see above)
        self.pull: PullPeer | None = None
        self.cuda: CudaPeer | None = None

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
        window: the credit window it grants each sender (and assumes of a receiver that
            does not say; see :mod:`rlinf.core._credit`).
    """

    def __init__(self, address: str, incarnation: str, header: wire.HeaderPacker, counters: Counters,
                 config: routing.RoutingConfig, roster: dict[str, WorkerInfo], mailbox: Mailbox, gpu: GpuPaths,
                 window: Window = DEFAULT_WINDOW) -> None:
        self._address = address
        self.window = window
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
        #: what arrived from each sender incarnation, by its links' identity (the receive
        #: side of the delivery protocol, see rlinf.core._delivery)
        self.inflows: dict[bytes, Inflow] = {}
        self._lost_inflows = Recent()          # identities of lost senders' inflows, oldest first
        self._logs = Recent()                  # (address, incarnation) -> the log of a dropped session
        self._watch: asyncio.Task | None = None   # the resend timers
        self._closing = False
        self._warned = Recent()                # unregistered addresses a warning was logged for
        self.trace = None                      # the trace recorder every outbox gets (None: off)
        # set by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._me: WorkerInfo | None = None
        self._zmq: ZmqTransport | None = None
        self._streams: dict[str, StreamTransport | None] = {}     # by scheme: stream, tcp_stream
        self._bulk: tcp_bulk.BulkTransport | None = None
        self._control: control.ControlClient | None = None
        self._shm: ShmSession | None = None
        self._pull: PullSession | None = None

    def start(self, loop: asyncio.AbstractEventLoop, me: WorkerInfo, *, zmq: ZmqTransport,
              stream: StreamTransport | None, bulk: tcp_bulk.BulkTransport | None, control_client: control.ControlClient,
              shm: ShmSession | None, pull: PullSession | None, tcp_stream: StreamTransport | None = None) -> None:
        """What dialling and departures need, once the communicator has it."""
        self._loop, self._me, self._zmq, self._bulk = loop, me, zmq, bulk
        self._streams = {routing.STREAM: stream, routing.TCP_STREAM: tcp_stream}
        self._control, self._shm, self._pull = control_client, shm, pull
        self._watch = loop.create_task(self._resend_timers())

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

    def credits(self) -> dict:
        """The flow-control state of each session (``rlinf.core._credit.Credit``), by peer."""
        return {address: session.outbox.credit for address, session in self._sessions.items()}

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
        session = self._sessions[address] = PeerSession(address, Outbox(address, self._header, self._counters,
                                                                              window=self.window))
        session.outbox.trace = self.trace
        session.outbox.redial = functools.partial(self._redial, session)
        info = self._roster.get(address)
        if info is not None:
            self._connect(session, info)
        else:
            session.task = self._loop.create_task(self._resolve(session))
        return session

    def _connect(self, session: PeerSession, info: WorkerInfo) -> None:
        """Give the session its link to ``info``: at once for ZeroMQ; for a stream, once
        it is connected and authenticated (sends queue meanwhile). A link that cannot be
        made fails the session (its sends raise; none waits for a link that never comes).
        A new session to an incarnation we had one with before resumes its log."""
        outbox = session.outbox
        outbox.credit.window = Window.from_meta(info.meta, self.window)
        if self._shm is not None:
            session.shm = self._shm.peer(info.address)
        if self._pull is not None:
            session.pull = self._pull.peer(info.address, info.incarnation)
        if self._gpu.session is not None:
            session.cuda = self._gpu.session.peer(info.address)
        identity = f"{info.address}|{info.incarnation}".encode()
        outbox.inflow = self.inflows.get(identity)
        if outbox.log.next == 0:
            log_ = self._logs.pop((info.address, info.incarnation), None)
            if log_ is not None:
                outbox.log = log_
                outbox.credit.resume(log_.kept)
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

    @property
    def has_bulk(self) -> bool:
        """Whether we can dial bulk streams (large payloads to other nodes)."""
        return self._bulk is not None

    def _dial(self, session: PeerSession, info: WorkerInfo) -> None:
        outbox = session.outbox
        scheme = routing.select_scheme(self._me, info, config=self._config)
        if self._bulk is not None:
            probe = devices.BufferInfo("cpu", max(1, self._config.bulk_threshold))
            if routing.select_transport(self._me, info, probe, config=self._config).transport == routing.BULK:
                outbox.bulk = functools.partial(self._bulk.connect, info.endpoints[tcp_bulk.SCHEME],
                                                identity=self.identity)
        if self._streams.get(scheme) is not None:
            outbox.info = info
            session.task = self._loop.create_task(self._dial_stream(session, info, scheme))
            return
        session.task = None
        outbox.attach(self._zmq_link(info, scheme), info)

    def _zmq_link(self, info: WorkerInfo, scheme: str):
        endpoint = info.endpoints.get(scheme) or info.endpoints.get("ipc") or info.endpoints["tcp"]
        if not devices.ipc_visible(endpoint) and "tcp" in info.endpoints:   # its /tmp is not ours: TCP
            endpoint = info.endpoints["tcp"]
        return self._zmq.connect_now(endpoint, identity=self.identity)

    async def _dial_stream(self, session: PeerSession, info: WorkerInfo, scheme: str) -> None:
        """Open the stream link of ``session`` (a Unix one on this node, TCP to another);
        a stream that cannot be opened (a peer that refuses, stopped listening or shares
        no cipher with us) is not an error: ZeroMQ carries the messages."""
        try:
            link = await self._streams[scheme].connect(info.endpoints[scheme], identity=self.identity)
        except (PeerLostError, AuthenticationError, TransportUnavailableError) as exc:
            if control.process_gone_here(info):   # it died: what waits for the link must fail, not go to ZeroMQ
                session.task = None
                session.fail(PeerLostError(f"{session.address} was lost", peer=session.address))
                return
            log.warning("rlinf %s: no stream to %s (%s); using ZeroMQ", self._address, session.address, exc)
            try:
                link = self._zmq_link(info, "ipc" if scheme == routing.STREAM else "tcp")
            except RlinfError as fallback_failed:
                self._cannot_connect(session, fallback_failed)
                return
        session.task = None
        if session.error is not None:
            link.close()
            return
        session.outbox.attach(link, info)

    async def _resolve(self, session: PeerSession) -> None:
        """Find a peer that is not in our roster yet (waits for it to join).

        The first question to the manager does not wait: its answer tells whether the
        address is registered at all. If not, the sends that must not wait for it fail
        (:meth:`no_wait`), a warning is due if the others wait :data:`UNREGISTERED_WARNING`
        seconds, and the next questions wait for it to register."""
        outbox = session.outbox
        warning = None
        try:
            while outbox.link is None and outbox.error is None:
                info = self._roster.get(session.address)
                if info is None:
                    try:
                        info = await self._control.lookup(session.address, wait=session.unregistered,
                                                          timeout=_LOOKUP_RETRY)
                    except CommTimeoutError:
                        continue   # manager slow or restarting: ask again
                    except ClosedError as exc:
                        session.task = None
                        session.fail(exc)
                        return
                    if info is None:    # only a question that does not wait gets this answer
                        session.unregistered = True
                        if not self._withdraw(session, session.no_wait):
                            return      # nothing waits for it any more: the session is gone
                        if warning is None and session.address not in self._warned:
                            warning = self._loop.call_later(UNREGISTERED_WARNING, self._still_unregistered,
                                                            session)
                        continue
                if info is not None and outbox.link is None and outbox.error is None:
                    session.no_wait.clear()
                    self._roster.setdefault(info.address, info)
                    self._connect(session, info)
                    return
        finally:
            if warning is not None:
                warning.cancel()

    def _still_unregistered(self, session: PeerSession) -> None:
        if session.address in self._warned:
            return
        outbox = session.outbox
        if outbox.queue and outbox.link is None and outbox.error is None and session.info is None:
            self._warned.add(session.address, DEAD_KEPT)
            log.warning("rlinf %s: %d message(s) to %s have waited %g s for it to register, and no worker "
                        "with that address has registered so far (a typo, or a worker that did not "
                        "start?); sends wait for a peer to join unless made with wait_for_peer=False",
                        self._address, len(outbox.queue), session.address, UNREGISTERED_WARNING)

    def no_wait(self, address: str, future: asyncio.Future) -> None:
        """``future``'s message was just queued to ``address`` with ``wait_for_peer=False``:
        if the manager says no worker holds ``address``, it is withdrawn and ``future``
        fails with :class:`~rlinf.PeerLostError`, at once when that is known already,
        else when the lookup the session runs answers (a peer known here is not asked
        about)."""
        session = self._sessions.get(address)
        if session is None or session.info is not None or future.done() or address in self._roster:
            return      # ourselves, or a peer we know
        if session.unregistered:
            self._withdraw(session, [future])
        else:
            session.no_wait.append(future)

    def gave_up(self, address: str, future: asyncio.Future) -> bool:
        """A send to ``address`` (``future``'s) timed out. Whether that is because the
        manager says no worker holds ``address``; if so, its message is withdrawn at
        once (it was not sent: no lookup keeps running for it)."""
        session = self._sessions.get(address)
        if session is None or not session.unregistered or session.info is not None:
            return False
        self._withdraw(session, [future])
        return True

    def _withdraw(self, session: PeerSession, futures: list[asyncio.Future]) -> bool:
        """Take the messages of ``futures`` back (still queued: the address is not
        registered) and fail those still pending, with ``PeerLostError``; drop the
        session if that left no message in it, so that no lookup keeps running for an
        address nobody registered (a session opened for another reason, such as an
        acknowledgement we owe, stays). Whether the session stays."""
        address, outbox = session.address, session.outbox
        withdrawn = False
        for future in futures:
            if outbox.withdraw(future):
                withdrawn = True
                if not future.done():
                    future.set_exception(PeerLostError(
                        f"{address} has never registered: no worker with that address is in the cluster "
                        "(sent with wait_for_peer=False)", peer=address))
        futures.clear()
        if not withdrawn or outbox.queue or outbox.credit.waiting or self._sessions.get(address) is not session:
            return True
        del self._sessions[address]
        if session.task is not None and session.task is not asyncio.current_task():
            session.task.cancel()
        session.task = None
        return False

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

    def _redial(self, session: PeerSession, exc: BaseException) -> None:
        """The session's link broke: dial it again while its peer may live (the outbox
        sends again what was not acknowledged), else fail the session."""
        info, address = session.info, session.address
        if (info is None or self._closing or session.closed or self._mailbox.is_lost(address) is not None
                or control.process_gone_here(info)):
            error = PeerLostError(f"the link to {address} broke: {exc}", peer=address)
            error.__cause__ = exc
            session.fail(error)
            return
        session.redials += 1
        delay = 0.0 if session.redials == 1 else min(1.0, 0.05 * 2 ** (session.redials - 2))
        log.warning("rlinf %s: the link to %s broke (%s); dialling it again", self._address, address, exc)
        session.task = self._loop.create_task(self._dial_again(session, info, delay))

    async def _dial_again(self, session: PeerSession, info: WorkerInfo, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)     # a back-off between dials, not a synchronisation
        session.task = None
        if session.error is None and session.outbox.link is None:
            self._connect(session, info)

    async def _resend_timers(self) -> None:
        """Every :data:`TICK`: send again what a peer has not acknowledged for the resend
        timeout (see :meth:`rlinf.core._delivery.SendLog.due`)."""
        while True:
            await asyncio.sleep(TICK)     # a periodic timer, not a synchronisation
            for session in list(self._sessions.values()):
                outbox = session.outbox
                if outbox.error is None and outbox.log.due() and outbox.link is not None:
                    log.info("rlinf %s: nothing acknowledged by %s for a while; sending %d frame sets again",
                             self._address, session.address, len(outbox.log.kept))
                    outbox.resend()
            for inflow in list(self.inflows.values()):
                # a sender may wait for room our last report did not show (see rlinf.core._credit)
                if inflow.stale:
                    self._report_room(inflow)

    # -- the receive side of the delivery protocol -------------------------------------------
    def new_inflow(self, identity: bytes, address: str, incarnation: str) -> Inflow:
        """The first frame set from ``address``'s ``incarnation``: what arrives from it
        is numbered from now on (its acknowledgements ride on our session to it)."""
        inflow = self.inflows[identity] = Inflow(address, incarnation, identity)
        inflow.step, inflow.step_bytes = max(1, self.window.msgs // 4), max(1, self.window.nbytes // 4)
        inflow.notify = functools.partial(self._report_room, inflow)
        session = self._sessions.get(address)
        if session is not None and session.info is not None and session.info.incarnation == incarnation:
            session.outbox.inflow = inflow
        return inflow

    def owe_ack(self, inflow: Inflow, urgent: bool) -> None:
        """``inflow`` has something to acknowledge: within :data:`ACK_DELAY` (on the next
        frame set to its sender, or on its own), or in this loop turn when ``urgent``."""
        inflow.owed = True
        if inflow.timer is None:
            inflow.timer = self._loop.call_later(0.0 if urgent else ACK_DELAY, self._ack, inflow)
        elif urgent:
            self._loop.call_soon(self._ack, inflow)

    def _report_room(self, inflow: Inflow) -> None:
        """Our application took messages of ``inflow``'s sender: tell it now (with an
        acknowledgement), it may be waiting for that room."""
        inflow.owed = True
        self._ack(inflow)

    def gap(self, inflow: Inflow) -> None:
        """A frame set from ``inflow``'s sender arrived ahead of one before it: ask for a
        resend if the gap lasts (a frame set on another link may just be late)."""
        if inflow.gap_timer is None:
            inflow.gap_timer = self._loop.call_later(GAP_DELAY, self._gap_lasts, inflow)

    def gap_closed(self, inflow: Inflow) -> None:
        if inflow.gap_timer is not None:
            inflow.gap_timer.cancel()
            inflow.gap_timer = None

    def _gap_lasts(self, inflow: Inflow) -> None:
        inflow.gap_timer = None
        if inflow.parked and self.inflows.get(inflow.identity) is inflow:
            self._ack(inflow, nack=True)
            inflow.gap_timer = self._loop.call_later(RTO, self._gap_lasts, inflow)

    def _ack(self, inflow: Inflow, nack: bool = False) -> None:
        """Send what ``inflow`` owes its sender (now, on its own frame set)."""
        inflow.timer = None
        if not (inflow.owed or nack) or self._closing:
            return
        session = self._sessions.get(inflow.address)
        if session is None:
            try:
                session = self.open(inflow.address)
            except PeerLostError:
                return
        if session.error is not None or session.closed:
            return
        if session.outbox.inflow is inflow:    # else: not connected yet, it acknowledges once it is
            session.outbox.send_ack(nack)

    def forget_inflow(self, identity: bytes, left: bool) -> None:
        """A sender incarnation is gone: what arrived from it is forgotten when it left
        (it will not send again); a lost one's is kept a while in case it comes back."""
        if left:
            inflow = self.inflows.pop(identity, None)
            if inflow is not None:
                inflow.cancel_timers()
            return
        forgotten = self._lost_inflows.add(identity, DEAD_KEPT)
        if forgotten is not None:
            inflow = self.inflows.pop(forgotten, None)
            if inflow is not None:
                inflow.cancel_timers()

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
        if old is not None and old.incarnation != info.incarnation:
            self.forget_inflow(f"{address}|{old.incarnation}".encode(), left=True)
            if self._shm is not None:      # and those of ours it held: the new one starts afresh
                self._shm.peer(address).close(process_gone=control.process_gone_here(old))
        session = self._sessions.get(address)
        if session is not None and (session.error is not None or (old and old.incarnation != info.incarnation)):
            self._drop(address)
            session.close(PeerLostError(f"{address} restarted", peer=address))
        resumed = self._logs.get((address, info.incarnation))
        if resumed is not None and resumed.kept and address not in self._sessions and not self._closing:
            self.open(address)     # it came back: what it had not acknowledged goes again
        elif session is not None and session.error is None and self._sessions.get(address) is session:
            session.outbox.resend()    # it may have dropped what we sent while it was taken for lost
            session.outbox.log.rto = RTO

    def cuda_started(self, cuda: CudaIpcSession) -> None:
        """This communicator has a CUDA IPC session now: each connected session gets what
        it keeps about its peer."""
        for session in self._sessions.values():
            if session.info is not None and session.cuda is None:
                session.cuda = cuda.peer(session.address)

    def peer_gone(self, address: str, incarnation: str, kind: str, info: WorkerInfo | None,
                  error: PeerLostError | None) -> None:
        """``address``'s ``incarnation`` left (``kind`` ``"left"``) or was lost: what we
        hold for it goes, and its session closes with ``error``. ``info`` is what the
        roster knew of that incarnation, if anything; ``error`` is None when a newer
        incarnation joined meanwhile (then only the pulls of the old one end)."""
        if self._pull is not None:
            self._pull.peer(address, incarnation).close()
        if error is None:
            return
        session = self._sessions.get(address)
        if info is None and session is not None:
            info = session.info
        gone_here = info is not None and info.incarnation == incarnation and control.process_gone_here(info)
        if self._shm is not None:
            self._shm.peer(address).close(process_gone=gone_here)
        self._gpu.gone(address, incarnation, left=kind == "left", process_gone=gone_here)
        if session is not None and (session.info is None or session.info.incarnation == incarnation):
            session.close(error)
            forgotten = self._closed_kept.add(address, DEAD_KEPT)
            old = self._sessions.get(forgotten) if forgotten is not None else None
            if old is not None and old.error is not None:
                self._drop(forgotten)   # bounded: a send there now waits for it to join

    # -- our close --------------------------------------------------------------------------
    async def drain(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s until every live peer acknowledged all we sent it;
        the addresses of those that did not."""
        waiting = {}
        for session in self._sessions.values():
            if session.error is None and not session.closed:
                settled = session.outbox.settled()
                if settled is not None:
                    waiting[settled] = session.address
        if not waiting:
            return []
        _, pending = await asyncio.wait(waiting, timeout=timeout)
        for settled in pending:
            settled.cancel()
        return sorted(waiting[w] for w in pending
                      if (s := self._sessions.get(waiting[w])) is not None and s.error is None)

    def close_all(self, linger_ms: int, error: BaseException) -> list:
        """Close every session (we close): what was flushed still goes out for up to
        ``linger_ms``; the rest fails with ``error``. Returns what to await for the links
        whose own loop writes what they buffered (stream links)."""
        flushing = []
        self._closing = True
        for inflow in self.inflows.values():
            inflow.cancel_timers()
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
        if session.info is not None and session.outbox.log.next:   # the same incarnation may come back
            self._logs.add((address, session.info.incarnation), DEAD_KEPT, session.outbox.log)
        self._dropped = [o for o in self._dropped if o.tasks]
        if session.outbox.tasks:
            self._dropped.append(session.outbox)

    def tasks(self) -> Iterator[asyncio.Task]:
        """Every task the sessions run (lookups, dials, the outboxes'), not yet done."""
        if self._watch is not None and not self._watch.done():
            yield self._watch
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
        if self._watch is not None:
            self._watch.cancel()
        for session in self._sessions.values():
            session.outbox.cancel_tasks()
        for outbox in self._dropped:
            outbox.cancel_tasks()
        self._dropped.clear()
