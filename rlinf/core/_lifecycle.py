"""A communicator's start and close: what it brings up, in which order, and how it goes.

:class:`Lifecycle` owns everything :meth:`CoreCommunicator.start
<rlinf.core.communicator.CoreCommunicator.start>` brings up, and tears it down once.
The parts the communicator builds in its constructor (:class:`Parts`: the per-peer
sessions, the send and receive paths, membership, the mailbox, the GPU paths) are
handed to it; it wires them to what it starts and closes what it started.

Start, in this order (each piece exists before anything can call it):

1. the ZeroMQ context and its authentication handler (ZAP), the ZeroMQ transport and
   its listener (the endpoints we advertise);
2. the bulk TCP listener (large payloads from other nodes), when it can run here;
3. shared memory and pulls (:class:`~rlinf.transports.shm.ShmSession`,
   :class:`~rlinf.transports.shm.PullSession`), and the handlers of their notices;
4. the frame reader; the receive path and membership start, and only then does the
   ZeroMQ listener get its handler;
5. the stream listeners (a Unix socket for this node; TCP for others, when on);
6. CUDA IPC's notice handler, when a GPU is visible (its session is made on first use,
   by :class:`~rlinf.core._gpu_paths.GpuPaths`);
7. our :class:`~rlinf.info.WorkerInfo`, the manager session (control client), the
   per-peer sessions and the send path, the trace; then we register.

A start that fails tears down what it brought up (nothing is left behind) and leaves
the communicator closed.

Close (:meth:`Lifecycle.aclose`), in this order, within one linger for every drain:
the subsystems' drainers (their accepted work is delivered while we are still open);
the sessions' acknowledgements; readers of our shared-memory slots and pulls finish;
we are closed (every operation raises ``ClosedError``); goodbyes are sent, the
subsystems' closers run (newest first), we deregister; the sessions close (what was
flushed lingers), the mailbox and membership fail what waits; the listeners,
transports and sessions close; the ZeroMQ context terminates (in a thread); the
sessions' tasks are cancelled; the trace is written. A cancellation during close
finishes closing first, then propagates.

Every task is owned: the per-peer sessions own theirs (:meth:`PeerSessions.tasks
<rlinf.core._peer.PeerSessions.tasks>`), the drainers' tasks are cancelled here, and a
teardown started by the manager (:meth:`superseded`) is the close in progress that a
later :meth:`aclose` awaits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import zmq

from ..config import Settings
from ..control import client as control, devices
from ..control.security import ClusterKeys, ZapHandler
from ..errors import ClosedError, CommTimeoutError, TransportUnavailableError
from ..info import WorkerInfo
from ..transports import leftovers, shm, tcp_bulk
from ..transports.cuda import ipc as cuda_ipc
from ..transports.shm import PullSession
from ..transports.stream import StreamTransport
from ..transports.tcp_stream import TcpStreamTransport
from ..transports.zeromq import ZmqTransport
from . import routing
from ._gpu_paths import GpuPaths
from ._inbound import FrameReader
from ._mailbox import Mailbox
from ._membership import Membership
from ._peer import PeerSessions
from ._receive import ReceivePath
from ._send import SendPath
from ._trace import Recorder
from .stats import Counters, StatsReports

__all__ = ["Lifecycle", "Parts", "LINGER_MS"]

log = logging.getLogger("rlinf.core.communicator")

#: Milliseconds what was handed over may take to be delivered when we close (one linger
#: for all the drains of a close).
LINGER_MS = 2000


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What a communicator built in its constructor and start() wires together.

    address, incarnation: ours. keys: the cluster's. settings: ours. config: our
    routing config. manager_address, manager_host, exclusive, meta, connect_timeout,
    visible_devices: how we register (see :class:`rlinf.Communicator`). shm_views,
    guard_relays: what the shared-memory session is made with. The others are our
    parts (see :class:`~rlinf.core.communicator.CoreCommunicator`).
    """

    address: str
    incarnation: str
    keys: ClusterKeys
    settings: Settings
    config: routing.RoutingConfig
    manager_address: str
    manager_host: str | None
    exclusive: bool
    meta: dict
    connect_timeout: float
    visible_devices: Any
    shm_views: bool
    guard_relays: bool
    recycler: shm.Recycler
    sessions: PeerSessions
    send: SendPath
    receive: ReceivePath
    membership: Membership
    mailbox: Mailbox
    gpu: GpuPaths
    reports: StatsReports
    counters: Counters
    trace: Recorder | None


class Lifecycle:
    """One communicator's start and close (its loop thread only).

    Args:
        parts: what the communicator built (see :class:`Parts`).
        on_closed: ``on_closed(error)``: we are closed from now on, every operation
            raises ``error`` (the communicator keeps it for its hot path's check).

    Attributes:
        started: start() succeeded. closed: the ``ClosedError`` operations raise, once
            closed (or failed to start). failure: why the communicator's ``async with``
            body raised ("" if it did not): peers see it "failed", not "left".
        closers, drainers: what subsystems registered (see ``add_closer``,
            ``add_drainer``).
        context, zap, transport and listener (ZeroMQ), bulk, stream, tcp_stream and
            their listeners, shm, pull, control: what start() brought up (None before,
            or where it cannot run here).
    """

    def __init__(self, parts: Parts, on_closed: Callable[[ClosedError], None]) -> None:
        self._p = parts
        self._on_closed = on_closed
        self.started = False
        self.closed: ClosedError | None = None
        self.failure = ""
        self.closers: list[Callable[[], Any]] = []
        self.drainers: list[Callable[[float], Awaitable[None]]] = []
        self._closing: asyncio.Future | None = None   # the close in progress (a second aclose waits for it)
        self._loop: asyncio.AbstractEventLoop | None = None
        # what start() brings up (None until then, or when it cannot run here)
        self.context: zmq.Context | None = None
        self.control: control.ControlClient | None = None
        self.shm: shm.ShmSession | None = None
        self.pull: PullSession | None = None       # single-copy pulls by copy-out receivers
        self.zap: ZapHandler | None = None
        self.transport: ZmqTransport | None = None
        self.listener = self.bulk_listener = self.stream_listener = self.tcp_stream_listener = None
        self.bulk: tcp_bulk.BulkTransport | None = None   # large payloads from/to other nodes
        self.stream: StreamTransport | None = None        # frame sets from/to this node's processes
        self.tcp_stream: TcpStreamTransport | None = None  # and from/to other nodes' processes

    def _close_as(self, error: ClosedError) -> None:
        self.closed = error
        self._on_closed(error)

    # -- start ----------------------------------------------------------------------------
    async def start(self) -> WorkerInfo:
        """Bring everything up (see the module docstring for the order) and register:
        our info. On failure, what was brought up is torn down and we are closed."""
        p = self._p
        if self.closed is not None or self._closing is not None:
            raise self.closed or ClosedError("communicator is closing")    # (a start once failed, or closed)
        self._loop = loop = asyncio.get_running_loop()
        leftovers.remove_orphans()     # of a job that died here with no one left to clean up
        self.context = zmq.Context()
        try:
            self.zap = ZapHandler(self.context, p.keys)
            self.zap.attach(loop)
            settings = p.settings
            bind, advertise = devices.data_host(p.manager_address, settings.host)
            self.transport = ZmqTransport(self.context, p.keys, tcp_host=bind, advertise_host=advertise,
                                           encrypt_tcp=settings.tcp_encryption)
            self.listener = await self.transport.listen()
            endpoints = dict(self.listener.endpoints)
            transports = (routing.INLINE,)
            if routing.BULK not in p.config.disabled and "tcp" in endpoints:
                transports += await self._start_bulk(bind, advertise, endpoints)
            if routing.SHM not in p.config.disabled and shm.available():
                transports += self._start_shm()
            inbound = FrameReader(self.shm, p.recycler, p.membership.pid_of, p.counters.dropped,
                                  p.gpu.open, p.gpu.refuse, self.pull)
            # the receiving parts are ready before any handler can hand them a frame set
            p.receive.start(loop, self.shm, self.pull, inbound)
            p.membership.start(loop, p.receive.resume)
            self.listener.set_handler(p.receive.on_frames)
            if routing.STREAM not in p.config.disabled and StreamTransport.available():
                transports += await self._start_stream(endpoints)
            if settings.tcp_stream and routing.TCP_STREAM not in p.config.disabled and "tcp" in endpoints:
                transports += await self._start_stream(endpoints, (bind, advertise))
            gpus = devices.discover_devices(no_torch=settings.no_torch, visible=p.visible_devices)
            if gpus and routing.CUDA_IPC not in p.config.disabled and cuda_ipc.available():
                transports += (routing.CUDA_IPC,)
                p.receive.handle("cuda", p.gpu.on_notice)
            info = WorkerInfo(
                address=p.address, incarnation=p.incarnation, node_id=devices.node_id(settings.node_id),
                host=socket.gethostname(), pid=os.getpid(), endpoints=endpoints,
                devices=gpus, transports=transports,
                meta={"machine": control.machine_id(), "window": list(p.sessions.window), **p.meta},
            )
            p.gpu.me = info
            self.control = control.ControlClient(self.context, p.keys, p.manager_address, info,
                                                 p.membership.on_event, stats=p.reports.collect,
                                                 exclusive=p.exclusive, on_superseded=self.superseded,
                                                 manager_host=p.manager_host,
                                                 peer_timeout=settings.peer_timeout,
                                                 heartbeat_interval=settings.heartbeat_interval)
            # the sending parts, before the manager can send them an event
            p.sessions.start(loop, info, zmq=self.transport, stream=self.stream, bulk=self.bulk,
                             control_client=self.control, shm=self.shm, pull=self.pull,
                             tcp_stream=self.tcp_stream)
            p.send.start(loop, self.shm, self.pull)
            if p.trace is not None:
                p.trace.start(loop)
            await self.control.register(timeout=p.connect_timeout)
        except BaseException:
            if self._closing is not None:      # an aclose() meanwhile: it tears down, once
                await asyncio.shield(self._closing)
            elif self.closed is None:
                await self._teardown(deregister=False)
            raise
        self.started = True
        return info

    async def _start_bulk(self, bind: str, advertise: str, endpoints: dict[str, str]) -> tuple[str, ...]:
        """Listen for bulk TCP links (large payloads from other nodes); the transports
        this adds to what we advertise (none when it cannot run here)."""
        p = self._p
        try:
            self.bulk = tcp_bulk.BulkTransport(p.keys.bulk_key, host=bind, advertise_host=advertise,
                                                recycler=p.recycler, encrypt=p.settings.tcp_encryption)
            self.bulk_listener = await self.bulk.listen()
        except (TransportUnavailableError, OSError) as exc:
            log.warning("rlinf %s: no bulk TCP transport (%s); large payloads to other nodes go "
                        "through ZeroMQ", p.address, exc)
            self.bulk = None
            return ()
        self.bulk_listener.set_handler(p.receive.on_frames)
        endpoints.update(self.bulk_listener.endpoints)
        return (routing.BULK,)

    def _start_shm(self) -> tuple[str, ...]:
        """The shared-memory and pull sessions, and the handlers of their notices."""
        p, settings = self._p, self._p.settings
        self.shm = shm.ShmSession(self._loop, p.send.notice, views=p.shm_views, recycler=p.recycler,
                                  guard_relays=p.guard_relays, cap=settings.shm_cap,
                                  offload=settings.shm_offload, fd_share=settings.shm_fd,
                                  fd_cache=settings.shm_fd_cache, copy_threads=settings.copy_threads)
        p.receive.handle("shm", self.shm.on_notice)
        self.pull = PullSession(self._loop, p.incarnation, functools.partial(p.send.notice, tag="pull"),
                                p.recycler, self.shm.copier, offload=self.shm.offload,
                                threshold=settings.shm_pull, pid_of=p.membership.pid_of)
        p.receive.handle("pull", self.pull.on_notice)
        p.reports.add("pull", self.pull.report)
        return (routing.SHM,)

    async def _start_stream(self, endpoints: dict[str, str], tcp: tuple[str, str] | None = None) -> tuple[str, ...]:
        """Listen for stream links: from this node's processes (a Unix socket), or with
        ``tcp`` (bind and advertised hosts) from other nodes' (TCP, sealed when TCP
        encryption is on); the transports this adds to what we advertise (none when it
        cannot run here: ZeroMQ carries those messages)."""
        p = self._p
        try:
            if tcp is None:
                transport = StreamTransport(p.keys.bulk_key, recycler=p.recycler)
            else:
                transport = TcpStreamTransport(p.keys.bulk_key, host=tcp[0], advertise_host=tcp[1],
                                               recycler=p.recycler, encrypt=p.settings.tcp_encryption)
            listener = await transport.listen()
        except TransportUnavailableError as exc:
            log.warning("rlinf %s: no %s transport (%s); those messages go through ZeroMQ",
                        p.address, "stream" if tcp is None else "TCP stream", exc)
            return ()
        listener.set_handler(p.receive.on_frames)
        endpoints.update(listener.endpoints)
        if tcp is None:
            self.stream, self.stream_listener = transport, listener
            return (routing.STREAM,)
        self.tcp_stream, self.tcp_stream_listener = transport, listener
        return (routing.TCP_STREAM,)

    # -- close ----------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close once (see :meth:`CoreCommunicator.aclose
        <rlinf.core.communicator.CoreCommunicator.aclose>`, which this is); a second call
        waits for the first."""
        if self.closed is not None or self._closing is not None:
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
            if self.closed is None:
                self._close_as(ClosedError(f"communicator {self._p.address} is closed"))
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
        if not self.drainers or not self.started:
            return None
        linger = LINGER_MS / 1000
        tasks = [asyncio.ensure_future(drainer(linger)) for drainer in self.drainers]
        try:
            _done, late = await asyncio.wait(tasks, timeout=linger + 0.5)
        finally:
            for task in tasks:
                task.cancel()
        address = self._p.address
        errors = [CommTimeoutError(f"communicator {address}: closing, what a subsystem held was not "
                                   f"delivered within {linger} s and may not have arrived") for _ in late]
        errors += [t.exception() for t in tasks if t not in late and not t.cancelled() and t.exception()]
        for error in errors[1:]:
            log.warning("rlinf %s: closing: %s", address, error)
        return errors[0] if errors else None

    def superseded(self, why: str) -> None:
        """The manager took us for lost and another incarnation holds our address now
        (a restart): close, failing every operation with a ``ClosedError`` that says so."""
        if self.closed is None:
            self._close_as(ClosedError(f"communicator {self._p.address} was replaced by another "
                                       f"incarnation while the manager took it for lost ({why})"))
            self._closing = self._loop.create_task(self._teardown(deregister=False))

    async def _teardown(self, *, deregister: bool) -> None:
        """Close everything start() brought up, in order (see the module docstring);
        ``deregister``: we started and leave (drain, say goodbye, deregister), else we
        failed to start or were superseded."""
        p = self._p
        if self.closed is None:
            self._close_as(ClosedError(f"communicator {p.address} failed to start"))
        if p.trace is not None:
            p.trace.flush()     # while the links are open: the trace names the ones messages took
        cancelled, undelivered = await self._drain_sent(deregister)
        bye_to = p.send.say_bye() if deregister else []
        for closer in reversed(self.closers):
            try:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError as exc:   # the other closers still run
                cancelled = exc
            except Exception:
                log.exception("rlinf %s: error while closing a subsystem", p.address)
        try:
            if self.control is not None:
                await self.control.close(deregister=deregister, bye_to=bye_to, failure=self.failure)
        except asyncio.CancelledError as exc:   # finish closing, then re-raise
            cancelled = exc
        finally:
            cancelled = await self._release() or cancelled
        if cancelled is not None:
            raise cancelled
        if undelivered:
            raise CommTimeoutError(f"communicator {p.address} closed, but {', '.join(undelivered)} did not "
                                   f"acknowledge all it was sent within {LINGER_MS / 1000:g} s: some of "
                                   "those messages may not have been delivered")

    async def _drain_sent(self, deregister: bool) -> tuple[BaseException | None, list[str]]:
        """What we sent reaches its receivers, within one linger: acknowledgements, slots
        mapped, pulls read (when we leave); then the shared-memory and pull sessions
        close (releases owed to peers go out ahead of the bye). Returns a cancellation
        met on the way (closing goes on) and the peers that did not acknowledge all."""
        p = self._p
        cancelled, undelivered = None, []
        deadline = time.monotonic() + LINGER_MS / 1000

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if deregister and self.started:
            try:   # what we sent is acknowledged by its receivers (or the linger ends)
                undelivered = await p.sessions.drain(left())
            except asyncio.CancelledError as exc:
                cancelled = exc
        if self.shm is not None and deregister:
            try:   # readers of our last slots must map them before we unlink the files
                await self.shm.drain(left())
            except asyncio.CancelledError as exc:   # finish closing, then re-raise
                cancelled = exc
            self.shm.close()
        if p.gpu.session is not None:
            p.gpu.session.flush()
        if self.pull is not None:
            if deregister:
                try:   # receivers still reading what we hold for them: let them finish
                    await self.pull.drain(left())
                except asyncio.CancelledError as exc:
                    cancelled = exc
            self.pull.close(self.closed)
        return cancelled, undelivered

    async def _release(self) -> BaseException | None:
        """Close the sessions, fail what waits, close what start() brought up, terminate
        the ZeroMQ context, cancel the sessions' tasks and write the trace (whatever
        happened before). Returns a cancellation met on the way."""
        p = self._p
        cancelled = None
        flushing = p.sessions.close_all(LINGER_MS, self.closed)
        # what waits on us fails now, whatever happens to the flush below
        p.mailbox.close(self.closed)
        p.membership.close()
        if flushing:    # stream links write what they buffered from this loop
            try:
                await asyncio.wait(flushing, timeout=LINGER_MS / 1000 + 0.5)
            except asyncio.CancelledError as exc:
                cancelled = exc
        for part in (self.transport, self.listener, self.bulk_listener, self.stream_listener,
                     self.tcp_stream_listener, self.zap, self.shm, p.gpu.session):
            if part is not None:
                part.close()
        if self.context is not None:
            context, self.context = self.context, None
            # term() waits for lingering frames; keep the loop free meanwhile (a cancel
            # leaves it to finish in its thread: the sockets are closed already)
            term = asyncio.get_running_loop().run_in_executor(None, context.term)
            try:
                await asyncio.shield(term)
            except asyncio.CancelledError as exc:
                cancelled = exc
        p.sessions.cancel_tasks()
        if p.trace is not None:
            try:
                await p.trace.aclose()
            except asyncio.CancelledError as exc:
                cancelled = exc
        return cancelled
