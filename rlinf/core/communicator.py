"""The Communicator's core: one worker's endpoint in the cluster, as a facade.

It owns the mailbox for what arrives, a :class:`~rlinf.core._peer.PeerSessions`
registry of per-peer sessions, and a :class:`~rlinf.core._lifecycle.Lifecycle`: what
start() brings up (the ZeroMQ context, the data listeners, the shared-memory and pull
sessions, the session with the manager), in which order, and how close tears it down.
The work is done elsewhere in this package: the send path (:mod:`._send`), the receive
path (:mod:`._receive`: frame reading, the mailbox, decoding), membership
(:mod:`._membership`), the link scheme (:mod:`.routing`), queueing and coalescing
(:mod:`._outbox`). Subsystems use :attr:`CoreCommunicator.internal` (:mod:`.interface`).

Connections are lazy: nothing is dialled until the first message to a peer. A peer not
yet registered is looked up (the lookup waits for it to join), so a worker that joins
late is reachable at once; a send made with ``wait_for_peer=False`` fails instead when
the manager does not know the address.

Timeouts: every operation that takes ``timeout=`` runs, when given None, with
``Settings.timeout`` (``RLINF_TIMEOUT``; None: forever), applied by
:func:`rlinf.info.check_timeout` (subsystems: ``internal.timeout_of``).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Self

from ..config import Settings, visible_devices
from ..codec import Codec
from ..control.security import ClusterKeys
from ..errors import ClosedError, CommTimeoutError
from ..info import MembershipEvent, WorkerInfo, check_plain, check_timeout, failure_summary, parse_address
from ..transports import shm
from ..transports.cuda import CudaIpcSession
from ..util.bounded import Recent
from . import routing, wire
from ._access import CoreAccess
from ._busypoll import BusyPoll
from ._credit import Window
from ._gpu_paths import GpuPaths
from ._lifecycle import Lifecycle, Parts
from ._mailbox import Mailbox
from ._membership import Membership
from ._peer import PeerSessions
from ._receive import ReceivePath
from ._send import SendPath
from ._threads import run_threadsafe, wait_for
from ._trace import Recorder
from .interface import Core
from .stats import CommStats, Counters, StatsReports
from .work import Work

__all__ = ["CoreCommunicator"]

_TAG_MIN, _TAG_MAX = wire.INT_MIN, wire.INT_MAX   # the hot path's inline check


class CoreCommunicator:
    """The messaging core of a :class:`rlinf.Communicator` (which adds groups, resharding
    and channels on top; see it for the arguments): point-to-point messaging, membership,
    the per-peer sessions, the mailbox, start and close. A channel server process runs
    on this class alone.

    Subsystems use :attr:`internal` (:class:`rlinf.core.interface.Core`).
    """

    def __init__(self, address: str | None = None, *, manager: str | None = None, token: str | None = None,
                 codec: Codec | None = None, connect_timeout: float = 30.0, meta: dict | None = None,
                 shm_views: bool | None = None, exclusive: bool = False,
                 manager_host: str | None = None, disable: Iterable[str] = (),
                 forwards_unchanged: bool = False, settings: Settings | None = None) -> None:
        if settings is None:
            settings = Settings.from_env()     # here, not at import: launchers set variables late
        elif not isinstance(settings, Settings):
            raise TypeError(f"settings must be a rlinf.config.Settings, got {type(settings).__name__}")
        self._settings = settings
        self._timeout = settings.timeout     # RLINF_TIMEOUT: what timeout=None means here
        address = address or settings.address
        if not address:
            raise ValueError("no worker address: pass address='group:rank' or set RLINF_ADDRESS")
        parse_address(address)
        self.manager_address = manager or settings.manager or ""
        if not self.manager_address:
            raise ValueError("no manager: pass manager='tcp://host:port' or set RLINF_MANAGER")
        token = token or settings.token
        if not token:
            raise ValueError("no cluster token: pass token=... or set RLINF_TOKEN")
        self.address = address
        self.incarnation = secrets.token_hex(8)
        self.info: WorkerInfo | None = None
        self._codec = codec or Codec()
        meta = dict(meta or {})
        check_plain(meta, "meta")     # the manager refuses a registration with other data
        self._roster: dict[str, WorkerInfo] = {}
        self._busy_poll = BusyPoll(settings.busy_poll_us)
        self._mailbox = Mailbox(self._busy_poll)
        self._dead = Recent()     # (address, incarnation) of peers known gone
        self._reports = StatsReports(address, self.stats)      # what heartbeats carry
        self._reports.add("busy_poll", self._busy_poll.report)
        self._counters = Counters(address)
        self._header = wire.HeaderPacker(address, self.incarnation)   # one for every outbox
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closed: ClosedError | None = None     # the lifecycle's (see _set_closed)
        self._started = False
        self._routing = routing.RoutingConfig.from_settings(settings)
        if disable:
            self._routing = self._routing.without(disable)
        if shm_views is None:
            shm_views = settings.shm_views
        elif not isinstance(shm_views, bool):
            raise TypeError(f"shm_views must be a bool, got {shm_views!r}")
        self._shm_views = shm_views
        self._guard_relays = not forwards_unchanged
        recycler = shm.Recycler(settings.shm_cap)   # receive-side private memory (chunk reassembly, copy-outs)
        self._gpu = GpuPaths(address, self._roster, self._routing, self._new_cuda_session)
        # the parts: per-peer sessions, the send and receive paths, membership
        window = Window(settings.window_msgs, settings.window_bytes)
        self._sessions = PeerSessions(address, self.incarnation, self._header, self._counters, self._routing,
                                      self._roster, self._mailbox, self._gpu, window)
        self._send = SendPath(address, self.incarnation, self._codec, self._sessions, self._mailbox, self._gpu,
                              self._routing, self._check_open)
        self._membership = Membership(address, self._roster, self._dead, self._mailbox, self._sessions,
                                      lambda: self._closed is not None)
        self._receive = ReceivePath(address, self._codec, self._mailbox, self._counters, self._dead, shm_views,
                                    self._sessions, self._guard, self._membership.said_bye)
        # RLINF_TRACE: this communicator's timeline (see rlinf/core/_trace.py); None: off
        self._trace = Recorder(settings.trace, address, self.incarnation, self._clock_offset) \
            if settings.trace else None
        self._sessions.trace = self._receive.trace = self._trace
        # what start() brings up, in which order, and how close() tears it down
        self._lifecycle = Lifecycle(Parts(
            address=address, incarnation=self.incarnation, keys=ClusterKeys(token), settings=settings,
            config=self._routing, manager_address=self.manager_address,
            manager_host=manager_host if manager_host is None else str(manager_host), exclusive=bool(exclusive),
            meta=meta, connect_timeout=connect_timeout, visible_devices=visible_devices(),
            shm_views=shm_views, guard_relays=self._guard_relays, recycler=recycler,
            sessions=self._sessions, send=self._send, receive=self._receive, membership=self._membership,
            mailbox=self._mailbox, gpu=self._gpu, reports=self._reports, counters=self._counters,
            trace=self._trace), self._set_closed)
        self._internal = CoreAccess(self, token, self._codec, self._send, self._receive, self._mailbox,
                                    self._roster, check_open=self._check_open, guard=self._guard,
                                    lookup=self._lookup, departed=self._membership.departed,
                                    timeout=settings.timeout)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._started else "new")
        return (f"<Communicator {self.address} {state} peers={len(self._roster)} "
                f"connections={len(self._sessions.connected())} "
                f"pending_sends={self._sessions.pending()} queued_recvs={len(self._mailbox)}>")

    @property
    def internal(self) -> Core:
        """The core's interface for rlinf's own subsystems (collectives, channels, the
        launcher): see :mod:`rlinf.core.interface`. Not for applications."""
        return self._internal

    @property
    def closed(self) -> bool:
        """True once closed (:meth:`aclose`) or failed to start: every operation raises
        :class:`~rlinf.errors.ClosedError` from then on."""
        return self._closed is not None

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, Exception):     # not a cancellation, Ctrl-C or exit: those leave
            self._lifecycle.failure = failure_summary(exc)
        await self.aclose()

    async def start(self) -> Self:
        """Bind data sockets and register with the manager.

        Raises:
            AuthenticationError: the manager refused the token.
            AddressInUseError: ``exclusive`` and a live worker holds our address.
            CommTimeoutError: no manager answered within ``connect_timeout``.
        """
        if self._started:
            return self
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.info = await self._lifecycle.start()     # closes us again if it fails
        self._started = True
        return self

    def _new_cuda_session(self) -> CudaIpcSession:
        session = CudaIpcSession(self._loop, functools.partial(self._send.notice, tag="cuda"),
                                 self.incarnation, views=self._shm_views, cap=self._settings.cuda_ipc_cap)
        self._sessions.cuda_started(session)
        return session

    def _set_closed(self, error: ClosedError) -> None:
        self._closed = error     # the lifecycle's, kept here for the check of every operation

    async def aclose(self) -> None:
        """Deregister, fail pending operations with ``ClosedError``, release everything.

        What was handed over is delivered first, within a bounded linger (2 s each):
        the work subsystems accepted (channel puts reach their channel while the
        communicator is still open), then every message sent, which each live receiver
        must acknowledge. Idempotent; safe to call from a cancelled task.

        Raises:
            PeerLostError, CommTimeoutError, ClosedError: some of that could not be
                delivered in time (or its peer is gone): it may not have arrived. The
                communicator is closed all the same.
        """
        await self._lifecycle.aclose()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed
        if not self._started:
            raise ClosedError("communicator is not started: use 'async with rlinf.connect(...)'")

    def _guard(self) -> None:
        """The check of every operation: open, and on the loop's thread."""
        if self._closed is not None or not self._started:
            self._check_open()
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(f"communicator {self.address} is used on its own event loop's thread only; from "
                               "another thread use its blocking_* methods (or asyncio.run_coroutine_threadsafe)")

    def _clock_offset(self) -> tuple[float, float] | None:
        """Our clock against the manager's, for the trace: ``(offset, round_trip)``."""
        control = self._lifecycle.control
        return control.clock.offset if control is not None else None

    async def _lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        return await self._lifecycle.control.lookup(address, wait=wait, timeout=timeout)

    # -- sending -----------------------------------------------------------------------
    async def send(self, obj: Any, dst: str, *, tag: int = 0, timeout: float | None = None,
                   wait_for_peer: bool = True) -> None:
        """Send ``obj`` to ``dst``.

        Returns when the buffers of ``obj`` may be reused: small messages (< 1 MiB) are
        copied at once, large ones are sent zero-copy and awaited until released, and a
        same-node message whose payload reaches the shared-memory threshold is copied
        once into a shared-memory slot, or, to a receiver that takes owned copies and
        agreed to, awaited until it has read the buffers from our memory (see
        ``docs/transports.md``).

        Args:
            obj: what to send. dst: the receiver's ``"group:rank"``. tag: an int.
            timeout: seconds (None: ``RLINF_TIMEOUT`` if set, else forever).
            wait_for_peer: a ``dst`` that has not registered yet is waited for (True,
                the default: a worker that joins late gets the message; a warning is
                logged after 10 s of waiting for an address the manager does not know).
                False: if the manager does not know ``dst``, the message is taken back
                and ``PeerLostError`` raised at once.

        Raises:
            PeerLostError: ``dst`` died or left (or, with ``wait_for_peer=False``, has
                never registered). CommTimeoutError: not sent in ``timeout`` (its
                message says when ``dst`` has never registered).
            EncodeError: ``obj`` cannot be encoded. ClosedError: we are closed.
        """
        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            wire.check_tag(tag)
        if timeout is None:       # check_timeout(timeout, self._timeout), inline: the hot path
            timeout = self._timeout
        else:
            timeout = check_timeout(timeout)
        self._guard()
        sender = self._send
        future = sender.enqueue(obj, dst, tag, wire.USER, need_future=not wait_for_peer)
        if not wait_for_peer:
            self._sessions.no_wait(dst, future)
        if future is not None:
            try:
                await wait_for(future, timeout, f"{self.address}: send to {dst}")
            except CommTimeoutError as exc:
                if self._sessions.gave_up(dst, future):
                    raise CommTimeoutError(f"{exc}: {dst} has never registered (no worker with that address "
                                           "has joined the cluster)") from None
                raise
        if sender.behind(dst):
            await sender.room(dst)

    def async_send(self, obj: Any, dst: str, *, tag: int = 0, wait_for_peer: bool = True) -> Work[None]:
        """Start a send now (ordering is fixed by this call) and return its :class:`Work`
        (``wait_for_peer`` as for :meth:`send`: False fails the Work with
        ``PeerLostError`` if the manager does not know ``dst``)."""
        wire.check_tag(tag)
        self._guard()
        future = self._send.enqueue(obj, dst, tag, wire.USER, need_future=True)
        if not wait_for_peer:
            self._sessions.no_wait(dst, future)
        return Work(future, f"send to {dst} tag={tag}")

    def blocking_send(self, obj: Any, dst: str, *, tag: int = 0, timeout: float | None = None,
                      wait_for_peer: bool = True) -> None:
        """:meth:`send` from a thread other than the loop's."""
        run_threadsafe(self.send(obj, dst, tag=tag, timeout=timeout, wait_for_peer=wait_for_peer), timeout,
                       self._loop, self._loop_thread, self._check_open, self.address, default=self._timeout)

    # -- receiving ---------------------------------------------------------------------
    async def recv(self, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """Receive the next message from ``src`` with ``tag``.

        Arrays and tensors in it are writable views over the received buffers, owned
        by the caller. When the message came through shared memory they are views of
        the sender's slot, which goes back to the sender once they are all
        garbage-collected (or owned copies, with ``shm_views=False``). Cancelling (or
        timing out) never loses a message. ``timeout``: seconds (None: ``RLINF_TIMEOUT``
        if set, else forever).

        Raises:
            PeerLostError: ``src`` died or left and nothing from it is queued.
            CommTimeoutError, DecodeError, ClosedError.
        """
        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            wire.check_tag(tag)
        if timeout is None:       # check_timeout(timeout, self._timeout), inline: the hot path
            timeout = self._timeout
        else:
            timeout = check_timeout(timeout)
        receive = self._receive
        msg = receive.get_nowait(src, tag)
        if msg is None:
            msg = await receive.park(src, tag, timeout)
        if msg.shm and receive.copies:
            return await receive.finish(msg)
        return receive.decode(msg)     # (inline: no coroutine of its own per message)

    async def recv_any(self, *, tag: int = 0, timeout: float | None = None) -> tuple[Any, str]:
        """Receive the oldest message with ``tag`` from any source: ``(obj, src)``
        (``timeout`` as for :meth:`recv`)."""
        wire.check_tag(tag)
        timeout = check_timeout(timeout, self._timeout)
        msg = await self._receive.get(None, tag, timeout)
        return await self._receive.finish(msg), msg.src

    def async_recv(self, src: str, *, tag: int = 0) -> Work[Any]:
        """Start a receive now and return its :class:`Work` (cancel it safely with
        ``cancel()``). Its place in line is taken by this call: a ``recv`` made later
        gets a later message."""
        wire.check_tag(tag)
        parse_address(src)
        self._check_open()
        return self._receive.start_recv(src, tag, f"recv from {src} tag={tag}")

    def blocking_recv(self, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """:meth:`recv` from a thread other than the loop's."""
        return run_threadsafe(self.recv(src, tag=tag, timeout=timeout), timeout, self._loop, self._loop_thread,
                              self._check_open, self.address, default=self._timeout)

    async def recv_into(self, target: Any, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """Receive a message and write its arrays/tensors into ``target``'s, in place.

        ``target`` must have the same structure, shapes and dtypes as the message.
        ``timeout`` as for :meth:`recv`.

        Returns:
            ``target``.

        Raises:
            ValueError / TypeError: the message does not match ``target``. Nothing is
                written then, and the message stays next in line for ``src`` and ``tag``
                (a ``recv`` or a corrected ``recv_into`` gets it).
            Same as :meth:`recv` otherwise.
        """
        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            wire.check_tag(tag)
        return await self._receive.recv_into(target, src, tag, check_timeout(timeout, self._timeout))

    # -- membership --------------------------------------------------------------------
    async def peers(self) -> list[WorkerInfo]:
        """The workers this communicator knows (its cached roster, without itself)."""
        self._check_open()
        return list(self._roster.values())

    async def events(self) -> AsyncIterator[MembershipEvent]:
        """Membership events from now on, until the communicator closes."""
        self._check_open()
        queue = self._membership.subscribe()
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._membership.unsubscribe(queue)

    def stats(self) -> CommStats:
        """A frozen snapshot of traffic per peer and per transport."""
        return self._counters.snapshot(self._sessions.connected(), self._sessions.credits())

    # -- for rlinf's own subsystems (also through ``internal``) ---------------------------
    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        """Register ``handler(src, obj)`` for SYSTEM messages with ``tag`` (loop thread).

        Raises:
            ValueError: rlinf uses ``tag`` itself (``"shm"``, ``"pull"``, ``"cuda"``, ``"bye"``).
        """
        self._receive.on_system(tag, handler)

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        """Call ``hook(address, incarnation)`` whenever a peer leaves or is lost."""
        self._membership.on_peer_gone(hook)

    def add_closer(self, closer: Callable[[], Any]) -> None:
        """Run ``closer()`` (sync or async) when the communicator closes, newest first."""
        self._lifecycle.closers.append(closer)

    def add_drainer(self, drainer: Callable[[float], Awaitable[None]]) -> None:
        """Await ``drainer(linger)`` when :meth:`aclose` starts, before anything closes:
        it sends what its subsystem accepted and waits until it has arrived, within
        ``linger`` seconds, or raises (and :meth:`aclose` raises that error once closed)."""
        self._lifecycle.drainers.append(drainer)

    def add_stats_provider(self, name: str, provider: Callable[[], dict]) -> None:
        """Report ``provider()`` under ``name`` in the stats sent with heartbeats.

        The manager keeps the latest report per worker and ``rlinf top`` shows it (a
        channel server reports its ``ChannelStats`` as ``"channel"``). ``provider`` runs
        on the loop thread about once a second and must return plain values (dict, list,
        str, int, float, bool, None).

        Raises:
            ValueError: ``name`` is taken (by another provider or a built-in counter).
        """
        self._reports.add(name, provider)
