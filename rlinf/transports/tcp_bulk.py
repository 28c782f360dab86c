"""Bulk TCP: large frame sets between nodes over a plain TCP stream, read straight into
recycled memory.

Why: ZeroMQ receives every frame into memory it allocates for that message, so a
128 MiB frame faults in 32k fresh pages on the receiver, and a buffer cut into 16 MiB
frames is joined afterwards (one more copy). A stream read with ``recv_into`` into
memory that is already faulted in (:class:`~rlinf.transports.shm.Recycler`) pays one
kernel copy and nothing else: on this project's 2-vCPU machines 128 MiB crosses
loopback in ~32 ms this way against ~160 ms as one raw pyzmq frame (docs/benchmarks.md).

Security: the stream is authenticated both ways by an HMAC-SHA256 challenge with a key
derived from the cluster token, bound to both ends' fresh nonces and to the sender's
identity; a connection that fails it is closed before any frame is read. When either
end asks for encryption (``RLINF_TCP_ENCRYPTION``, on by default, as for ZeroMQ's CURVE
links), every record after the handshake is sealed with AEGIS-256 (or AES-256-GCM, or
ChaCha20-Poly1305: the first both ends offer) under per-connection, per-direction keys
derived from the same handshake (:mod:`._aead`: libsodium, the one pyzmq bundles): frame tables and headers as
one record, payloads in records of at most 1 MiB read into their destination and opened
in place, and each acknowledgement as an empty record. Without encryption the stream
is authenticated at connection time only, like the PLAIN ZeroMQ links.

Handshake: the client sends a magic, its nonce, whether it encrypts, the ciphers it
offers and its identity; the server answers with its nonce, whether it encrypts, its
ciphers and a MAC over all of it proving
it holds the key; the client answers with its own MAC; the server confirms with one
byte. Stream, after the handshake, per frame set (unencrypted)::

    u32 nframes | u64 size * nframes | frame 0 (the header) | frame 1 | ...

(encrypted: ``u32 n | sealed(table + header) | tag``, then each frame as sealed records
with their tags), and the receiver answers each frame set from the event loop once its handler ran (one
byte, or an empty sealed record). :meth:`BulkLink.send` returns after that byte, so a frame set that the
caller sends later on another transport cannot overtake this one.

Threads: sockets are blocking; each accepted connection has a reader thread and each
link sends from a thread of its own, so the kernel copies run without the GIL and the
event loop never waits on a socket (it only writes the acknowledgements, a few bytes
that always fit the socket's buffer).

Buffer lifetime: a tracked :meth:`BulkLink.try_send` reads the buffers in place, and
:meth:`BulkLink.released` (so :meth:`BulkLink.send`) returns once the receiver has the
bytes: then the caller may reuse them. An untracked one copies them first. Received frames (after the header) are writable views of
recycled private memory, reused once nothing references them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import AuthenticationError, ClosedError, PeerLostError, TransportUnavailableError, WouldBlock
from . import _aead, _agree
from ._proof import MAC as _MAC, NONCE as _NONCE, mac as _mac, nonce as _new_nonce, same as _same
from .base import Inbox, Link, Listener, Received, Transport
from .descriptors import MAX_FRAMES, MAX_HEADER, max_frame_set
from .shm import Recycler

__all__ = ["BulkTransport", "BulkLink", "BulkListener", "SCHEME"]

log = logging.getLogger("rlinf.transports.tcp_bulk")

#: The endpoint key a worker advertises this listener under.
SCHEME = "bulk"
_MAGIC = b"RLINFBK2"
_MAX_IDENTITY = 1024
#: The header and every payload frame the wire format allows (a large message: one per buffer).
_MAX_FRAMES = MAX_FRAMES + 1
_MAX_FRAME = 1 << 40
_ACK = b"\x01"
_EMPTY = memoryview(b"")
_RECORD = 1 << 20
_SOCKET_BUFFER = 4 << 20
_HANDSHAKE_TIMEOUT = 10.0
#: Connections in their handshake at once; more are closed as they come.
_MAX_HANDSHAKES = 64
#: ``accept`` errors that pass (descriptors or memory short for a moment), and the pause.
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}
_ACCEPT_BACKOFF = 0.1


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
        raise ValueError(f"a TCP endpoint is tcp://host:port, got {endpoint!r}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a TCP endpoint is tcp://host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


class _Stream:
    """One end of a bulk connection after the handshake: frame sets and acknowledgements,
    sealed when ``sealers`` (``(outgoing, incoming)``) are given."""

    def __init__(self, sock: socket.socket, sealers: tuple[_aead.Sealer, _aead.Sealer] | None) -> None:
        self.sock = sock
        self.out, self.into = sealers or (None, None)
        self._scratch: memoryview | None = None

    @property
    def encrypted(self) -> bool:
        return self.out is not None

    def send_frames(self, header: bytes, views: Sequence[memoryview]) -> None:
        sizes = [len(header), *(v.nbytes for v in views)]
        table = struct.pack(f"!I{len(sizes)}Q", len(sizes), *sizes)
        if self.out is None:
            self.sock.sendall(table + header)
            for v in views:
                if v.nbytes:
                    self.sock.sendall(v)
            return
        head = memoryview(bytearray(table + header))
        tag = self.out.seal(head, head)
        self.sock.sendall(struct.pack("!I", head.nbytes) + head + tag)
        if self._scratch is None and len(sizes) > 1:
            self._scratch = memoryview(bytearray(_RECORD))
        for v in views:
            for start in range(0, v.nbytes, _RECORD):
                piece = v[start:start + _RECORD]
                out = self._scratch[:piece.nbytes]
                tag = self.out.seal(piece, out)
                self.sock.sendall(out)
                self.sock.sendall(tag)

    def read_frames(self, recycler: Recycler) -> tuple[bytes, list[memoryview]] | None:
        """``(header, frames)``, or None at a clean end of stream. Sizes are checked
        before anything is allocated."""
        first = bytearray(4)
        view, got = memoryview(first), 0
        while got < 4:
            k = self.sock.recv_into(view[got:])
            if not k:
                if got:
                    raise ConnectionError("connection closed inside a frame set")
                return None
            got += k
        (n,) = struct.unpack("!I", first)
        if self.into is None:
            count = n
            if not 1 <= count <= _MAX_FRAMES:
                raise ValueError(f"bad bulk frame count {count}")
            sizes = struct.unpack(f"!{count}Q", _recv_exact(self.sock, 8 * count))
            if sizes[0] > MAX_HEADER:
                raise ValueError("bulk header too large")
            header = _recv_exact(self.sock, sizes[0])
        else:
            if not 12 <= n <= 4 + 8 * _MAX_FRAMES + MAX_HEADER:
                raise ValueError(f"bad sealed bulk table of {n} bytes")
            head = memoryview(bytearray(_recv_exact(self.sock, n)))
            self.into.open(head, _recv_exact(self.sock, self.into.tag_bytes))
            (count,) = struct.unpack_from("!I", head)
            if not 1 <= count <= _MAX_FRAMES or n < 4 + 8 * count:
                raise ValueError(f"bad bulk frame count {count}")
            sizes = struct.unpack_from(f"!{count}Q", head, 4)
            if 4 + 8 * count + sizes[0] != n:
                raise ValueError("bulk table does not match its record")
            header = bytes(head[4 + 8 * count:])
        if any(k > _MAX_FRAME for k in sizes):
            raise ValueError("bulk frame too large")
        total = 4 + 8 * count + sum(sizes)
        if total > max_frame_set():
            raise ValueError(f"a bulk frame set of {total} bytes is more than this machine can hold")
        frames = []
        for k in sizes[1:]:
            try:
                buf = memoryview(recycler.take(k)) if k else memoryview(bytearray(0))
            except MemoryError:
                raise ValueError(f"no memory for a bulk frame of {k} bytes") from None
            if self.into is None:
                _recv_into(self.sock, buf)
            else:
                for start in range(0, k, _RECORD):
                    piece = buf[start:start + _RECORD]
                    _recv_into(self.sock, piece)
                    self.into.open(piece, _recv_exact(self.sock, self.into.tag_bytes))
            frames.append(buf)
        return header, frames

    def send_ack(self) -> None:
        self.sock.sendall(_ACK if self.out is None else self.out.seal(_EMPTY, _EMPTY))

    def read_ack(self) -> None:
        if self.into is None:
            if _recv_exact(self.sock, 1) != _ACK:
                raise ConnectionError("bad acknowledgement")
        else:
            self.into.open(_EMPTY, _recv_exact(self.sock, self.into.tag_bytes))


def _stream(sock: socket.socket, key: bytes, client: tuple[bytes, bytes], server: tuple[bytes, bytes],
            identity: bytes, *, outgoing: str) -> _Stream:
    """The stream both ends agreed on (:func:`._agree.agree`).

    Raises:
        PermissionError: encryption is asked for and the two ends share no cipher.
    """
    return _Stream(sock, _agree.agree(key, client, server, identity, outgoing=outgoing))


class _Deadline:
    """Shuts ``conn`` down (its reader then fails) unless :meth:`met` is called within
    ``seconds``; exactly one of the two wins."""

    def __init__(self, conn: socket.socket, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._state: str | None = None
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._state is None:
                self._state = "expired"
                try:
                    self._conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def met(self) -> bool:
        """Stop the clock; whether it had not run out."""
        with self._lock:
            if self._state is None:
                self._state = "met"
        self._timer.cancel()
        return self._state == "met"


class BulkListener(Listener):
    """Accepts authenticated bulk connections and delivers their frame sets on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, endpoint: str,
                 key: bytes, recycler: Recycler, encrypt: bool) -> None:
        self.endpoints = {SCHEME: endpoint}
        self._encrypt = encrypt
        self._loop = loop
        self._sock = sock
        self._key = key
        self._recycler = recycler
        self._inbox = Inbox(loop)
        self._conns: set[socket.socket] = set()
        self._handshaking = 0      # connections in their handshake now
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0
        threading.Thread(target=self._accept, name="rlinf-bulk-accept", daemon=True).start()

    def __repr__(self) -> str:
        return f"<BulkListener {self.endpoints[SCHEME]} connections={len(self._conns)}>"

    def set_handler(self, handler: Callable[[Received], None]) -> None:
        self._inbox.handler = handler

    async def recv(self) -> Received:
        """Next frame set, for callers that did not set a handler (tests, tools).

        Raises:
            ClosedError: the listener is closed and nothing is left to read.
        """
        return await self._inbox.recv()

    def _accept(self) -> None:
        """Accept connections until closed. Running out of descriptors (anyone who can
        connect can cause it) or memory pauses accepting a moment; it never ends it.
        At most :data:`_MAX_HANDSHAKES` connections may be in their handshake at once:
        the others are closed at once."""
        warned = False
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed or exc.errno not in _TRANSIENT:
                    return      # closed
                if not warned:
                    log.warning("rlinf: bulk listener cannot accept now (%s); retrying", exc)
                    warned = True
                time.sleep(_ACCEPT_BACKOFF)
                continue
            warned = False
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if self._handshaking >= _MAX_HANDSHAKES:
                    self.rejected += 1
                    conn.close()
                    continue
                self._handshaking += 1
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="rlinf-bulk-read", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> tuple[bytes, _Stream]:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        hello = _recv_exact(conn, len(_MAGIC) + _NONCE + 4)
        if hello[:len(_MAGIC)] != _MAGIC:
            raise PermissionError("not an rlinf bulk client")
        client_nonce = hello[len(_MAGIC):len(_MAGIC) + _NONCE]
        client_terms, (n,) = hello[-4:-2], struct.unpack("!H", hello[-2:])
        if n > _MAX_IDENTITY or client_terms[0] > 1:
            raise PermissionError("malformed hello")
        identity = _recv_exact(conn, n)
        nonce, terms = _new_nonce(), _agree.terms(self._encrypt)
        conn.sendall(nonce + terms + _mac(self._key, b"s", client_nonce, client_terms, nonce, terms, identity))
        proof = _recv_exact(conn, _MAC)
        if not _same(proof, _mac(self._key, b"c", nonce, terms, client_nonce, client_terms, identity)):
            raise PermissionError("the client does not hold the cluster token")
        stream = _stream(conn, self._key, (client_nonce, client_terms), (nonce, terms), identity, outgoing="s2c")
        conn.sendall(_ACK)
        conn.settimeout(None)
        return identity, stream

    def _serve(self, conn: socket.socket) -> None:
        try:
            _tune(conn)
            # the whole handshake, not each read, within the timeout: a client trickling
            # bytes would otherwise hold its place (one of _MAX_HANDSHAKES) for ever
            deadline = _Deadline(conn, _HANDSHAKE_TIMEOUT)
            try:
                identity, stream = self._handshake(conn)
                if not deadline.met():
                    raise PermissionError(f"no handshake within {_HANDSHAKE_TIMEOUT} s")
            except (OSError, PermissionError, struct.error) as exc:
                self.rejected += 1
                log.warning("rlinf: rejected a bulk connection: %s", exc)
                return
            finally:
                deadline.met()
                with self._lock:
                    self._handshaking -= 1
            while not self._closed:
                got = stream.read_frames(self._recycler)
                if got is None:
                    return
                try:
                    self._loop.call_soon_threadsafe(self._deliver, Received(identity, *got), stream)
                except RuntimeError:    # the loop is closed
                    return
        except (OSError, ValueError) as exc:   # AuthenticationFailed is a ValueError
            if not self._closed:
                log.warning("rlinf: bulk connection dropped: %r", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _deliver(self, received: Received, stream: _Stream) -> None:
        """Hand a frame set over, then acknowledge it from the loop thread: before anyone
        can see the message (so a receiver that exits right after reading it has already
        answered) and after it is queued (so nothing the sender sends later, on any
        transport, is handled before it). The sender waits for each acknowledgement
        before sending more on this stream, so this small write never blocks."""
        try:
            self._inbox.deliver(received)
        finally:
            try:
                stream.send_ack()
            except OSError as exc:
                log.debug("rlinf: bulk acknowledgement not sent: %r", exc)

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
        self._inbox.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class BulkLink(Link):
    """A connection to one peer's :class:`BulkListener` (the :class:`~.base.Link`
    contract): one frame set at a time, sent from a thread of its own.

    :meth:`try_send` starts sending and returns a tracker that :meth:`released`
    resolves once the receiver acknowledged the frame set; until then further frame
    sets raise :class:`~.base.WouldBlock` (:meth:`wait_writable` waits for the
    acknowledgement). A send that fails closes the link: :meth:`released` raises
    :class:`~rlinf.errors.PeerLostError` (:class:`~rlinf.errors.ClosedError` when we
    closed it meanwhile), and later calls :class:`~rlinf.errors.ClosedError`.
    """

    kind = "bulk"

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: _Stream, endpoint: str) -> None:
        self.endpoint = endpoint
        self._loop = loop
        self._stream = stream
        self._sock = stream.sock
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlinf-bulk-send")
        self._in_flight: asyncio.Future | None = None
        self._closing: asyncio.Task | None = None
        self._closed: BaseException | None = None    # why new sends are refused
        self._shut = False                           # the socket is shut down

    def __repr__(self) -> str:
        return f"<BulkLink {self.endpoint}{' closed' if self._closed else ''}>"

    @property
    def encrypted(self) -> bool:
        return self._stream.encrypted

    def try_send(self, frames: Sequence[Any], *, track: bool = False) -> asyncio.Future | None:
        """Start sending ``frames`` (see :meth:`.base.Link.try_send`).

        Buffer lifetime: with ``track`` the buffers are read in place until the
        receiver acknowledged them (the returned tracker); without, they are copied
        first and None is returned.

        Raises:
            WouldBlock: a frame set is still in flight; wait with :meth:`wait_writable`.
            ClosedError / PeerLostError: the link is closed or broke.
        """
        if self._closed is not None:
            raise self._closed
        if self._in_flight is not None:
            raise WouldBlock(f"bulk link to {self.endpoint} is busy")
        views = []
        for b in frames[1:]:
            v = b if type(b) is memoryview else memoryview(b)
            v = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            views.append(v if track else memoryview(bytes(v)))
        sent = asyncio.wrap_future(self._executor.submit(self._send, bytes(frames[0]), views), loop=self._loop)
        self._in_flight = sent
        sent.add_done_callback(self._sent)
        return sent if track else None

    def _send(self, header: bytes, views: list[memoryview]) -> None:
        """The send thread: the frame set, then the receiver's acknowledgement."""
        try:
            self._stream.send_frames(header, views)
            self._stream.read_ack()
        except (OSError, ConnectionError, _aead.AuthenticationFailed) as exc:
            if self._shut:
                raise ClosedError(f"bulk link to {self.endpoint} is closed") from None
            raise PeerLostError(f"bulk connection to {self.endpoint} broke: {exc}") from exc

    def _sent(self, sent: asyncio.Future) -> None:
        self._in_flight = None
        if sent.cancelled():
            return
        if sent.exception() is not None:   # retrieved here; released() raises it to its caller
            self.close()                   # later calls: ClosedError

    async def wait_writable(self) -> None:
        """Wait until the frame set in flight was acknowledged (or the link closed)."""
        if self._in_flight is not None and self._closed is None:
            await asyncio.wait([self._in_flight])
        if self._closed is not None:
            raise self._closed

    async def released(self, tracker: asyncio.Future | None) -> None:
        """Wait until the receiver acknowledged the frame set of ``tracker``.

        Raises:
            PeerLostError: the connection broke before it did.
            ClosedError: we closed the link before it did.
        """
        if tracker is not None:
            await asyncio.shield(tracker)

    def close(self, exc: BaseException | None = None) -> None:
        """Close now: a frame set in flight fails (:meth:`released` raises)."""
        if self._closed is None:
            self._closed = exc or ClosedError(f"bulk link to {self.endpoint} is closed")
        if self._shut:
            return
        self._shut = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._executor.shutdown(wait=False)

    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> asyncio.Task | None:
        """Refuse new sends now; close once the frame set in flight was acknowledged,
        or after ``linger_ms``. Returns a task done once closed (None: closed at once)."""
        if self._closed is None:
            self._closed = exc or ClosedError(f"bulk link to {self.endpoint} is closed")
        if self._in_flight is None:
            self.close()
            return None
        if self._closing is None:
            self._closing = self._loop.create_task(self._close_after(self._in_flight, linger_ms))
        return self._closing

    async def _close_after(self, in_flight: asyncio.Future, linger_ms: int) -> None:
        try:
            await asyncio.wait([in_flight], timeout=max(0, linger_ms) / 1000)
        finally:
            self.close()


class BulkTransport(Transport):
    """Bulk TCP listener and links (see the module docstring).

    Args:
        key: the cluster's bulk key (:attr:`rlinf.control.security.ClusterKeys.bulk_key`).
        host: interface to listen on.
        advertise_host: address peers dial (default ``host``).
        recycler: memory received frames are read into (a new one by default).
        encrypt: seal this end's connections (either end asking is enough).

    Raises:
        TransportUnavailableError: encryption is asked for and no libsodium loads.
    """

    name = "bulk"

    def __init__(self, key: bytes, *, host: str = "127.0.0.1", advertise_host: str | None = None,
                 recycler: Recycler | None = None, encrypt: bool = True) -> None:
        if encrypt and not _aead.available():
            raise TransportUnavailableError("bulk TCP encryption needs libsodium (bundled with pyzmq's wheels)")
        self._encrypt = encrypt
        self._key = key
        self._host = host
        self._advertise = advertise_host or host
        self._recycler = recycler if recycler is not None else Recycler()

    @classmethod
    def available(cls) -> bool:
        return True

    @property
    def encrypt(self) -> bool:
        return self._encrypt

    async def listen(self) -> BulkListener:
        """Bind and accept bulk connections.

        Raises:
            TransportUnavailableError: no socket can be bound on the host.
        """
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise TransportUnavailableError(f"cannot make a bulk TCP socket: {exc}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, 0))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise TransportUnavailableError(f"cannot listen for bulk TCP on {self._host}: {exc}") from exc
        port = sock.getsockname()[1]
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return BulkListener(asyncio.get_running_loop(), sock, f"tcp://{host}:{port}", self._key, self._recycler,
                            self._encrypt)

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
        stream = await loop.run_in_executor(None, self._dial, host, port, identity)
        return BulkLink(loop, stream, endpoint)

    def _dial(self, host: str, port: int, identity: bytes) -> _Stream:
        try:
            sock = socket.create_connection((host, port), timeout=_HANDSHAKE_TIMEOUT)
        except OSError as exc:
            raise PeerLostError(f"cannot reach bulk endpoint {host}:{port}: {exc}") from exc
        try:
            _tune(sock)
            nonce, terms = _new_nonce(), _agree.terms(self._encrypt)
            sock.sendall(_MAGIC + nonce + terms + struct.pack("!H", len(identity)) + identity)
            reply = _recv_exact(sock, _NONCE + 2 + _MAC)
            server_nonce, server_terms, proof = reply[:_NONCE], reply[_NONCE:_NONCE + 2], reply[_NONCE + 2:]
            expected = _mac(self._key, b"s", nonce, terms, server_nonce, server_terms, identity)
            if not _same(proof, expected):
                raise AuthenticationError(f"bulk endpoint {host}:{port} does not hold the cluster token")
            try:
                stream = _stream(sock, self._key, (nonce, terms), (server_nonce, server_terms), identity,
                                 outgoing="c2s")
            except PermissionError as exc:
                raise TransportUnavailableError(f"bulk endpoint {host}:{port}: {exc}") from None
            sock.sendall(_mac(self._key, b"c", server_nonce, server_terms, nonce, terms, identity))
            if _recv_exact(sock, 1) != _ACK:
                raise ConnectionError("bad handshake acknowledgement")
            sock.settimeout(None)
            return stream
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"bulk handshake with {host}:{port} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
