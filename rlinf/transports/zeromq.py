"""ZeroMQ transport: ``ipc://`` on one node, ``tcp://`` across nodes.

Sockets are plain (blocking-API) pyzmq sockets driven by the event loop through their
file descriptor (``loop.add_reader``), not ``zmq.asyncio``: it saves a future and a
callback per message on the hot path.

Listener: one ROUTER per scheme (the ``ipc`` one authenticated by PLAIN in a ``0700``
directory, the ``tcp`` one by CURVE, encrypted unless ``RLINF_TCP_ENCRYPTION=0``).
Link: one DEALER per peer whose routing id is the sender's identity.

Buffer lifetime: an untracked :meth:`ZmqLink.try_send` copies every frame. A tracked
one sends frames of ``zmq.COPY_THRESHOLD`` (64 KiB) and more zero-copy and returns a
ZeroMQ message tracker: :meth:`ZmqLink.released` returns once libzmq let go of them
(smaller frames are copied; with no large frame, nothing is tracked). Received frames
are ``zmq.Frame`` buffers owned by the receiver (writable), valid while referenced.

Errors: ``zmq.Again`` becomes :class:`~rlinf.errors.WouldBlock`; any other
``zmq.ZMQError`` becomes :class:`~rlinf.errors.PeerLostError`, or
:class:`~rlinf.errors.ClosedError` when we terminated the context (see :func:`_lost`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Protocol, Sequence

import zmq
from zmq.backend import Socket as _BackendSocket

from . import leftovers
from ..errors import ClosedError, PeerLostError, TransportUnavailableError, WouldBlock
from .base import Inbox, Link, Listener, Received, Transport

__all__ = ["ZmqTransport", "ZmqLink", "ZmqListener", "SocketSecurity", "make_ipc_dir"]

log = logging.getLogger("rlinf.transports.zeromq")

#: Frame sets read per loop callback before yielding to other tasks (fairness).
_READ_BUDGET = 512
_SNDHWM = 4096
_RCVHWM = 4096
_SOCKET_BUFFER = 4 << 20

# The per-message path calls pyzmq's backend methods with plain int constants: the
# sugar layer (send_multipart's type checks, option enums) costs more than the call.
_send = _BackendSocket.send
_recv = _BackendSocket.recv
_getsockopt = _BackendSocket.get
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


#: Socket directories this process made, removed at exit if still there (a program that
#: returns without closing its communicators); only the creating pid removes them.
_IPC_DIRS: dict[str, int] = {}


@atexit.register
def _remove_ipc_dirs_at_exit() -> None:
    for path, pid in list(_IPC_DIRS.items()):
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)


def make_ipc_dir() -> str:
    """A short private directory for socket files (AF_UNIX paths max 107 bytes), named
    after this process (:mod:`rlinf.transports.leftovers`). Whoever listens there removes it on close;
    if the process exits first, an exit hook does."""
    path = tempfile.mkdtemp(prefix=leftovers.prefix(), dir=leftovers.tmp_dir())
    os.chmod(path, 0o700)
    if len(_IPC_DIRS) > 10_000:   # closed listeners removed theirs: forget those
        for old in [p for p in _IPC_DIRS if not os.path.isdir(p)]:
            del _IPC_DIRS[old]
    _IPC_DIRS[path] = os.getpid()
    return path


def ipc_dirs_of(pid: int) -> list[str]:
    """The socket directories process ``pid`` made and did not remove: for whoever
    cleans up after it once it is gone, also those it made before telling anyone."""
    return [path for path in leftovers.owned_by(pid, leftovers.tmp_dir()) if os.path.isdir(path)]


def _nbytes(frame: Any) -> int:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    return memoryview(frame).nbytes


class ZmqListener(Listener):
    """ROUTER sockets bound on ``ipc://`` and/or ``tcp://``; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[zmq.Socket],
                 endpoints: dict[str, str], ipc_dir: str | None) -> None:
        self.endpoints = endpoints
        self._loop = loop
        self._sockets = sockets
        self._ipc_dir = ipc_dir
        self._inbox = Inbox(loop)
        self._closed = False
        for sock in sockets:
            loop.add_reader(sock.FD, self._on_readable, sock)

    def set_handler(self, handler: Callable[[Received], None]) -> None:
        self._inbox.handler = handler
        for sock in self._sockets:
            self._loop.call_soon(self._on_readable, sock)

    async def recv(self) -> Received:
        """Next frame set, for callers that did not set a handler (tests, tools)."""
        return await self._inbox.recv()

    def _on_readable(self, sock: zmq.Socket) -> None:
        """Read one frame set, then drain the rest after the callbacks it made ready.

        The first frame set is handed over at once and the socket is drained in a
        callback scheduled behind the task its delivery woke, so that a reply does not
        wait for the (empty) second read. ZeroMQ's FD is edge-triggered: a callback
        must read until the socket reports no more input, or it is not called again.
        """
        if self._closed or sock.closed:
            return
        try:
            if self._read(sock):
                self._loop.call_soon(self._drain, sock)
        except zmq.ZMQError as exc:
            self._read_failed(exc)

    def _drain(self, sock: zmq.Socket) -> None:
        if self._closed or sock.closed:
            return
        try:
            for _ in range(_READ_BUDGET):
                if not _getsockopt(sock, _EVENTS) & _POLLIN or not self._read(sock):
                    return
        except zmq.ZMQError as exc:
            self._read_failed(exc)
            return
        # Budget spent with more waiting: continue after other ready callbacks ran.
        self._loop.call_soon(self._drain, sock)

    def _read(self, sock: zmq.Socket) -> bool:
        """Receive and deliver one frame set; False when none was waiting.

        Routing id and header are copied to ``bytes``; payload frames are received
        zero-copy (``zmq.Frame`` buffers, writable, valid while referenced).
        """
        try:
            frame = _recv(sock, _NOBLOCK, False)
        except zmq.Again:
            return False
        if not frame.more:
            log.warning("rlinf: dropped a frame set without a header")
            return True
        peer = frame.bytes
        frame = _recv(sock, _NOBLOCK, False)
        header = frame.bytes
        frames = []
        while frame.more:
            frame = _recv(sock, _NOBLOCK, False)
            frames.append(frame.buffer)
        self._inbox.deliver(Received(peer, header, frames))
        return True

    def _read_failed(self, exc: zmq.ZMQError) -> None:
        if not self._closed:
            log.error("rlinf: data socket read failed: %s", exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            if not sock.closed:
                try:
                    self._loop.remove_reader(sock.FD)
                except (ValueError, OSError, RuntimeError):
                    pass
                sock.close(0)
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self._inbox.close()


class ReleaseWatcher:
    """Turns ZeroMQ message trackers into asyncio futures, with one helper thread.

    libzmq releases zero-copy frames on its own I/O thread and pyzmq exposes that only
    as a blocking wait; polling from the loop would cost a timer tick (1 ms on uvloop)
    per message. The thread waits on trackers in turn (briefly, so one stuck message
    does not hold back others) and completes the futures on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, tracker: zmq.MessageTracker) -> asyncio.Future:
        fut = self._loop.create_future()
        self._items.append((tracker, fut))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlinf-release", daemon=True)
            self._thread.start()
        self._wake.set()
        return fut

    def _run(self) -> None:
        items = self._items
        while not self._stopped:
            if not items:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            tracker, fut = items.popleft()
            try:
                done = tracker.wait(0.01) is None or tracker.done
            except zmq.NotDone:
                done = False
            if done:
                try:
                    self._loop.call_soon_threadsafe(_resolve, fut)
                except RuntimeError:      # the loop is closed: no one waits any more
                    return
            else:
                items.append((tracker, fut))

    def close(self) -> None:
        """Stop the thread; futures of frames still held by libzmq complete now."""
        self._stopped = True
        self._wake.set()
        while self._items:
            _resolve(self._items.popleft()[1])


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _lost(exc: zmq.ZMQError, what: str) -> ClosedError | PeerLostError:
    """The rlinf error for a ZeroMQ error met while doing ``what`` (raise it ``from
    exc``): our context terminated (we closed) or our socket gone is a
    :class:`ClosedError`, anything else a :class:`PeerLostError`."""
    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
        return ClosedError(f"{what}: closed ({exc})")
    return PeerLostError(f"{what} failed: {exc}")


class ZmqLink(Link):
    """A DEALER connected to one peer (the :class:`~.base.Link` contract); see the
    module docstring for buffer lifetimes.

    :meth:`try_send` raises :class:`~.base.WouldBlock` at the high-water mark (4096
    frame sets queued); :meth:`wait_writable` waits on the socket's descriptor, and
    :meth:`released` on a helper thread shared by the transport's links.
    """

    kind = "zmq"

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, endpoint: str,
                 watcher: ReleaseWatcher) -> None:
        self.endpoint = endpoint
        self._loop = loop
        self._sock = sock
        self._watcher = watcher
        self._writable: asyncio.Future | None = None
        self._closed: BaseException | None = None

    def __repr__(self) -> str:
        return f"<ZmqLink {self.endpoint}{' closed' if self._closed else ''}>"

    def try_send(self, frames: Sequence[Any], *, track: bool = False) -> zmq.MessageTracker | None:
        """Queue ``frames`` as one multipart message without blocking (see
        :meth:`.base.Link.try_send`).

        With ``track``, frames of 64 KiB and more are sent zero-copy: keep them
        unchanged until :meth:`released` returns for the returned tracker.

        Raises:
            WouldBlock: the high-water mark is reached; wait with :meth:`wait_writable`.
            ClosedError / PeerLostError: the link is closed or broke.
        """
        if self._closed is not None:
            raise self._closed
        sock = self._sock
        try:
            if track and any(_nbytes(f) >= _COPY_THRESHOLD for f in frames):
                return sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
            # Copied frames, part by part (a multipart message is atomic: only its first
            # part can meet the high-water mark).
            last = len(frames) - 1
            for i in range(last):
                _send(sock, frames[i], _SNDMORE_NOBLOCK)
            _send(sock, frames[last], _NOBLOCK)
            return None
        except zmq.Again as exc:
            raise WouldBlock(f"link to {self.endpoint} is full") from exc
        except zmq.ZMQError as exc:
            raise _lost(exc, f"send to {self.endpoint}") from exc

    async def wait_writable(self) -> None:
        """Wait until the socket accepts another message (see :meth:`.base.Link.wait_writable`)."""
        if self._closed is not None:
            raise self._closed
        try:
            if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                return
        except zmq.ZMQError as exc:
            raise _lost(exc, f"link to {self.endpoint}") from exc
        if self._writable is None or self._writable.done():
            self._writable = self._loop.create_future()
            self._loop.add_reader(self._sock.FD, self._check_writable)
            self._poll_writable()
        try:
            await asyncio.shield(self._writable)
        finally:
            if self._writable is not None and self._writable.done() and not self._sock.closed:
                try:
                    self._loop.remove_reader(self._sock.FD)
                except (ValueError, OSError, RuntimeError):
                    pass

    def _poll_writable(self) -> None:
        # Edge-triggered ZeroMQ FDs can miss a wake-up: re-check while waiting.
        if self._writable is not None and not self._writable.done():
            self._check_writable()
            self._loop.call_later(0.02, self._poll_writable)

    def _check_writable(self) -> None:
        fut = self._writable
        if fut is None or fut.done() or self._sock.closed:
            return
        try:
            writable = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT
        except zmq.ZMQError as exc:
            error = _lost(exc, f"link to {self.endpoint}")
            error.__cause__ = exc
            fut.set_exception(error)
            return
        if writable:
            fut.set_result(None)

    async def released(self, tracker: zmq.MessageTracker | None) -> None:
        """Wait until libzmq released the zero-copy frames of ``tracker`` (also when
        the link closes: then they are dropped)."""
        if tracker is None or tracker.done:
            return
        await self._watcher.watch(tracker)

    def close(self, exc: BaseException | None = None) -> None:
        """Close now (linger 0); waiters fail with ``exc`` (default ``ClosedError``)."""
        self.close_gracefully(0, exc)

    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> None:
        """Close, letting already queued frames go out for up to ``linger_ms``: libzmq's
        I/O thread sends them until the context terminates (so this returns None)."""
        if self._closed is None:
            self._closed = exc or ClosedError(f"link to {self.endpoint} is closed")
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(self._closed)
            self._writable.exception()
        if not self._sock.closed:
            try:
                self._loop.remove_reader(self._sock.FD)
            except (ValueError, OSError, RuntimeError):
                pass
            self._sock.close(linger_ms)


class SocketSecurity(Protocol):
    """What :class:`ZmqTransport` needs of the cluster's keys (in rlinf:
    :class:`rlinf.control.security.ClusterKeys`): set a socket's authentication up."""

    def secure_server(self, sock: zmq.Socket, *, encrypt: bool) -> None:
        """Make ``sock`` (a ROUTER about to bind) accept only the cluster's peers;
        ``encrypt``: CURVE, else PLAIN authentication only."""

    def secure_client(self, sock: zmq.Socket, *, encrypt: bool) -> None:
        """Make ``sock`` (a DEALER about to connect) present the cluster's credentials."""


class ZmqTransport(Transport):
    """Factory for ZeroMQ listeners and links sharing one context and one key set.

    Args:
        context: the process's (communicator's) ZeroMQ context.
        keys: sets the sockets' authentication up (the cluster's derived keys).
        tcp_host: interface to bind the TCP listener on (``None``: no TCP listener).
        advertise_host: address peers should dial for TCP (default ``tcp_host``).
        ipc: bind an ``ipc://`` listener too.
        encrypt_tcp: CURVE-encrypt TCP traffic (else PLAIN authentication only).
    """

    name = "zmq"

    def __init__(self, context: zmq.Context, keys: SocketSecurity, *, tcp_host: str | None = "127.0.0.1",
                 advertise_host: str | None = None, ipc: bool = True, encrypt_tcp: bool = True) -> None:
        self._context = context
        self._keys = keys
        self._tcp_host = tcp_host
        self._advertise = advertise_host or tcp_host
        self._ipc = ipc
        self._encrypt_tcp = encrypt_tcp
        self._watcher: ReleaseWatcher | None = None

    @classmethod
    def available(cls) -> bool:
        return True

    def _router(self, sockets: list[zmq.Socket], encrypt: bool) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sockets.append(sock)      # closed by listen() if anything below fails
        sock.linger = 0
        sock.rcvhwm = _RCVHWM
        sock.rcvbuf = _SOCKET_BUFFER
        # A peer that reconnects (its link dropped by the network, the old connection not
        # yet timed out here) presents the same identity: the new connection takes it
        # over. Without this the ROUTER refuses the new one and drops every frame set
        # it brings while the stale one lingers (issue 23, finding 4).
        sock.router_handover = 1
        self._keys.secure_server(sock, encrypt=encrypt)
        return sock

    async def listen(self) -> ZmqListener:
        """Bind the ``ipc://`` and/or ``tcp://`` listeners.

        Raises:
            TransportUnavailableError: a socket cannot be made or bound here.
        """
        loop = asyncio.get_running_loop()
        sockets, endpoints, ipc_dir = [], {}, None
        try:
            if self._ipc:
                ipc_dir = make_ipc_dir()
                self._router(sockets, encrypt=False).bind(f"ipc://{ipc_dir}/d")
                endpoints["ipc"] = f"ipc://{ipc_dir}/d"
            if self._tcp_host:
                sock = self._router(sockets, encrypt=self._encrypt_tcp)
                sock.bind(f"tcp://{self._tcp_host}:0")
                port = sock.last_endpoint.decode().rsplit(":", 1)[1]
                endpoints["tcp"] = f"tcp://{self._advertise}:{port}"
        except (zmq.ZMQError, OSError) as exc:
            for sock in sockets:
                sock.close(0)
            if ipc_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            raise TransportUnavailableError(f"cannot bind data sockets: {exc}") from exc
        return ZmqListener(loop, sockets, endpoints, ipc_dir)

    async def connect(self, endpoint: str, *, identity: bytes) -> ZmqLink:
        return self.connect_now(endpoint, identity=identity)

    def connect_now(self, endpoint: str, *, identity: bytes) -> ZmqLink:
        """Synchronous :meth:`connect` (ZeroMQ connects in the background anyway).

        Raises:
            PeerLostError: ``endpoint`` cannot be connected to (a bad address).
            ClosedError: the context was terminated.
        """
        try:
            sock = self._context.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise _lost(exc, f"connect to {endpoint}") from exc
        try:
            sock.linger = 0
            sock.sndhwm = _SNDHWM
            sock.sndbuf = _SOCKET_BUFFER
            sock.routing_id = identity
            sock.immediate = False
            self._keys.secure_client(sock, encrypt=endpoint.startswith("tcp://") and self._encrypt_tcp)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise _lost(exc, f"connect to {endpoint}") from exc
        if self._watcher is None:
            self._watcher = ReleaseWatcher(asyncio.get_running_loop())
        return ZmqLink(asyncio.get_running_loop(), sock, endpoint, self._watcher)

    def close(self) -> None:
        """Stop the release watcher (after every link is closed)."""
        if self._watcher is not None:
            self._watcher.close()
