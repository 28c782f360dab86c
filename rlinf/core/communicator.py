"""The Communicator: one worker's endpoint in the cluster.

It owns the worker's ZeroMQ context, its data listener, its session with the manager,
one :class:`~rlinf.core._outbox.Outbox` per destination and a :class:`~rlinf.core._mailbox.Mailbox`
for what arrives. It delegates: encoding to the codec, the link scheme to
:mod:`rlinf.routing`, queueing and coalescing to the outbox, matching to the mailbox.

Connections are lazy: nothing is dialled until the first message to a peer. A peer not
yet registered is looked up (the lookup waits for it to join), so a worker that joins
late is reachable at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import secrets
import socket
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Self

import zmq

from ..control import client as control, devices
from ..transports import leftovers
from . import routing, wire
from ._arrival import ArrivalOrder
from ..util.bounded import Recent
from ._busypoll import BusyPoll
from ..codec import Codec, is_device_buffer
from ..errors import (AuthenticationError, ClosedError, CommTimeoutError, DecodeError, PeerLostError, ProtocolError,
                      RlinfError, TransportUnavailableError)
from ._gpu_paths import GpuPaths
from ._inbound import FrameReader
from ..info import MembershipEvent, WorkerInfo, check_plain, check_timeout, parse_address
from ._mailbox import Mailbox, Message
from ._outbox import SMALL_MESSAGE, OutMessage, Outbox, bulk_frames, split_frames
from ..control.security import ClusterKeys, ZapHandler, tcp_encryption_enabled
from .stats import CommStats, Counters
from ..transports.cuda import ipc as cuda_ipc
from ..transports import shm, tcp_bulk
from ..transports.shm import PullSession, pull_threshold
from ..transports.base import Received
from ..transports.stream import StreamTransport
from ..transports.zeromq import ZmqTransport
from .work import Work
from ._access import CoreAccess
from .interface import Core

__all__ = ["CoreCommunicator"]

log = logging.getLogger("rlinf.core.communicator")

_GRACEFUL_LINGER_MS = 2000
#: Shared-memory notices owed before a receive that does not yield sends them itself.
_OWED_BURST = 16
#: How long a "left" peer that sent us data may take to deliver its in-order "bye".
_BYE_GRACE = 2.0
#: When that grace ends after a stall, the bye (and the data before it) may still wait
#: unread in the socket: uvloop runs due timers before it polls I/O. The peer is declared
#: gone only this much later, after one more poll.
_AFTER_ONE_POLL = 0.01
#: Incarnations of peers known gone (their late frames are dropped) that are remembered,
#: the oldest forgotten first: a peer restarted under one name adds one each time.
DEAD_KEPT = 4096
#: Seconds a blocking_* call waits beyond its timeout for a busy loop to run it.
_LOOP_GRACE = 1.0


_TAG_MIN, _TAG_MAX = wire.INT_MIN, wire.INT_MAX   # user tags travel as msgpack integers


def _check_tag(tag: Any) -> None:
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not _TAG_MIN <= tag <= _TAG_MAX:
        raise ValueError(f"tag must lie in [-2**63, 2**64 - 1], got {tag}")


def _tcp_host(manager: str) -> tuple[str, str]:
    """(bind host, advertised host) for the data TCP listener."""
    host = os.environ.get("RLINF_HOST")
    if host:
        return host, host
    manager_host = manager.split("://", 1)[-1].rsplit(":", 1)[0]
    if manager.startswith("ipc://") or manager_host.startswith("127.") or manager_host in ("localhost", "[::1]"):
        return "127.0.0.1", "127.0.0.1"
    local = devices.preferred_address([manager_host], devices.host_addresses()) or socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", local


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
                 forwards_unchanged: bool = False) -> None:
        address = address or os.environ.get("RLINF_ADDRESS")
        if not address:
            raise ValueError("no worker address: pass address='group:rank' or set RLINF_ADDRESS")
        parse_address(address)
        self.manager_address = manager or os.environ.get("RLINF_MANAGER") or ""
        if not self.manager_address:
            raise ValueError("no manager: pass manager='tcp://host:port' or set RLINF_MANAGER")
        token = token or os.environ.get("RLINF_TOKEN")
        if not token:
            raise ValueError("no cluster token: pass token=... or set RLINF_TOKEN")
        self.address = address
        self.incarnation = secrets.token_hex(8)
        self.info: WorkerInfo | None = None
        self._keys = ClusterKeys(token)
        self._token = token            # subsystems that start processes (channels) pass it on
        self._codec = codec or Codec()
        self._connect_timeout = connect_timeout
        self._meta = dict(meta or {})
        check_plain(self._meta, "meta")     # the manager refuses a registration with other data
        self._exclusive = bool(exclusive)
        self._manager_host = manager_host if manager_host is None else str(manager_host)
        self._roster: dict[str, WorkerInfo] = {}
        self._outboxes: dict[str, Outbox] = {}
        self._busy_poll = BusyPoll.from_env()
        self._mailbox = Mailbox(self._busy_poll)
        self._dead = Recent()     # (address, incarnation) of peers known gone
        self._failed = Recent()   # addresses whose outbox failed (kept: sends to them fail at once)
        self._closing: asyncio.Future | None = None   # the close in progress (a second aclose waits for it)
        self._valid: set[str] = set()      # addresses already checked (hot-path memo)
        self._system_handlers: dict[str, Callable[[str, Any], None]] = {}
        self._gone_hooks: list[Callable[[str, str], None]] = []
        self._closers: list[Callable[[], Any]] = []
        self._stats_providers: dict[str, Callable[[], dict]] = {"busy_poll": self._busy_poll.report}
        self._subscribers: list[asyncio.Queue] = []
        self._counters = Counters(address)
        self._identity = f"{address}|{self.incarnation}".encode()
        self._header = wire.HeaderPacker(address, self.incarnation)   # one for every outbox
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context | None = None
        self._closed: ClosedError | None = None
        self._started = False
        self._routing = routing.RoutingConfig.from_env()
        if disable:
            self._routing = self._routing.without(disable)
        if shm_views is None:
            shm_views = os.environ.get("RLINF_SHM_VIEWS", "1").strip().lower() not in ("0", "false", "no")
        elif not isinstance(shm_views, bool):
            raise TypeError(f"shm_views must be a bool, got {shm_views!r}")
        self._shm_views = shm_views
        self._guard_relays = not forwards_unchanged
        self._shm: shm.ShmSession | None = None
        self._pull: PullSession | None = None      # single-copy pulls by copy-out receivers
        self._bulk: tcp_bulk.BulkTransport | None = None   # large payloads from/to other nodes
        self._stream: StreamTransport | None = None        # frame sets from/to this node's processes
        self._recycler = shm.Recycler()   # receive-side private memory (chunk reassembly, copy-outs)
        self._shm_routes: dict[str, bool] = {}     # peer -> large CPU payloads go by shm
        self._gpu = GpuPaths(address, self._roster, self._routing, self._new_cuda_session)
        self._internal = CoreAccess(self, token, self._codec)

    def __repr__(self) -> str:
        pending = sum(len(o.queue) for o in self._outboxes.values())
        state = "closed" if self._closed else ("open" if self._started else "new")
        return (f"<Communicator {self.address} {state} peers={len(self._roster)} "
                f"connections={sum(1 for o in self._outboxes.values() if o.link)} "
                f"pending_sends={pending} queued_recvs={len(self._mailbox)}>")

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

    async def __aexit__(self, *exc_info) -> None:
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
            bind, advertise = _tcp_host(self.manager_address)
            self._transport = ZmqTransport(self._context, self._keys, tcp_host=bind, advertise_host=advertise,
                                           encrypt_tcp=tcp_encryption_enabled())
            self._listener = await self._transport.listen()
            self._arrival = ArrivalOrder(self._on_frames, self._loop)   # ZeroMQ and bulk, in call order
            endpoints = dict(self._listener.endpoints)
            transports = (routing.INLINE,)
            if routing.BULK not in self._routing.disabled and "tcp" in endpoints:
                transports += await self._start_bulk(bind, advertise, endpoints)
            if routing.SHM not in self._routing.disabled and shm.available():
                self._shm = shm.ShmSession(self._loop, self._send_notice, views=self._shm_views,
                                           recycler=self._recycler, guard_relays=self._guard_relays)
                self.on_system("shm", self._shm.on_notice)
                transports += (routing.SHM,)
                self._pull = PullSession(self._loop, self.incarnation,
                                         functools.partial(self._send_notice, tag="pull"), self._recycler,
                                         self._shm.copier, offload=self._shm.offload, threshold=pull_threshold(),
                                         pid_of=self._pid_of)
                self.on_system("pull", self._pull.on_notice)
                self._stats_providers["pull"] = self._pull.report
            self._inbound = FrameReader(self._shm, self._recycler, self._pid_of, self._counters.dropped,
                                        self._gpu.open, self._gpu.refuse, self._pull)
            self._listener.set_handler(self._arrival.zmq)
            if routing.STREAM not in self._routing.disabled and StreamTransport.available():
                transports += await self._start_stream(endpoints)
            gpus = devices.discover_devices()
            if gpus and routing.CUDA_IPC not in self._routing.disabled and cuda_ipc.available():
                cuda_ipc.default_cap()          # a bad RLINF_CUDA_IPC_CAP fails here, not on a receive
                transports += (routing.CUDA_IPC,)
                self.on_system("cuda", self._gpu.on_notice)
            self.info = WorkerInfo(
                address=self.address, incarnation=self.incarnation, node_id=devices.node_id(),
                host=socket.gethostname(), pid=os.getpid(), endpoints=endpoints,
                devices=gpus, transports=transports,
                meta={"machine": control.machine_id(), **self._meta},
            )
            self._gpu.me = self.info
            self._control = control.ControlClient(self._context, self._keys, self.manager_address, self.info,
                                                  self._on_event, stats=self._heartbeat_stats,
                                                  exclusive=self._exclusive, on_superseded=self._superseded,
                                                  manager_host=self._manager_host)
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
                                                recycler=self._recycler, encrypt=tcp_encryption_enabled())
            self._bulk_listener = await self._bulk.listen()
        except (TransportUnavailableError, OSError) as exc:
            log.warning("rlinf %s: no bulk TCP transport (%s); large payloads to other nodes go "
                        "through ZeroMQ", self.address, exc)
            self._bulk = None
            return ()
        self._bulk_listener.set_handler(self._arrival.bulk)
        endpoints.update(self._bulk_listener.endpoints)
        return (routing.BULK,)

    async def _start_stream(self, endpoints: dict[str, str]) -> tuple[str, ...]:
        """Listen for stream links (frame sets from this node's processes); the
        transports this adds to what we advertise (none when it cannot run here)."""
        try:
            self._stream = StreamTransport(self._keys.bulk_key, recycler=self._recycler)
            self._stream_listener = await self._stream.listen()
        except TransportUnavailableError as exc:
            log.warning("rlinf %s: no stream transport (%s); this node's messages go through ZeroMQ ipc",
                        self.address, exc)
            self._stream = None
            return ()
        self._stream_listener.set_handler(self._arrival.zmq)   # one link per peer: counted as ZeroMQ's
        endpoints.update(self._stream_listener.endpoints)
        return (routing.STREAM,)

    async def aclose(self) -> None:
        """Deregister, fail pending operations with ``ClosedError``, release everything.

        Messages already handed to the transport still go out (bounded linger).
        Idempotent; safe to call from a cancelled task.
        """
        if self._closed is not None:
            if self._closing is not None:
                await asyncio.shield(self._closing)
            return
        self._closed = ClosedError(f"communicator {self.address} is closed")
        self._closing = closing = asyncio.get_running_loop().create_future()   # what a second aclose awaits
        try:
            await self._teardown(deregister=True)
        finally:
            closing.set_result(None)

    def _superseded(self, why: str) -> None:
        """The manager took us for lost and another incarnation holds our address now
        (a restart): close, failing every operation with a ``ClosedError`` that says so."""
        if self._closed is None:
            self._closed = ClosedError(f"communicator {self.address} was replaced by another "
                                       f"incarnation while the manager took it for lost ({why})")
            self._closing = self._loop.create_task(self._teardown(deregister=False))

    async def _teardown(self, *, deregister: bool) -> None:
        error = self._closed or ClosedError(f"communicator {self.address} failed to start")
        cancelled = None
        if self._shm is not None and deregister:
            try:   # readers of our last slots must map them before we unlink the files
                await self._shm.drain(_GRACEFUL_LINGER_MS / 1000)
            except asyncio.CancelledError as exc:   # finish closing, then re-raise
                cancelled = exc
            self._shm.close()      # releases owed to peers go out ahead of the bye
        if self._gpu.session is not None:
            self._gpu.session.flush()
        if self._pull is not None:
            if deregister:
                try:   # receivers still reading what we hold for them: let them finish
                    await self._pull.drain(_GRACEFUL_LINGER_MS / 1000)
                except asyncio.CancelledError as exc:
                    cancelled = exc
            self._pull.close(error)
        self._closed = error
        bye_to = self._say_bye() if deregister else []
        for closer in reversed(self._closers):
            try:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("rlinf %s: error while closing a subsystem", self.address)
        try:
            control_client = getattr(self, "_control", None)
            if control_client is not None:
                await control_client.close(deregister=deregister, bye_to=bye_to)
        finally:
            flushing = []
            for outbox in self._outboxes.values():
                outbox.flush()
                flushed = outbox.close(_GRACEFUL_LINGER_MS, error)
                if flushed is not None:
                    flushing.append(flushed)
            if flushing:    # stream links write what they buffered from this loop
                await asyncio.wait(flushing, timeout=_GRACEFUL_LINGER_MS / 1000 + 0.5)
            self._mailbox.close(error)
            for queue in self._subscribers:
                queue.put_nowait(None)
            transport = getattr(self, "_transport", None)
            if transport is not None:
                transport.close()
            for name in ("_listener", "_bulk_listener", "_stream_listener"):
                listener = getattr(self, name, None)
                if listener is not None:
                    listener.close()
            zap = getattr(self, "_zap", None)
            if zap is not None:
                zap.close()
            if self._shm is not None:
                self._shm.close()
            if self._gpu.session is not None:
                self._gpu.session.close()
            if self._context is not None:
                context, self._context = self._context, None
                # term() waits for lingering frames; keep the loop free meanwhile.
                await asyncio.get_running_loop().run_in_executor(None, context.term)
        if cancelled is not None:
            raise cancelled

    def _say_bye(self) -> list[str]:
        """Queue a SYSTEM "bye" behind the data on every open link: it tells each peer,
        in order with our last messages, that we left (the manager's "left" event travels
        another socket and may overtake them). Returns the peers told."""
        told = []
        for outbox in self._outboxes.values():
            if outbox.link is not None and outbox.error is None:
                outbox.put(OutMessage([wire.SYSTEM, "bye", b"", []], [], 0, None, False), self._loop)
                told.append(outbox.address)
        return told

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed
        if not self._started:
            raise ClosedError("communicator is not started: use 'async with rlinf.connect(...)'")

    # -- sending -----------------------------------------------------------------------
    async def send(self, obj: Any, dst: str, *, tag: int = 0, timeout: float | None = None) -> None:
        """Send ``obj`` to ``dst``.

        Returns when the buffers of ``obj`` may be reused: small messages (< 1 MiB) are
        copied at once, large ones are sent zero-copy and awaited until released, and a
        same-node message whose payload reaches the shared-memory threshold is copied
        once into a shared-memory slot, or, to a receiver that takes owned copies and
        agreed to, awaited until it has read the buffers from our memory (see
        ``docs/transports.md``).

        Raises:
            PeerLostError: ``dst`` died or left. CommTimeoutError: not sent in ``timeout``.
            EncodeError: ``obj`` cannot be encoded. ClosedError: we are closed.
        """
        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            _check_tag(tag)
        if timeout is not None:
            timeout = check_timeout(timeout)
        future = self._enqueue(obj, dst, tag, wire.USER, need_future=False)
        if future is not None:
            await self._wait(future, timeout, f"send to {dst}")
        if self._shm is not None and self._shm.behind(dst):
            await self._room(dst)
        cuda = self._gpu.session
        if cuda is not None and cuda.behind(dst):
            await cuda.room(dst)

    async def _room(self, dst: str) -> None:
        """Backpressure: wait while ``dst`` holds a window of our slots. Raises the
        peer's error if it went away meanwhile (it may never have read what we sent)."""
        await self._shm.room(dst)
        outbox = self._outboxes.get(dst)
        if outbox is not None and outbox.error is not None:
            raise outbox.error

    def async_send(self, obj: Any, dst: str, *, tag: int = 0) -> Work[None]:
        """Start a send now (ordering is fixed by this call) and return its :class:`Work`."""
        _check_tag(tag)
        future = self._enqueue(obj, dst, tag, wire.USER, need_future=True)
        return Work(future, f"send to {dst} tag={tag}")

    def blocking_send(self, obj: Any, dst: str, *, tag: int = 0, timeout: float | None = None) -> None:
        """:meth:`send` from a thread other than the loop's."""
        self._run_threadsafe(self.send(obj, dst, tag=tag, timeout=timeout), timeout)

    def _check_address(self, address: Any) -> None:
        parse_address(address)
        if len(self._valid) < 100_000:
            self._valid.add(address)

    def _enqueue(self, obj: Any, dst: str, tag: Any, kind: int, *, need_future: bool) -> asyncio.Future | None:
        """Encode and queue one message; returns a future unless it completed at once.

        This is the hot path of every send: keep it flat.
        """
        if self._closed is not None or not self._started:
            self._check_open()
        if threading.get_ident() != self._loop_thread:
            raise self._wrong_thread()
        if dst not in self._valid:
            self._check_address(dst)
        codec_header, buffers = self._codec.encode(obj)
        gpu = None
        for b in buffers:
            if type(b) is not memoryview and is_device_buffer(b):
                gpu = True
                break
        if dst == self.address:
            return self._send_to_self(tag, kind, codec_header, buffers, need_future)
        outbox = self._outboxes.get(dst)
        if outbox is None:
            outbox = self._outbox(dst)
        elif outbox.error is not None:
            raise outbox.error
        if gpu:
            buffers, gpu = self._gpu.prepare(buffers, dst)
        held = False      # the large slots we owe dst go back with this message, ahead of it
        ahead = None
        if self._shm is not None and self._shm.owed:
            ahead = self._shm.ahead(dst)
            if ahead:
                self._queue_notice(outbox, self._shm.take(dst), hold=True)
                held = True
        cuda = self._gpu.session
        if cuda is not None and cuda.owed:
            notice = cuda.take(dst)
            if notice is not None:
                self._queue_notice(outbox, notice, hold=True, tag="cuda")
                held = True
        future = self._queue(outbox, kind, tag, codec_header, buffers, need_future, gpu)
        if held:
            outbox.flush()
        elif ahead is False:   # small slots: right after it (after its flush), off a reply's path
            self._loop.call_soon(self._shm.flush_to, dst)
        return future

    def _new_cuda_session(self) -> cuda_ipc.CudaIpcSession:
        return cuda_ipc.CudaIpcSession(self._loop, functools.partial(self._send_notice, tag="cuda"),
                                       self.incarnation, views=self._shm_views)

    def _queue(self, outbox: Outbox, kind: int, tag: Any, codec_header: bytes, buffers: list,
               need_future: bool, gpu: list | None = None) -> asyncio.Future | None:
        """Route and queue one encoded message to ``outbox`` (the rest of the hot path);
        ``gpu``: the descriptor of its GPU buffers, already in a CUDA IPC slot."""
        nbytes = 0
        for b in buffers:
            nbytes += b.nbytes if type(b) is memoryview else memoryview(b).nbytes
        if nbytes >= self._routing.shm_threshold and nbytes and self._shm is not None \
                and outbox.info is not None and self._shm_route(outbox.info):
            sizes = [memoryview(b).nbytes for b in buffers]
            relayed = self._shm.relay.plan(buffers, sizes, outbox.address)
            if relayed is None and gpu is None and kind == wire.USER and self._pull is not None \
                    and nbytes >= self._pull.threshold and self._pull.agreed(outbox.address, outbox.info.incarnation):
                return self._queue_pull(outbox, tag, codec_header, buffers, sizes, nbytes)
            if relayed is not None:   # views of another process's slot: forwarded by reference
                sizes = [0 if i in relayed[0] else n for i, n in enumerate(sizes)]
            export = self._shm.export(buffers, sizes, {outbox.address: 1}) if any(sizes) else (None, sizes, None)
            if export is not None:
                return self._queue_slot(outbox, kind, tag, codec_header, export, nbytes, need_future, relayed,
                                        gpu)
            if relayed is not None:
                self._shm.relay.cancel(outbox.address, relayed[1])
        if nbytes < SMALL_MESSAGE:
            # copy now (the caller may reuse its buffers); coalesced into one frame later
            frames, counts, large = [bytes(b) for b in buffers], None, False
        elif outbox.bulk is not None and nbytes >= self._routing.bulk_threshold and gpu is None:
            # another node, by the bulk stream: one frame per buffer, read into place there
            frames, counts, nbytes = bulk_frames(buffers)
            entry = [kind, tag, codec_header, counts]
            future = self._loop.create_future()
            outbox.put(OutMessage(entry, frames, nbytes + len(codec_header), future, True,
                                  transport=routing.BULK), self._loop)
            return future
        else:
            frames, counts, nbytes = split_frames(buffers)
            large = True
        entry = [kind, tag, codec_header, counts]
        nbytes += len(codec_header)
        transport, discard = "zmq", None
        if gpu is not None:      # its GPU buffers wait in a CUDA IPC slot: the entry says where
            entry += [None, None, gpu]
            nbytes += sum(place[2] for place in gpu[5])
            transport, discard = routing.CUDA_IPC, functools.partial(self._gpu.discard, gpu)
        if not large and not need_future and outbox.ready:
            outbox.put(OutMessage(entry, frames, nbytes, None, False, transport=transport, discard=discard),
                       self._loop)
            return None
        future = self._loop.create_future()
        if not large and outbox.ready:
            future.set_result(None)
        outbox.put(OutMessage(entry, frames, nbytes, future, large, transport=transport, discard=discard),
                   self._loop)
        return future

    def _queue_pull(self, outbox: Outbox, tag: Any, codec_header: bytes, buffers: list, sizes: list[int],
                    nbytes: int) -> asyncio.Future:
        """Queue a message whose receiver pulls its buffers from our memory (it agreed to;
        see ``rlinf/transports/_pull.py``); the future completes once it has read them."""
        pull = self._pull
        layout, item, future, sent = pull.offer(outbox.address, outbox.info.incarnation, buffers, sizes)
        entry = [wire.USER, tag, codec_header, layout, None, None, None, item]
        discard = lambda: pull.drop(item[0], outbox.error)   # noqa: E731
        try:
            outbox.put(OutMessage(entry, [], nbytes + len(codec_header), sent, False, transport=routing.SHM,
                                  discard=discard), self._loop)
        except BaseException as exc:   # the outbox failed meanwhile: no hold is left behind
            pull.drop(item[0], exc)
            future.exception()
            raise
        return future

    def _shm_route(self, info: WorkerInfo) -> bool:
        """Whether a message whose host payload reaches the shm threshold goes to ``info``
        through shared memory. The payload of one message is routed as one CPU buffer
        (its buffers share one slot), and ``select_transport`` is pure, so its answer is
        cached per peer incarnation (dropped when the roster changes)."""
        route = self._shm_routes.get(info.address)
        if route is None:
            probe = devices.BufferInfo("cpu", max(1, self._routing.shm_threshold))
            chosen = routing.select_transport(self.info, info, probe, config=self._routing)
            route = self._shm_routes[info.address] = chosen.transport == routing.SHM
        return route

    def _queue_slot(self, outbox: Outbox, kind: int, tag: Any, codec_header: bytes, export: tuple,
                    nbytes: int, need_future: bool, relayed: tuple | None = None,
                    gpu: list | None = None) -> asyncio.Future | None:
        """Queue a message whose buffers sit in shared memory: a slot of ours (``export``:
        ``(slot or None, layout, copying)``) and/or, when ``relayed`` (``(places,
        relays)``), other processes' slots forwarded by reference (descriptors on the wire);
        ``gpu``: its GPU buffers' CUDA IPC descriptor."""
        slot, layout, copying = export
        session, dst = self._shm, outbox.address
        if relayed is None:
            entry = [kind, tag, codec_header, layout, slot.to_wire()]
            discard = lambda: session.discard(slot, copying, dst)   # noqa: E731
            if gpu is not None:
                entry += [None, gpu]
        else:
            places, relays = relayed
            layout = list(layout)
            for i, place in places.items():
                layout[i] = place
            entry = [kind, tag, codec_header, layout, slot and slot.to_wire(), relays]

            def discard() -> None:
                session.relay.cancel(dst, relays)
                if slot is not None:
                    session.discard(slot, copying, dst)
            if gpu is not None:
                entry.append(gpu)
        if gpu is not None:
            discard = self._with_gpu_discard(discard, gpu)
        future = None
        if copying is not None or need_future:
            future = self._loop.create_future()
            if copying is None:
                future.set_result(None)     # copied: the caller's buffers are free again
        outbox.put(OutMessage(entry, [], nbytes + len(codec_header), future, False, transport=routing.SHM,
                              copying=copying, discard=discard), self._loop)
        return future

    def _with_gpu_discard(self, discard: Callable[[], None], gpu: list) -> Callable[[], None]:
        paths = self._gpu

        def both() -> None:
            discard()
            paths.discard(gpu)
        return both

    def _send_to_self(self, tag, kind, codec_header, buffers, need_future) -> asyncio.Future | None:
        copies = [bytearray(memoryview(b).cast("B")) if type(b) is memoryview or not is_device_buffer(b)
                  else b.clone() if hasattr(b, "clone") else b.copy() for b in buffers]
        self._mailbox.deliver(Message(self.address, self.incarnation, tag, codec_header, copies))
        if not need_future:
            return None
        future = self._loop.create_future()
        future.set_result(None)
        return future

    def _outbox(self, dst: str) -> Outbox:
        lost = self._mailbox.is_lost(dst)
        if lost is not None:
            raise PeerLostError(str(lost), peer=dst)
        outbox = self._outboxes[dst] = Outbox(dst, self._header, self._counters)
        info = self._roster.get(dst)
        if info is not None:
            self._connect(outbox, info)
        else:
            outbox.resolving = self._loop.create_task(self._resolve(outbox))
        return outbox

    def _connect(self, outbox: Outbox, info: WorkerInfo) -> None:
        """Give ``outbox`` its link to ``info``: at once for ZeroMQ; for a stream, once it
        is connected and authenticated (sends queue meanwhile)."""
        scheme = routing.select_scheme(self.info, info, config=self._routing)
        if self._bulk is not None:
            probe = devices.BufferInfo("cpu", max(1, self._routing.bulk_threshold))
            if routing.select_transport(self.info, info, probe, config=self._routing).transport == routing.BULK:
                outbox.bulk = functools.partial(self._bulk.connect, info.endpoints[tcp_bulk.SCHEME],
                                                identity=self._identity)
        if scheme == routing.STREAM and self._stream is not None:
            outbox.info = info
            outbox.resolving = self._loop.create_task(self._dial_stream(outbox, info))
            return
        outbox.attach(self._zmq_link(info, scheme), info)

    def _zmq_link(self, info: WorkerInfo, scheme: str):
        endpoint = info.endpoints.get(scheme) or info.endpoints.get("ipc") or info.endpoints["tcp"]
        return self._transport.connect_now(endpoint, identity=self._identity)

    async def _dial_stream(self, outbox: Outbox, info: WorkerInfo) -> None:
        """Open the stream link of ``outbox``; a stream that cannot be opened (a peer
        that refuses or stopped listening) is not an error: ZeroMQ carries the messages."""
        try:
            link = await self._stream.connect(info.endpoints[routing.STREAM], identity=self._identity)
        except (PeerLostError, AuthenticationError) as exc:
            if control.process_gone_here(info):   # it died: what waits for the link must fail, not go to ZeroMQ
                outbox.fail(PeerLostError(f"{outbox.address} was lost", peer=outbox.address))
                return
            log.warning("rlinf %s: no stream to %s (%s); using ZeroMQ", self.address, outbox.address, exc)
            link = self._zmq_link(info, "ipc")
        if outbox.error is not None:
            link.close()
            return
        outbox.attach(link, info)

    async def _resolve(self, outbox: Outbox) -> None:
        """Find a peer that is not in our roster yet (waits for it to join)."""
        while outbox.link is None and outbox.error is None:
            info = self._roster.get(outbox.address)
            if info is None:
                try:
                    info = await self._control.lookup(outbox.address, wait=True, timeout=2.0)
                except CommTimeoutError:
                    continue   # manager slow or restarting: ask again
                except ClosedError as exc:
                    outbox.fail(exc)
                    return
            if info is not None and outbox.link is None and outbox.error is None:
                self._roster.setdefault(info.address, info)
                self._connect(outbox, info)
                return

    # -- receiving ---------------------------------------------------------------------
    async def recv(self, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """Receive the next message from ``src`` with ``tag``.

        Arrays and tensors in it are writable views over the received buffers, owned
        by the caller. When the message came through shared memory they are views of
        the sender's slot, which goes back to the sender once they are all
        garbage-collected (or owned copies, with ``shm_views=False``). Cancelling (or
        timing out) never loses a message.

        Raises:
            PeerLostError: ``src`` died or left and nothing from it is queued.
            CommTimeoutError, DecodeError, ClosedError.
        """
        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            _check_tag(tag)
        if timeout is not None:
            timeout = check_timeout(timeout)
        if src not in self._valid:
            self._check_address(src)
        msg = self._get_nowait(src, tag)
        if msg is None:
            msg = await self._park(src, tag, timeout)
        if msg.shm and not self._shm_views:
            return await self._decode_owned(msg)
        return self._decode(msg)

    async def recv_any(self, *, tag: int = 0, timeout: float | None = None) -> tuple[Any, str]:
        """Receive the oldest message with ``tag`` from any source: ``(obj, src)``."""
        _check_tag(tag)
        timeout = check_timeout(timeout)
        msg = await self._get(None, tag, timeout)
        if msg.shm and not self._shm_views:
            return await self._decode_owned(msg), msg.src
        return self._decode(msg), msg.src

    def async_recv(self, src: str, *, tag: int = 0) -> Work[Any]:
        """Start a receive now and return its :class:`Work` (cancel it safely with
        ``cancel()``). Its place in line is taken by this call: a ``recv`` made later
        gets a later message."""
        _check_tag(tag)
        parse_address(src)
        self._check_open()
        what = f"recv from {src} tag={tag}"
        try:
            msg = self._get_nowait(src, tag)
        except RlinfError as exc:    # lost or closed: the Work fails with it
            failed = self._loop.create_future()
            failed.set_exception(exc)
            return Work(failed, what)
        waiter = self._mailbox.park(src, tag) if msg is None else None
        started = []
        task = self._loop.create_task(self._finish_recv(msg, waiter, started))

        def cancelled_before_it_ran(t: asyncio.Task) -> None:
            if t.cancelled() and not started:   # the message (or the place) is not lost
                if waiter is not None:
                    self._mailbox.abandon(waiter)
                else:
                    self._mailbox.put_back(msg)

        task.add_done_callback(cancelled_before_it_ran)
        return Work(task, what)

    async def _finish_recv(self, msg: Message | None, waiter: Any, started: list) -> Any:
        started.append(True)
        if msg is None:
            msg = await self._mailbox.wait_parked(waiter)
        if msg.shm and not self._shm_views:
            return await self._decode_owned(msg)
        return self._decode(msg)

    def blocking_recv(self, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """:meth:`recv` from a thread other than the loop's."""
        return self._run_threadsafe(self.recv(src, tag=tag, timeout=timeout), timeout)

    async def recv_into(self, target: Any, src: str, *, tag: int = 0, timeout: float | None = None) -> Any:
        """Receive a message and write its arrays/tensors into ``target``'s, in place.

        ``target`` must have the same structure, shapes and dtypes as the message.

        Returns:
            ``target``.

        Raises:
            ValueError / TypeError: the message does not match ``target``. Nothing is
                written then, and the message stays next in line for ``src`` and ``tag``
                (a ``recv`` or a corrected ``recv_into`` gets it).
            Same as :meth:`recv` otherwise.
        """
        from ..codec.into import copy_into   # only recv_into needs it

        if type(tag) is not int or not _TAG_MIN <= tag <= _TAG_MAX:
            _check_tag(tag)
        timeout = check_timeout(timeout)
        if src not in self._valid:
            self._check_address(src)
        msg = await self._get(src, tag, timeout)
        obj = await self._decode_owned(msg) if msg.shm and not self._shm_views else self._decode(msg)
        try:
            copy_into(target, obj)
        except (TypeError, ValueError):
            del obj
            self._mailbox.put_back(msg)
            raise
        return target

    async def _get(self, src: str | None, tag: Any, timeout: float | None) -> Message:
        msg = self._get_nowait(src, tag)
        return msg if msg is not None else await self._park(src, tag, timeout)

    def _get_nowait(self, src: str | None, tag: Any) -> Message | None:
        """The next matching message if one is queued (raises if none can ever come)."""
        self._check_open()
        if threading.get_ident() != self._loop_thread:
            raise self._wrong_thread()
        msg = self._mailbox.get_nowait(src, tag)
        if msg is not None and self._shm is not None and self._shm.owed >= _OWED_BURST:
            # consuming a backlog without yielding: return the slots now, not at the end
            self._shm.flush()
        return msg

    def _park(self, src: str | None, tag: Any, timeout: float | None) -> Awaitable[Message]:
        """Await the next matching message when :meth:`_get_nowait` found none (returned
        without a coroutine of its own around the mailbox's wait: one level less to
        resume per received message)."""
        if timeout is None:
            return self._mailbox.wait(src, tag)
        return self._park_timeout(src, tag, timeout)

    async def _park_timeout(self, src: str | None, tag: Any, timeout: float) -> Message:
        try:
            async with asyncio.timeout(timeout):
                return await self._mailbox.wait(src, tag)
        except TimeoutError:
            what = f"from {src}" if src else "from any source"
            raise CommTimeoutError(f"{self.address}: no message {what} with tag {tag!r} within {timeout} s") from None

    def _decode(self, msg: Message) -> Any:
        if msg.error is not None:
            raise msg.error
        if msg.ready is not None:       # GPU buffers: the caller's stream follows their copy
            try:
                msg.ready()
            except Exception as exc:   # a device in a bad state
                raise DecodeError(f"message from {msg.src}: its GPU buffers cannot be waited for: {exc!r}") from exc
        return self._codec.decode(msg.codec_header, msg.buffers)

    async def _decode_owned(self, msg: Message) -> Any:
        """Copy-out (``shm_views=False``): decode over owned copies; the slot goes back
        as soon as the copies are made. Large copies run in the executor; a receive
        cancelled meanwhile puts the message back (nothing is lost). A pulled message
        was read into owned memory on arrival: wait for that read to end."""
        if msg.pulling is not None:
            try:
                await asyncio.shield(msg.pulling)
            except asyncio.CancelledError:
                self._mailbox.put_back(msg)
                raise
            msg.pulling, msg.shm = None, False
            return self._decode(msg)
        if self._pull is not None:    # it came through a slot: ask its sender to be pulled from
            self._pull.want(msg.src, msg.incarnation)
        if msg.error is None:
            if msg.nbytes >= self._shm.offload:
                try:
                    owned = await self._loop.run_in_executor(None, self._shm.owned, msg.buffers)
                except asyncio.CancelledError:
                    self._mailbox.put_back(msg)
                    raise
            else:
                owned = self._shm.owned(msg.buffers)
            msg.buffers, msg.shm = owned, False
        return self._decode(msg)

    def _on_frames(self, received: Received) -> None:
        frames = received.frames
        try:
            src, incarnation, entries, packed = wire.unpack_header(received.header, frames)
            if received.peer != f"{src}|{incarnation}".encode():
                raise ProtocolError("frame set claims a source other than its connection's")
        except ProtocolError as exc:
            self._counters.dropped()
            log.warning("rlinf %s: dropped a bad frame set: %r", self.address, exc)
            return
        if (src, incarnation) in self._dead:
            self._counters.dropped()
            return
        for entry, buffers, nbytes, in_shm, error, ready, pulling in self._inbound.entries(
                src, entries, frames, packed, incarnation):
            if entry.kind == wire.USER:
                self._counters.received(src, nbytes + len(entry.codec_header))
                self._mailbox.deliver(Message(src, incarnation, entry.tag, entry.codec_header, buffers, 0, nbytes,
                                              in_shm, error, ready, pulling))
            elif pulling is not None:
                log.warning("rlinf %s: dropped system message %r with pulled buffers", self.address, entry.tag)
            elif error is not None:
                log.warning("rlinf %s: dropped system message %r: %s", self.address, entry.tag, error)
            elif entry.tag == "bye":
                self._peer_gone(src, incarnation, "left")
            else:
                handler = self._system_handlers.get(entry.tag)
                if handler is None:
                    log.warning("rlinf %s: no handler for system message %r", self.address, entry.tag)
                    continue
                try:
                    if ready is not None:
                        ready()
                    handler(src, self._codec.decode(entry.codec_header, buffers))
                except Exception:   # a subsystem bug must not kill the reader
                    log.exception("rlinf %s: system handler %r failed", self.address, entry.tag)

    def _pid_of(self, address: str) -> int | None:
        info = self._roster.get(address)
        return info.pid if info is not None else None

    def _send_notice(self, dst: str, obj: Any, tag: str = "shm") -> None:
        """Send a SYSTEM notice (``"shm"``: releases, mappings; ``"cuda"``: CUDA IPC
        releases) now — also while closing, so what we owe a sender goes out ahead of
        our goodbye."""
        outbox = self._outboxes.get(dst)
        if outbox is None:
            self._check_open()
            outbox = self._outbox(dst)
        if outbox.error is not None:
            raise outbox.error
        self._queue_notice(outbox, obj, hold=False, tag=tag)
        outbox.flush()       # notices are already batched by the sessions: send now

    def _queue_notice(self, outbox: Outbox, obj: Any, *, hold: bool, tag: str = "shm") -> None:
        """Queue a notice (a small SYSTEM message without buffers) to ``outbox``; with
        ``hold``, it waits for the next flush (it goes out with the message queued next)."""
        codec_header, _ = self._codec.encode(obj)
        entry = [wire.SYSTEM, tag, codec_header, []]
        outbox.put(OutMessage(entry, [], len(codec_header), None, False), self._loop, hold=hold)

    # -- membership --------------------------------------------------------------------
    def _on_event(self, event: MembershipEvent, bye_sent: bool = False) -> None:
        if event.address == self.address:
            return
        self._shm_routes.pop(event.address, None)
        self._gpu.changed(event.address)
        if event.kind == "joined" and event.info is not None:
            old = self._roster.get(event.address)
            self._roster[event.address] = event.info
            self._dead.discard((event.address, event.incarnation))
            self._mailbox.peer_joined(event.address, event.incarnation)
            self._gpu.joined(event.address, event.info)    # restarted, maybe: its old slots go
            outbox = self._outboxes.get(event.address)
            if outbox is not None and (outbox.error is not None or (old and old.incarnation != event.incarnation)):
                del self._outboxes[event.address]   # next send dials the new incarnation
                if outbox.error is None:
                    outbox.fail(PeerLostError(f"{event.address} restarted", peer=event.address))
        else:
            info = self._roster.get(event.address)
            if info is not None and event.incarnation and info.incarnation != event.incarnation:
                return   # an older incarnation went away; the current one is fine
            self._roster.pop(event.address, None)
            if event.kind == "left" and bye_sent:
                # Its last messages may still be in flight on the data socket; its "bye"
                # follows them. Fall back to the event if the bye never comes.
                self._loop.call_later(_BYE_GRACE, self._loop.call_later, _AFTER_ONE_POLL,
                                      self._peer_gone, event.address, event.incarnation, "left")
            else:
                self._peer_gone(event.address, event.incarnation, event.kind)
        for queue in self._subscribers:
            queue.put_nowait(event)

    def _peer_gone(self, address: str, incarnation: str, kind: str) -> None:
        """``address``'s ``incarnation`` is gone: fail what waits on it (idempotent)."""
        key = (address, incarnation)
        if key in self._dead or self._closed is not None:
            return
        self._dead.add(key, DEAD_KEPT)
        self._arrival.forget(f"{address}|{incarnation}".encode())
        if self._pull is not None:
            self._pull.gone(address, incarnation)
        current = self._roster.get(address)
        if current is not None and current.incarnation != incarnation:
            return   # a newer incarnation already joined
        error = PeerLostError(f"{address} {'left' if kind == 'left' else 'was lost'}", peer=address)
        self._mailbox.peer_lost(address, error)
        outbox = self._outboxes.get(address)
        info = current if current is not None else outbox.info if outbox is not None else None
        gone_here = info is not None and info.incarnation == incarnation and control.process_gone_here(info)
        if self._shm is not None:
            self._shm.peer_gone(address, alive=not gone_here)
        self._gpu.gone(address, incarnation, left=kind == "left", process_gone=gone_here)
        for hook in self._gone_hooks:
            hook(address, incarnation)
        if outbox is not None and (outbox.info is None or outbox.info.incarnation == incarnation):
            outbox.fail(error)
            forgotten = self._failed.add(address, DEAD_KEPT)
            old = self._outboxes.get(forgotten) if forgotten is not None else None
            if old is not None and old.error is not None:
                del self._outboxes[forgotten]   # bounded: a send there now waits for it to join

    async def peers(self) -> list[WorkerInfo]:
        """The workers this communicator knows (its cached roster, without itself)."""
        self._check_open()
        return list(self._roster.values())

    async def events(self) -> AsyncIterator[MembershipEvent]:
        """Membership events from now on, until the communicator closes."""
        self._check_open()
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while True:
                event = await queue.get()
                if event is None:
                    return
                yield event
        finally:
            self._subscribers.remove(queue)

    def stats(self) -> CommStats:
        """A frozen snapshot of traffic per peer and per transport."""
        connected = {a for a, o in self._outboxes.items() if o.link is not None}
        return self._counters.snapshot(connected)

    # -- internal API for rlinf's own subsystems (collectives, channels, transports) ---
    # Internal traffic uses str tags, so it can never match a user's int tag.
    async def _recv_tagged(self, src: str, tag: str, timeout: float | None = None) -> Any:
        msg = await self._get(src, tag, timeout)
        if msg.shm and not self._shm_views:
            return await self._decode_owned(msg)
        return self._decode(msg)

    async def _recv_any_tagged(self, tag: str, timeout: float | None = None) -> tuple[Any, str]:
        msg = await self._get(None, tag, timeout)
        if msg.shm and not self._shm_views:
            return await self._decode_owned(msg), msg.src
        return self._decode(msg), msg.src

    async def _multicast(self, obj: Any, dsts: list[str], tag: str) -> None:
        """Send ``obj`` to every address of ``dsts``, encoded once.

        Same-node destinations that take shared memory share ONE slot (copied once, with
        a reader count; each maps it copy-on-write, so a reader's writes stay its own);
        the others get the usual path, sharing the encoded buffers. Returns when the
        buffers of ``obj`` may be reused.

        Raises:
            PeerLostError: a destination is gone (nothing was sent to anyone then).
        """
        self._check_open()
        for dst in dsts:
            if dst not in self._valid:
                self._check_address(dst)
        codec_header, buffers = self._codec.encode(obj)
        outboxes = {}
        for dst in dict.fromkeys(dsts):
            if dst != self.address:
                outbox = self._outboxes.get(dst) or self._outbox(dst)
                if outbox.error is not None:
                    raise outbox.error
                outboxes[dst] = outbox
        if any(type(b) is not memoryview and is_device_buffer(b) for b in buffers):
            # GPU buffers: one send each (a CUDA IPC slot has one reader; staged ones copy)
            await asyncio.gather(*[self._enqueue(obj, dst, tag, wire.USER, need_future=True) for dst in dsts])
            return
        sizes = [memoryview(b).nbytes for b in buffers]
        nbytes = sum(sizes)
        readers: dict[str, int] = {}
        if nbytes and nbytes >= self._routing.shm_threshold and self._shm is not None:
            for dst in dsts:
                info = outboxes[dst].info if dst in outboxes else None
                if info is not None and self._shm_route(info):
                    readers[dst] = readers.get(dst, 0) + 1
        if self._shm is not None and self._shm.owed:
            self._shm.flush()
        export = self._shm.export(buffers, sizes, readers, private=sum(readers.values()) > 1) if readers else None
        futures = []
        for dst in dsts:
            if dst == self.address:
                futures.append(self._send_to_self(tag, wire.USER, codec_header, buffers, True))
            elif export is not None and dst in readers:
                futures.append(self._queue_slot(outboxes[dst], wire.USER, tag, codec_header, export, nbytes, True))
            else:
                futures.append(self._queue(outboxes[dst], wire.USER, tag, codec_header, buffers, True))
        await asyncio.gather(*futures)

    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        """Register ``handler(src, obj)`` for SYSTEM messages with ``tag`` (loop thread)."""
        self._system_handlers[tag] = handler

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        """Call ``hook(address, incarnation)`` whenever a peer leaves or is lost."""
        self._gone_hooks.append(hook)

    def add_closer(self, closer: Callable[[], Any]) -> None:
        """Run ``closer()`` (sync or async) when the communicator closes, newest first."""
        self._closers.append(closer)

    def add_stats_provider(self, name: str, provider: Callable[[], dict]) -> None:
        """Report ``provider()`` under ``name`` in the stats sent with heartbeats.

        The manager keeps the latest report per worker and ``rlinf top`` shows it (a
        channel server reports its ``ChannelStats`` as ``"channel"``). ``provider`` runs
        on the loop thread about once a second and must return plain values (dict, list,
        str, int, float, bool, None).

        Raises:
            ValueError: ``name`` is taken (by another provider or a built-in counter).
        """
        if name in self._stats_providers or name in self.stats().to_dict():
            raise ValueError(f"stats name {name!r} is already reported by {self.address}")
        self._stats_providers[name] = provider

    def _heartbeat_stats(self) -> dict:
        report = self.stats().to_dict()
        for name, provider in self._stats_providers.items():
            try:
                report[name] = provider()
            except Exception:   # one broken provider must not stop the worker's reports
                log.exception("rlinf %s: stats provider %r failed", self.address, name)
        return report

    # -- helpers -----------------------------------------------------------------------
    async def _wait(self, future: asyncio.Future, timeout: float | None, what: str) -> Any:
        if timeout is None:
            return await future
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise CommTimeoutError(f"{self.address}: {what} did not complete within {timeout} s") from None

    def _wrong_thread(self) -> RuntimeError:
        return RuntimeError(f"communicator {self.address} is used on its own event loop's thread only; "
                            f"from another thread use its blocking_* methods (or asyncio.run_coroutine_threadsafe)")

    def _run_threadsafe(self, coro, timeout: float | None) -> Any:
        """Run ``coro`` on the loop from another thread. ``timeout`` (the operation's own)
        also bounds the wait for a loop too busy to start it (plus :data:`_LOOP_GRACE`)."""
        try:
            timeout = check_timeout(timeout)
            self._check_open()
            if self._loop.is_closed() or not self._loop.is_running():
                raise ClosedError(f"communicator {self.address}: its event loop is not running")
        except BaseException:
            coro.close()
            raise
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop or threading.get_ident() == self._loop_thread:
            coro.close()
            raise RuntimeError("blocking_* would deadlock on the communicator's own loop; use 'await'")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(None if timeout is None else timeout + _LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CommTimeoutError(f"{self.address}: the event loop did not run the operation within "
                                   f"{timeout} s (it is busy)") from None
        except BaseException:   # interrupted (KeyboardInterrupt): the operation must not go on alone
            future.cancel()
            raise

