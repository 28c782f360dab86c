"""Bulk TCP: large frame sets between nodes over a plain TCP stream, read straight into
recycled memory.

Why: ZeroMQ receives every frame into memory it allocates for that message, so a
128 MiB frame faults in 32k fresh pages on the receiver, and a buffer cut into 16 MiB
frames is joined afterwards (one more copy). A stream read with ``recv_into`` into
memory that is already faulted in (:class:`~rlinf.transports.shm.Recycler`) pays one
kernel copy and nothing else: on this project's 2-vCPU machines 128 MiB crosses
loopback in ~32 ms this way against ~160 ms as one raw pyzmq frame (docs/benchmarks.md).

Security: only for links whose ZeroMQ counterpart would not be encrypted
(``RLINF_TCP_ENCRYPTION=0``): the stream is authenticated both ways (an HMAC-SHA256
challenge with a key derived from the cluster token, bound to both nonces and to the
sender's identity) but not encrypted, like the PLAIN ZeroMQ links it stands in for. A
connection that fails the handshake is closed before any frame is read.

Handshake: the client sends a magic, its nonce and its identity; the server answers with
its nonce and a MAC proving it holds the key; the client answers with its own MAC; the
server confirms with one byte. Stream, after the handshake, per frame set::

    u32 nframes | u64 size * nframes | frame 0 (the header) | frame 1 | ...

and the receiver answers each frame set with one byte once its handler ran on the
event loop. :meth:`BulkLink.send` returns after that byte, so a frame set that the
caller sends later on another transport cannot overtake this one.

Threads: sockets are blocking; each accepted connection has a reader thread and each
link sends from a thread of its own, so the kernel copies run without the GIL and the
event loop never waits on a socket.

Buffer lifetime: :meth:`BulkLink.send` returns once the receiver has the bytes, so the
caller may reuse its buffers. Received frames (after the header) are writable views of
recycled private memory, reused once nothing references them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from typing import Any, Callable, Sequence

from ..errors import ClosedError, PeerLostError
from .base import Link, Listener, Received, Transport
from ._shm_pool import Recycler

__all__ = ["BulkTransport", "BulkLink", "BulkListener", "SCHEME"]

log = logging.getLogger("rlinf.transports.tcp_bulk")

#: The endpoint key a worker advertises this listener under.
SCHEME = "bulk"
_MAGIC = b"RLINFBK1"
_NONCE = 32
_MAC = 32
_MAX_IDENTITY = 1024
_MAX_FRAMES = 1 << 16
_MAX_HEADER = 64 << 20
_MAX_FRAME = 1 << 40
_ACK = b"\x01"
_SOCKET_BUFFER = 4 << 20
_HANDSHAKE_TIMEOUT = 10.0


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    _recv_into(sock, memoryview(out))
    return bytes(out)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("connection closed by the peer")
        got += k


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
        except OSError:
            pass


def _parse(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"a bulk endpoint is tcp://host:port, got {endpoint!r}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a bulk endpoint is tcp://host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


class BulkListener(Listener):
    """Accepts authenticated bulk connections and delivers their frame sets on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                 key: bytes, recycler: Recycler) -> None:
        self.endpoints = {SCHEME: endpoint}
        self._loop = loop
        self._sock = sock
        self._key = key
        self._recycler = recycler
        self._handler: Callable[[Received], None] | None = None
        self._queue: collections.deque[Received] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0
        threading.Thread(target=self._accept, name="rlinf-bulk-accept", daemon=True).start()

    def __repr__(self) -> str:
        return f"<BulkListener {self.endpoints[SCHEME]} connections={len(self._conns)}>"

    def set_handler(self, handler: Callable[[Received], None]) -> None:
        self._handler = handler

    async def recv(self) -> Received:
        """Next frame set, for callers that did not set a handler (tests, tools).

        Raises:
            ClosedError: the listener is closed and nothing is left to read.
        """
        while not self._queue:
            if self._closed:
                raise ClosedError("listener is closed")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return      # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="rlinf-bulk-read", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> bytes:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        hello = _recv_exact(conn, len(_MAGIC) + _NONCE + 2)
        if hello[:len(_MAGIC)] != _MAGIC:
            raise PermissionError("not an rlinf bulk client")
        client_nonce = hello[len(_MAGIC):-2]
        (n,) = struct.unpack("!H", hello[-2:])
        if n > _MAX_IDENTITY:
            raise PermissionError("identity too long")
        identity = _recv_exact(conn, n)
        nonce = secrets.token_bytes(_NONCE)
        conn.sendall(nonce + _mac(self._key, b"s", client_nonce, nonce, identity))
        proof = _recv_exact(conn, _MAC)
        if not hmac.compare_digest(proof, _mac(self._key, b"c", nonce, client_nonce, identity)):
            raise PermissionError("the client does not hold the cluster token")
        conn.sendall(_ACK)
        conn.settimeout(None)
        return identity

    def _serve(self, conn: socket.socket) -> None:
        try:
            _tune(conn)
            try:
                identity = self._handshake(conn)
            except (OSError, PermissionError, struct.error) as exc:
                self.rejected += 1
                log.warning("rlinf: rejected a bulk connection: %s", exc)
                return
            while not self._closed:
                received = self._read(conn, identity)
                if received is None:
                    return
                done = threading.Event()
                try:
                    self._loop.call_soon_threadsafe(self._deliver, received, done)
                except RuntimeError:    # the loop is closed
                    return
                while not done.wait(0.5):
                    if self._closed or self._loop.is_closed():
                        return
                conn.sendall(_ACK)
        except (OSError, ValueError) as exc:
            if not self._closed:
                log.debug("rlinf: bulk connection ended: %r", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read(self, conn: socket.socket, identity: bytes) -> Received | None:
        """One frame set, or None at a clean end of stream. Sizes are checked before
        anything is allocated."""
        try:
            first = conn.recv(4, socket.MSG_WAITALL)
        except OSError:
            return None
        if len(first) < 4:
            return None
        (count,) = struct.unpack("!I", first)
        if not 1 <= count <= _MAX_FRAMES:
            raise ValueError(f"bad bulk frame count {count}")
        sizes = struct.unpack(f"!{count}Q", _recv_exact(conn, 8 * count))
        if sizes[0] > _MAX_HEADER or any(n > _MAX_FRAME for n in sizes):
            raise ValueError("bulk frame too large")
        header = _recv_exact(conn, sizes[0])
        frames = []
        for n in sizes[1:]:
            buf = memoryview(self._recycler.take(n)) if n else memoryview(bytearray(0))
            _recv_into(conn, buf)
            frames.append(buf)
        return Received(identity, header, frames)

    def _deliver(self, received: Received, done: threading.Event) -> None:
        try:
            if self._handler is not None:
                self._handler(received)
            else:
                self._queue.append(received)
                self._wake()
        finally:
            done.set()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._wake()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class BulkLink(Link):
    """A connection to one peer's :class:`BulkListener`; one frame set at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str) -> None:
        self.endpoint = endpoint
        self._loop = loop
        self._sock = sock
        self._lock = asyncio.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlinf-bulk-send")
        self._closed = False

    def __repr__(self) -> str:
        return f"<BulkLink {self.endpoint}{' closed' if self._closed else ''}>"

    async def send(self, header: bytes, buffers: Sequence[Any]) -> None:
        async with self._lock:
            if self._closed:
                raise ClosedError("bulk link is closed")
            try:
                await self._loop.run_in_executor(self._executor, self._send, header, buffers)
            except (OSError, ConnectionError) as exc:
                if self._closed:
                    raise ClosedError("bulk link is closed") from None
                self.close()
                raise PeerLostError(f"bulk connection to {self.endpoint} broke: {exc}") from exc

    def _send(self, header: bytes, buffers: Sequence[Any]) -> None:
        views = [b if type(b) is memoryview else memoryview(b) for b in buffers]
        sizes = [len(header), *(v.nbytes for v in views)]
        sock = self._sock
        sock.sendall(struct.pack(f"!I{len(sizes)}Q", len(sizes), *sizes) + header)
        for v in views:
            if v.nbytes:
                sock.sendall(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        if _recv_exact(sock, 1) != _ACK:
            raise ConnectionError("bad acknowledgement")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._executor.shutdown(wait=False)


class BulkTransport(Transport):
    """Bulk TCP listener and links (see the module docstring).

    Args:
        key: the cluster's bulk key (:attr:`rlinf.security.ClusterKeys.bulk_key`).
        host: interface to listen on.
        advertise_host: address peers dial (default ``host``).
        recycler: memory received frames are read into (a new one by default).
    """

    name = "bulk"

    def __init__(self, key: bytes, *, host: str = "127.0.0.1", advertise_host: str | None = None,
                 recycler: Recycler | None = None) -> None:
        self._key = key
        self._host = host
        self._advertise = advertise_host or host
        self._recycler = recycler if recycler is not None else Recycler()

    @classmethod
    def available(cls) -> bool:
        return True

    async def listen(self) -> BulkListener:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, 0))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        port = sock.getsockname()[1]
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return BulkListener(asyncio.get_running_loop(), sock, f"tcp://{host}:{port}", self._key, self._recycler)

    async def connect(self, endpoint: str, *, identity: bytes) -> BulkLink:
        """Connect and authenticate (both ways).

        Raises:
            PeerLostError: the listener cannot be reached or the connection broke.
            AuthenticationError: the listener does not hold the cluster token.
        """
        loop = asyncio.get_running_loop()
        try:
            host, port = _parse(endpoint)
        except ValueError as exc:
            raise PeerLostError(f"cannot connect to {endpoint!r}: {exc}") from None
        sock = await loop.run_in_executor(None, self._dial, host, port, identity)
        return BulkLink(loop, sock, endpoint)

    def _dial(self, host: str, port: int, identity: bytes) -> socket.socket:
        from ..errors import AuthenticationError

        try:
            sock = socket.create_connection((host, port), timeout=_HANDSHAKE_TIMEOUT)
        except OSError as exc:
            raise PeerLostError(f"cannot reach bulk endpoint {host}:{port}: {exc}") from exc
        try:
            _tune(sock)
            nonce = secrets.token_bytes(_NONCE)
            sock.sendall(_MAGIC + nonce + struct.pack("!H", len(identity)) + identity)
            reply = _recv_exact(sock, _NONCE + _MAC)
            server_nonce, proof = reply[:_NONCE], reply[_NONCE:]
            if not hmac.compare_digest(proof, _mac(self._key, b"s", nonce, server_nonce, identity)):
                raise AuthenticationError(f"bulk endpoint {host}:{port} does not hold the cluster token")
            sock.sendall(_mac(self._key, b"c", server_nonce, nonce, identity))
            if _recv_exact(sock, 1) != _ACK:
                raise ConnectionError("bad handshake acknowledgement")
            sock.settimeout(None)
            return sock
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"bulk handshake with {host}:{port} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
