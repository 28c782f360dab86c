"""The Communicator's core: one worker's endpoint in the cluster, as a facade.

It owns the worker's ZeroMQ context, its data listeners, its session with the manager,
the mailbox for what arrives, and a :class:`~rlinf.core._peer.PeerSessions` registry of
per-peer sessions; it starts them and closes them. The work is done elsewhere in this
package: the send path (:mod:`._send`), the receive path (:mod:`._receive`: frame
reading, the mailbox, decoding), membership (:mod:`._membership`), the link scheme
(:mod:`.routing`), queueing and coalescing (:mod:`._outbox`). Subsystems use
:attr:`CoreCommunicator.internal` (:mod:`.interface`).

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
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Self

import zmq

from ..config import Settings, visible_devices
from ..codec import Codec
from ..control import client as control, devices
from ..control.security import ClusterKeys, ZapHandler
from ..errors import ClosedError, CommTimeoutError, TransportUnavailableError
from ..info import MembershipEvent, WorkerInfo, check_plain, check_timeout, failure_summary, parse_address
from ..transports import leftovers, shm, tcp_bulk
from ..transports.cuda import ipc as cuda_ipc
from ..transports.shm import PullSession
from ..transports.stream import StreamTransport
from ..transports.tcp_stream import TcpStreamTransport
from ..transports.zeromq import ZmqTransport
from ..util.bounded import Recent
from . import routing, wire
from ._access import CoreAccess
from ._busypoll import BusyPoll
from ._credit import Window
from ._gpu_paths import GpuPaths
from ._inbound import FrameReader
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

log = logging.getLogger("rlinf.core.communicator")

_GRACEFUL_LINGER_MS = 2000


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
        self._visible_devices = visible_devices()   # CUDA_VISIBLE_DEVICES, for discover_devices
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
        self._keys = ClusterKeys(token)
        self._codec = codec or Codec()
        self._connect_timeout = connect_timeout
        self._meta = dict(meta or {})
        check_plain(self._meta, "meta")     # the manager refuses a registration with other data
        self._exclusive = bool(exclusive)
        self._manager_host = manager_host if manager_host is None else str(manager_host)
        self._roster: dict[str, WorkerInfo] = {}
        self._busy_poll = BusyPoll(settings.busy_poll_us)
        self._mailbox = Mailbox(self._busy_poll)
        self._dead = Recent()     # (address, incarnation) of peers known gone
        self._closing: asyncio.Future | None = None   # the close in progress (a second aclose waits for it)
        self._closers: list[Callable[[], Any]] = []
        self._drainers: list[Callable[[float], Awaitable[None]]] = []
        self._reports = StatsReports(address, self.stats)      # what heartbeats carry
        self._reports.add("busy_poll", self._busy_poll.report)
        self._counters = Counters(address)
        self._header = wire.HeaderPacker(address, self.incarnation)   # one for every outbox
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._context: zmq.Context | None = None
        self._closed: ClosedError | None = None
        self._failure = ""     # why its ``async with`` body raised: peers see "failed", not "left"
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
        # what start() brings up (None until then, or when it cannot run here)
        self._zap: ZapHandler | None = None
        self._transport: ZmqTransport | None = None
        self._listener = self._bulk_listener = self._stream_listener = self._tcp_stream_listener = None
        self._inbound: FrameReader | None = None
        self._control: control.ControlClient | None = None
        self._shm: shm.ShmSession | None = None
        self._pull: PullSession | None = None      # single-copy pulls by copy-out receivers
        self._bulk: tcp_bulk.BulkTransport | None = None   # large payloads from/to other nodes
        self._stream: StreamTransport | None = None        # frame sets from/to this node's processes
        self._tcp_stream: TcpStreamTransport | None = None  # and from/to other nodes' processes
        self._recycler = shm.Recycler(settings.shm_cap)   # receive-side private memory (chunk reassembly, copy-outs)
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
            self._failure = failure_summary(exc)
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
        leftovers.remove_orphans()     # of a job that died here with no one left to clean up
        self._context = zmq.Context()
        try:
            self._zap = ZapHandler(self._context, self._keys)
            self._zap.attach(self._loop)
            settings = self._settings
            bind, advertise = devices.data_host(self.manager_address, settings.host)
            self._transport = ZmqTransport(self._context, self._keys, tcp_host=bind, advertise_host=advertise,
                                           encrypt_tcp=settings.tcp_encryption)
            self._listener = await self._transport.listen()
            endpoints = dict(self._listener.endpoints)
            transports = (routing.INLINE,)
            if routing.BULK not in self._routing.disabled and "tcp" in endpoints:
                transports += await self._start_bulk(bind, advertise, endpoints)
            if routing.SHM not in self._routing.disabled and shm.available():
                self._shm = shm.ShmSession(self._loop, self._send.notice, views=self._shm_views,
                                           recycler=self._recycler, guard_relays=self._guard_relays,
                                           cap=settings.shm_cap, offload=settings.shm_offload,
                                           fd_share=settings.shm_fd, fd_cache=settings.shm_fd_cache,
                                           copy_threads=settings.copy_threads)
                self._receive.handle("shm", self._shm.on_notice)
                transports += (routing.SHM,)
                self._pull = PullSession(self._loop, self.incarnation,
                                         functools.partial(self._send.notice, tag="pull"), self._recycler,
                                         self._shm.copier, offload=self._shm.offload, threshold=settings.shm_pull,
                                         pid_of=self._membership.pid_of)
                self._receive.handle("pull", self._pull.on_notice)
                self._reports.add("pull", self._pull.report)
            self._inbound = FrameReader(self._shm, self._recycler, self._membership.pid_of, self._counters.dropped,
                                        self._gpu.open, self._gpu.refuse, self._pull)
            # the receiving parts are ready before any handler can hand them a frame set
            self._receive.start(self._loop, self._shm, self._pull, self._inbound)
            self._membership.start(self._loop, self._receive.resume)
            self._listener.set_handler(self._receive.on_frames)
            if routing.STREAM not in self._routing.disabled and StreamTransport.available():
                transports += await self._start_stream(endpoints)
            if settings.tcp_stream and routing.TCP_STREAM not in self._routing.disabled and "tcp" in endpoints:
                transports += await self._start_stream(endpoints, (bind, advertise))
            gpus = devices.discover_devices(no_torch=settings.no_torch, visible=self._visible_devices)
            if gpus and routing.CUDA_IPC not in self._routing.disabled and cuda_ipc.available():
                transports += (routing.CUDA_IPC,)
                self._receive.handle("cuda", self._gpu.on_notice)
            self.info = WorkerInfo(
                address=self.address, incarnation=self.incarnation, node_id=devices.node_id(settings.node_id),
                host=socket.gethostname(), pid=os.getpid(), endpoints=endpoints,
                devices=gpus, transports=transports,
                meta={"machine": control.machine_id(), "window": list(self._sessions.window), **self._meta},
            )
            self._gpu.me = self.info
            self._control = control.ControlClient(self._context, self._keys, self.manager_address, self.info,
                                                  self._membership.on_event, stats=self._reports.collect,
                                                  exclusive=self._exclusive, on_superseded=self._superseded,
                                                  manager_host=self._manager_host,
                                                  peer_timeout=settings.peer_timeout,
                                                  heartbeat_interval=settings.heartbeat_interval)
            self._start_parts()
            if self._trace is not None:
                self._trace.start(self._loop)
            await self._control.register(timeout=self._connect_timeout)
        except BaseException:
            await self._teardown(deregister=False)
            raise
        self._started = True
        return self

    async def _start_bulk(self, bind: str, advertise: str, endpoints: dict[str, str]) -> tuple[str, ...]:
        """Listen for bulk TCP links (large payloads from other nodes); the transports
        this adds to what we advertise (none when it cannot run here)."""
        try:
            self._bulk = tcp_bulk.BulkTransport(self._keys.bulk_key, host=bind, advertise_host=advertise,
                                                recycler=self._recycler, encrypt=self._settings.tcp_encryption)
            self._bulk_listener = await self._bulk.listen()
        except (TransportUnavailableError, OSError) as exc:
            log.warning("rlinf %s: no bulk TCP transport (%s); large payloads to other nodes go "
                        "through ZeroMQ", self.address, exc)
            self._bulk = None
            return ()
        self._bulk_listener.set_handler(self._receive.on_frames)
        endpoints.update(self._bulk_listener.endpoints)
        return (routing.BULK,)

    async def _start_stream(self, endpoints: dict[str, str], tcp: tuple[str, str] | None = None) -> tuple[str, ...]:
        """Listen for stream links: from this node's processes (a Unix socket), or with
        ``tcp`` (bind and advertised hosts) from other nodes' (TCP, sealed when TCP
        encryption is on); the transports this adds to what we advertise (none when it
        cannot run here: ZeroMQ carries those messages)."""
        try:
            if tcp is None:
                transport = StreamTransport(self._keys.bulk_key, recycler=self._recycler)
            else:
                transport = TcpStreamTransport(self._keys.bulk_key, host=tcp[0], advertise_host=tcp[1],
                                               recycler=self._recycler, encrypt=self._settings.tcp_encryption)
            listener = await transport.listen()
        except TransportUnavailableError as exc:
            log.warning("rlinf %s: no %s transport (%s); those messages go through ZeroMQ",
                        self.address, "stream" if tcp is None else "TCP stream", exc)
            return ()
        listener.set_handler(self._receive.on_frames)
        endpoints.update(listener.endpoints)
        if tcp is None:
            self._stream, self._stream_listener = transport, listener
            return (routing.STREAM,)
        self._tcp_stream, self._tcp_stream_listener = transport, listener
        return (routing.TCP_STREAM,)

    def _start_parts(self) -> None:
        """Hand the sending parts what start() brought up (before the manager can send
        them an event; the receiving parts started before the listeners had handlers)."""
        self._sessions.start(self._loop, self.info, zmq=self._transport, stream=self._stream, bulk=self._bulk,
                             control_client=self._control, shm=self._shm, pull=self._pull,
                             tcp_stream=self._tcp_stream)
        self._send.start(self._loop, self._shm, self._pull)

    def _new_cuda_session(self) -> cuda_ipc.CudaIpcSession:
        return cuda_ipc.CudaIpcSession(self._loop, functools.partial(self._send.notice, tag="cuda"),
                                       self.incarnation, views=self._shm_views, cap=self._settings.cuda_ipc_cap)

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
        if self._closed is not None or self._closing is not None:
            if self._closing is not None:
                await asyncio.shield(self._closing)
            return
        self._closing = closing = asyncio.get_running_loop().create_future()   # what a second aclose awaits
        cancelled = None
        try:
            undelivered = await self._drain()
        except asyncio.CancelledError as exc:   # finish closing, then re-raise
            cancelled, undelivered = exc, None
        try:
            if self._closed is None:
                self._closed = ClosedError(f"communicator {self.address} is closed")
                await self._teardown(deregister=True)
            elif self._closing is not closing:      # superseded while draining: its teardown runs
                await asyncio.shield(self._closing)
        finally:
            closing.set_result(None)
        if cancelled is not None:
            raise cancelled
        if undelivered is not None:
            raise undelivered

    async def _drain(self) -> BaseException | None:
        """Await the drainers (still open: they may send), bounded by the linger.
        Returns the first error (the others are logged)."""
        if not self._drainers or not self._started:
            return None
        linger = _GRACEFUL_LINGER_MS / 1000
        tasks = [asyncio.ensure_future(drainer(linger)) for drainer in self._drainers]
        try:
            _done, late = await asyncio.wait(tasks, timeout=linger + 0.5)
        finally:
            for task in tasks:
                task.cancel()
        errors = [CommTimeoutError(f"communicator {self.address}: closing, what a subsystem held was not "
                                   f"delivered within {linger} s and may not have arrived") for _ in late]
        errors += [t.exception() for t in tasks if t not in late and not t.cancelled() and t.exception()]
        for error in errors[1:]:
            log.warning("rlinf %s: closing: %s", self.address, error)
        return errors[0] if errors else None

    def _superseded(self, why: str) -> None:
        """The manager took us for lost and another incarnation holds our address now
        (a restart): close, failing every operation with a ``ClosedError`` that says so."""
        if self._closed is None:
            self._closed = ClosedError(f"communicator {self.address} was replaced by another "
                                       f"incarnation while the manager took it for lost ({why})")
            self._closing = self._loop.create_task(self._teardown(deregister=False))

    async def _teardown(self, *, deregister: bool) -> None:
        error = self._closed or ClosedError(f"communicator {self.address} failed to start")
        if self._trace is not None:
            self._trace.flush()     # while the links are open: the trace names the ones messages took
        cancelled = undelivered = None
        deadline = time.monotonic() + _GRACEFUL_LINGER_MS / 1000     # one linger for every drain below

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if deregister and self._started:
            try:   # what we sent is acknowledged by its receivers (or the linger ends)
                undelivered = await self._sessions.drain(left())
            except asyncio.CancelledError as exc:
                cancelled = exc
        if self._shm is not None and deregister:
            try:   # readers of our last slots must map them before we unlink the files
                await self._shm.drain(left())
            except asyncio.CancelledError as exc:   # finish closing, then re-raise
                cancelled = exc
            self._shm.close()      # releases owed to peers go out ahead of the bye
        if self._gpu.session is not None:
            self._gpu.session.flush()
        if self._pull is not None:
            if deregister:
                try:   # receivers still reading what we hold for them: let them finish
                    await self._pull.drain(left())
                except asyncio.CancelledError as exc:
                    cancelled = exc
            self._pull.close(error)
        self._closed = error
        bye_to = self._send.say_bye() if deregister else []
        for closer in reversed(self._closers):
            try:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError as exc:   # the other closers still run
                cancelled = exc
            except Exception:
                log.exception("rlinf %s: error while closing a subsystem", self.address)
        try:
            if self._control is not None:
                await self._control.close(deregister=deregister, bye_to=bye_to, failure=self._failure)
        except asyncio.CancelledError as exc:   # finish closing, then re-raise
            cancelled = exc
        finally:
            flushing = self._sessions.close_all(_GRACEFUL_LINGER_MS, error)
            # what waits on us fails now, whatever happens to the flush below
            self._mailbox.close(error)
            self._membership.close()
            if flushing:    # stream links write what they buffered from this loop
                try:
                    await asyncio.wait(flushing, timeout=_GRACEFUL_LINGER_MS / 1000 + 0.5)
                except asyncio.CancelledError as exc:
                    cancelled = exc
            for part in (self._transport, self._listener, self._bulk_listener, self._stream_listener,
                         self._tcp_stream_listener, self._zap,
                         self._shm, self._gpu.session):
                if part is not None:
                    part.close()
            if self._context is not None:
                context, self._context = self._context, None
                # term() waits for lingering frames; keep the loop free meanwhile (a cancel
                # leaves it to finish in its thread: the sockets are closed already)
                term = asyncio.get_running_loop().run_in_executor(None, context.term)
                try:
                    await asyncio.shield(term)
                except asyncio.CancelledError as exc:
                    cancelled = exc
            self._sessions.cancel_tasks()
            if self._trace is not None:
                try:
                    await self._trace.aclose()
                except asyncio.CancelledError as exc:
                    cancelled = exc
        if cancelled is not None:
            raise cancelled
        if undelivered:
            raise CommTimeoutError(f"communicator {self.address} closed, but {', '.join(undelivered)} did not "
                                   f"acknowledge all it was sent within {_GRACEFUL_LINGER_MS / 1000:g} s: some of "
                                   "those messages may not have been delivered")

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
        return self._control.clock.offset if self._control is not None else None

    async def _lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        return await self._control.lookup(address, wait=wait, timeout=timeout)

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
        self._closers.append(closer)

    def add_drainer(self, drainer: Callable[[float], Awaitable[None]]) -> None:
        """Await ``drainer(linger)`` when :meth:`aclose` starts, before anything closes:
        it sends what its subsystem accepted and waits until it has arrived, within
        ``linger`` seconds, or raises (and :meth:`aclose` raises that error once closed)."""
        self._drainers.append(drainer)

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
