"""Stream transport: frame sets over a Unix stream socket driven by the event loop.

Why: a ZeroMQ message crosses two I/O threads (the sender's and the receiver's), each
woken through its own mailbox, before the receiving loop sees it. On this project's
2-vCPU machines a 64 B round trip costs ~210 µs through zmq.asyncio and ~32 µs through a
Unix stream socket read and written by uvloop (``docs/benchmarks.md``). Between
processes of one node, rlinf therefore sends its frame sets over such a socket: the
loop writes them straight to the kernel, and the receiving loop parses them as they
arrive. ZeroMQ stays for other nodes and as the fallback.

Security: the socket file lives in a private (``0700``) directory, like the ``ipc://``
ZeroMQ socket, and every connection opens with the HMAC challenge of :mod:`._proof`
bound to this protocol's magic and to the sender's identity: a process without the
cluster key gets nothing delivered. Nothing is encrypted (the bytes never leave the
machine).

Protocol, client to server::

    hello:   magic (8) | nonce (32) | u16 n | identity (n)
    answer:  nonce (32) | MAC("s", magic, client nonce, nonce, identity)     (server)
    proof:   MAC("c", magic, server nonce, client nonce, identity)
    ack:     one byte                                                        (server)
    then per frame set:  u32 count | u64 size * count | frame 0 (the header) | frame 1 | ...

Links are one-way (a peer's replies come over its own link to us), so after the ack
the server only reads. Sizes are checked before anything is allocated (a frame set may
not claim more than this machine's memory); a connection that sends anything malformed,
or a frame set there is no memory for, is closed, and the listener serves its other peers.

Backpressure: a link's write buffer is bounded (:data:`_HIGH_WATER`); past it,
:meth:`StreamLink.try_send` raises :class:`~.base.WouldBlock` until the kernel took
enough (:meth:`StreamLink.wait_writable`). Nothing is dropped.

Buffer lifetime: :meth:`StreamLink.try_send` hands the frames to the kernel, and what
the kernel does not take at once is copied into the transport's buffer (by us: uvloop
would keep a reference instead), so the caller may reuse its buffers as soon as it
returns, tracked or not (nothing is ever tracked). :meth:`StreamLink.close_gracefully`
returns a future: the loop writes what is buffered until it is done. Received frames are read-only memoryviews
of recycled receive blocks owned by the receiver (the codec aliases them writably,
copying those of 4 KiB or less, as for ZeroMQ frames); a block is reused once no frame
of it is referenced, so a kept frame keeps its whole block (64 KiB) alive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import struct
from typing import Any, Callable, Sequence

from ..errors import AuthenticationError, ClosedError, PeerLostError, TransportUnavailableError
from . import _agree
from ._proof import MAC, NONCE, mac, nonce, same
from ._records import Opener, seal
from .base import Inbox, Link, Listener, Received, Transport, WouldBlock
from .descriptors import MAX_FRAMES, MAX_HEADER, max_frame_set
from .shm import Recycler

__all__ = ["StreamTransport", "StreamLink", "StreamListener", "SCHEME"]

log = logging.getLogger("rlinf.transports.stream")

#: The endpoint key a worker advertises its listener under.
SCHEME = "stream"
_MAGIC = b"RLINFST1"
_MAX_IDENTITY = 1024
#: The header and every payload frame the wire format allows (a large message: one per buffer).
_MAX_FRAMES = MAX_FRAMES + 1
_MAX_FRAME = 1 << 32
_ACK = b"\x01"
_COUNT = struct.Struct("<I")
_HIGH_WATER = 4 << 20
#: Most pieces one ``writev`` takes (Linux's IOV_MAX).
_IOV_MAX = 1024
#: Kernel buffer of each end (the default ~200 KiB makes a fast sender wait on every
#: few frame sets for the reader's next turn).
_SOCKET_BUFFER = 4 << 20
_HANDSHAKE_TIMEOUT = 10.0
#: Connections in their handshake at once; more are closed as they come (a TCP listener
#: is open to the network; many workers may dial one at the same moment at start-up).
_MAX_HANDSHAKES = 1024
#: Frame sets delivered per read before the rest waits for the next loop turn.
_READ_BUDGET = 512
#: Receive blocks: recycled memory the kernel reads into; below glibc's mmap threshold
#: (fresh mappings fault every page in), and the most one read fills.
_BLOCK = 64 << 10
_MIN_READ = 4 << 10


def _path(endpoint: str) -> str:
    if not endpoint.startswith("unix://"):
        raise ValueError(f"a stream endpoint is unix://path, got {endpoint!r}")
    return endpoint[len("unix://"):]


def _pack_table(frames: Sequence[Any]) -> tuple[bytes, list[memoryview]]:
    """The frame table of one frame set, and its frames as byte views."""
    views = [f if type(f) is memoryview and f.format == "B" and f.ndim == 1 else memoryview(f).cast("B")
             for f in frames]
    count = len(views)
    return struct.pack(f"<I{count}Q", count, *(v.nbytes for v in views)), views


def _unsent(pieces: Sequence[Any], sent: int) -> list:
    """What is left of ``pieces`` (bytes and byte views) once ``sent`` bytes went out."""
    for i, piece in enumerate(pieces):
        n = len(piece) if type(piece) is bytes else piece.nbytes
        if sent < n:
            return [memoryview(piece)[sent:] if sent else piece, *pieces[i + 1:]]
        sent -= n
    return []


def _tune(transport: asyncio.BaseTransport, option: int) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        except OSError:
            pass


class _Server(asyncio.BufferedProtocol):
    """One accepted connection: the handshake, then frame sets into the inbox.

    The kernel reads straight into a block of recycled memory (:data:`_BLOCK` bytes, or
    one frame set's size when larger); every complete frame set in it is delivered as
    read-only views of the block, and the block is reused once none of them is
    referenced. An incomplete frame set at the end moves to the next block (one copy
    of that tail, never of the whole stream).
    """

    def __init__(self, listener: StreamListener) -> None:
        self._listener = listener
        self._block = memoryview(b"")
        self._start = self._end = 0         # unparsed bytes: self._block[start:end]
        self._need = 0                      # bytes the frame set at ``start`` needs to be parsed on (0: unknown)
        self._transport: asyncio.Transport | None = None
        self._identity: bytes | None = None       # set once the client proved itself
        self._hello: tuple[bytes, ...] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._opener: Opener | None = None        # set once a sealed stream is agreed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport       # type: ignore[assignment]
        _tune(transport, socket.SO_RCVBUF)
        listener = self._listener
        listener._conns.add(self)
        if sum(c._timer is not None for c in listener._conns) >= _MAX_HANDSHAKES:
            self._reject("too many connections in their handshake")
            return
        self._timer = asyncio.get_running_loop().call_later(_HANDSHAKE_TIMEOUT, self._reject, "handshake timed out")

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._conns.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reject(self, why: str) -> None:
        self._listener.rejected += 1
        log.warning("rlinf: rejected a stream connection: %s", why)
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- reading ---------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._opener is not None:
            return self._opener.buffer()
        # (a frame set's own size was made room for by _frames, where a failure is handled)
        self._make_room(max(self._need, self._end - self._start + _MIN_READ))
        return self._block[self._end:]

    def _make_room(self, want: int) -> None:
        """Let the block hold ``want`` bytes from the unparsed start: if it has no room,
        a new block, with the unparsed tail."""
        block, start, end = self._block, self._start, self._end
        if start + want > len(block):
            fresh = memoryview(self._listener._recycler.take(max(_BLOCK, want)))
            fresh[:end - start] = block[start:end]
            self._block, self._start, self._end = fresh, 0, end - start

    def buffer_updated(self, nbytes: int) -> None:
        if self._opener is not None:
            self._deliver(nbytes)
            return
        self._end += nbytes
        if self._identity is None and not self._handshake():
            return
        if self._opener is not None:        # what came after the proof is sealed (a client sends
            rest, self._end = self._block[self._start:self._end], self._start   # nothing before the ack)
            if len(rest) > len(self._opener.buffer()):
                self._reject("a flood after the handshake")
                return
            self._opener.buffer()[:len(rest)] = rest
            self._deliver(len(rest))
            return
        self._deliver()

    def _room(self, n: int) -> memoryview:
        """Where the next ``n`` opened bytes go: after the unparsed ones."""
        self._make_room(self._end - self._start + n)
        self._end += n
        return self._block[self._end - n:self._end]

    def _deliver(self, sealed: int | None = None) -> None:
        """:meth:`_frames` (on a sealed stream: after ``sealed`` more raw bytes came, for
        each record they complete), closing the connection on a malformed frame set or
        record."""
        try:
            if sealed is None or self._opener is None:
                self._frames()
                return
            self._opener.arrived(sealed)
            while not self._paused and self._opener.open_next(self._room):
                self._frames()
        except (ValueError, MemoryError) as exc:
            self._need = 0            # (nothing more is read for it)
            self._listener.dropped += 1
            log.warning("rlinf: closed a stream connection from %r: %s", self._identity, exc)
            self.close()

    def _take(self, n: int) -> bytes | None:
        """The next ``n`` unparsed bytes (handshake), or None until they arrived."""
        if self._end - self._start < n:
            return None
        out = bytes(self._block[self._start:self._start + n])
        self._start += n
        return out

    def _handshake(self) -> bool:
        """Advance the handshake with what arrived; True once the client is proven."""
        listener = self._listener
        key, magic, terms = listener._key, listener._magic, listener._terms
        head = len(magic) + NONCE + len(terms) + 2
        if self._hello is None:
            if self._end - self._start < head:
                return False
            (n,) = struct.unpack_from("<H", self._block, self._start + head - 2)
            if bytes(self._block[self._start:self._start + len(magic)]) != magic or n > _MAX_IDENTITY:
                self._reject("not an rlinf stream client")
                return False
            hello = self._take(head + n)
            if hello is None:
                return False
            client_nonce = hello[len(magic):len(magic) + NONCE]
            client_terms, identity = hello[len(magic) + NONCE:head - 2], hello[head:]
            server_nonce = nonce()
            self._hello = (client_nonce, client_terms, server_nonce, identity)
            self._transport.write(server_nonce + terms + mac(key, b"s", magic, client_nonce, client_terms,
                                                             server_nonce, terms, identity))
        proof = self._take(MAC)
        if proof is None:
            return False
        client_nonce, client_terms, server_nonce, identity = self._hello
        if not same(proof, mac(key, b"c", magic, server_nonce, terms, client_nonce, client_terms, identity)):
            self._reject("the client does not hold the cluster token")
            return False
        if terms:
            try:
                sealers = _agree.agree(key, (client_nonce, client_terms), (server_nonce, terms), identity,
                                       outgoing="s2c")
            except PermissionError as exc:
                self._reject(str(exc))
                return False
            self._opener = Opener(sealers[1]) if sealers else None
        self._identity, self._hello = identity, None
        self._timer.cancel()
        self._timer = None
        self._transport.write(_ACK)
        return True

    def _frames(self) -> None:
        """Deliver every complete frame set in the unparsed bytes."""
        block, at, end = self._block, self._start, self._end
        deliver, peer, delivered = self._listener._inbox.deliver, self._identity, 0
        view = block.toreadonly()
        while end - at >= 4:
            (count,) = _COUNT.unpack_from(block, at)
            if not 1 <= count <= _MAX_FRAMES:
                raise ValueError(f"bad frame count {count}")
            table = 4 + 8 * count
            if end - at < table:
                self._need = table
                break
            sizes = struct.unpack_from(f"<{count}Q", block, at + 4)
            if sizes[0] > MAX_HEADER or max(sizes) > _MAX_FRAME:
                raise ValueError("frame too large")
            total = table + sum(sizes)
            if end - at < total:
                if total > max_frame_set():
                    raise ValueError(f"a frame set of {total} bytes is more than this machine can hold")
                self._need = total
                break
            offset = at + table + sizes[0]
            header = bytes(block[at + table:offset])
            frames = []
            for n in sizes[1:]:
                frames.append(view[offset:offset + n])
                offset += n
            at += total
            self._need = 0
            deliver(Received(peer, header, frames))
            delivered += 1
            if delivered >= _READ_BUDGET and end - at and not self._paused:
                self._paused = True           # fairness: the rest on the next turn
                self._transport.pause_reading()
                asyncio.get_running_loop().call_soon(self._resume)
                break
        self._start = at
        if self._need:
            try:     # now, not in get_buffer: asyncio has no way to refuse there but a fatal error
                self._make_room(self._need)
            except MemoryError:
                raise ValueError(f"no memory for a frame set of {self._need} bytes") from None

    def _resume(self) -> None:
        self._paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
            self._deliver(0)


class StreamListener(Listener):
    """A Unix stream server in a private directory; see the module docstring.

    (:mod:`.tcp_stream` serves TCP with it: ``directory`` None, its own ``magic``, and
    ``terms`` that may ask for sealing.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: bytes, directory: str | None, recycler: Recycler,
                 *, magic: bytes = _MAGIC, terms: bytes = b"") -> None:
        self.endpoints = {SCHEME: f"unix://{directory}/s"} if directory is not None else {}
        self._magic, self._terms = magic, terms
        self._recycler = recycler
        self._loop = loop
        self._key = key
        self._dir = directory
        self._inbox = Inbox(loop)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Server] = set()
        self.rejected = 0      # connections refused at the handshake
        self.dropped = 0       # connections closed for a malformed frame set

    async def _start(self) -> None:
        self._server = await self._loop.create_unix_server(lambda: _Server(self), _path(self.endpoints[SCHEME]))

    def set_handler(self, handler: Callable[[Received], None]) -> None:
        self._inbox.handler = handler

    async def recv(self) -> Received:
        """Next frame set, for callers that did not set a handler (tests, tools)."""
        return await self._inbox.recv()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._conns):
            conn.close()
        self._inbox.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Client(asyncio.Protocol):
    """The sending end's protocol: the handshake's answers, then flow control."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.buf = bytearray()
        self.got: asyncio.Future = loop.create_future()      # resolved as bytes arrive
        self.link: StreamLink | None = None
        self.lost: BaseException | None = None
        self.closed: asyncio.Future = loop.create_future()   # resolved once the connection is gone

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.got.done():
            self.got.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = PeerLostError(f"stream connection lost: {exc or 'closed by the peer'}")
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.got.done():
            self.got.set_exception(self.lost)
            self.got.exception()
        if self.link is not None:
            self.link._broke(self.lost)

    def pause_writing(self) -> None:
        if self.link is not None:
            self.link._paused = True

    def resume_writing(self) -> None:
        if self.link is not None:
            self.link._resume()

    async def read(self, n: int) -> bytes:
        """The next ``n`` bytes of the handshake."""
        while len(self.buf) < n:
            if self.lost is not None:
                raise self.lost
            self.got = asyncio.get_running_loop().create_future()
            await self.got
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class StreamLink(Link):
    """A connection to one peer's :class:`StreamListener` (the :class:`~.base.Link`
    contract); see the module docstring.

    :meth:`try_send` raises :class:`~.base.WouldBlock` when the write buffer is full;
    :meth:`wait_writable` waits until the transport drained it below its low mark.
    """

    kind = "stream"

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, protocol: _Client,
                 endpoint: str) -> None:
        self.endpoint = endpoint
        self._loop = loop
        self._transport = transport
        self._write = transport.write
        self._protocol = protocol
        self._paused = False
        self._writable: asyncio.Future | None = None
        self._closed: BaseException | None = None
        self._sealer = None           # the outgoing direction's, on a sealed TCP stream
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        protocol.link = self
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        _tune(transport, socket.SO_SNDBUF)

    def __repr__(self) -> str:
        return f"<StreamLink {self.endpoint}{' closed' if self._closed else ''}>"

    def try_send(self, frames: Sequence[Any], *, track: bool = False) -> None:
        """Write ``frames`` as one frame set without blocking; the caller may reuse them
        at once, so nothing is tracked (see :meth:`.base.Link.try_send`).

        Raises:
            WouldBlock: the write buffer is full; wait with :meth:`wait_writable`.
            ClosedError / PeerLostError: the link is closed or broke.
        """
        if self._closed is not None:
            raise self._closed
        if self._paused:
            raise WouldBlock(f"link to {self.endpoint} is full")
        table, views = _pack_table(frames)
        if self._sealer is not None:
            self._write(seal(self._sealer, (table, *views)))
        elif len(views) <= 2 and views[-1].nbytes <= 1 << 16:
            self._write(b"".join((table, *views)))      # one write: one syscall
        else:
            self._write_views([table, *views])
        return None

    def _write_views(self, pieces: list) -> None:
        """Write what the kernel takes now and give the transport a copy of the rest, so
        the caller may reuse its buffers at once. (uvloop's ``write``/``writelines``
        keep a reference to what they could not write instead of copying it, as the
        standard loop does: a caller's later writes would change what the peer gets.)
        Only while nothing is buffered, or the bytes would overtake what is."""
        sent = 0
        if self._fd >= 0 and not self._transport.get_write_buffer_size():
            try:
                sent = os.writev(self._fd, pieces[:_IOV_MAX])
            except OSError:   # full (EAGAIN), or broken: the transport reports it below
                sent = 0
        rest = _unsent(pieces, sent)
        if rest:
            self._write(b"".join(rest))

    async def wait_writable(self) -> None:
        """Wait until the write buffer has room (or the link closes)."""
        while self._paused:
            if self._closed is not None:
                raise self._closed
            if self._writable is None or self._writable.done():
                self._writable = self._loop.create_future()
            await asyncio.shield(self._writable)
        if self._closed is not None:
            raise self._closed

    async def released(self, tracker: None) -> None:
        """Nothing to wait for: written frames were taken or copied by the transport."""

    def _resume(self) -> None:
        self._paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _broke(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(self._closed)
            self._writable.exception()

    def close(self, exc: BaseException | None = None) -> None:
        """Close now, dropping what is still buffered; waiters fail with ``exc``."""
        self._broke(exc or ClosedError(f"link to {self.endpoint} is closed"))
        self._abort()

    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> asyncio.Future:
        """Close once what is buffered is written (the loop keeps writing it, for at most
        ``linger_ms``). Returns a future done once the connection is gone: await it
        before the loop stops, or buffered frames are lost."""
        self._broke(exc or ClosedError(f"link to {self.endpoint} is closed"))
        self._transport.close()
        self._loop.call_later(max(0, linger_ms) / 1000, self._abort)
        return self._protocol.closed

    def _abort(self) -> None:
        # Not once the connection is gone: asyncio's transport, closed gracefully and
        # drained, would fail in abort() (it already let go of its loop).
        if not self._protocol.closed.done():
            self._transport.abort()


class StreamTransport(Transport):
    """Factory for stream listeners and links that share one key.

    Args:
        key: the cluster's 32-byte stream key (``ClusterKeys.bulk_key``).
        recycler: where receive blocks come from (shared with the communicator's other
            receive paths; a new one by default).
    """

    name = "stream"
    _magic = _MAGIC

    def __init__(self, key: bytes, *, recycler: Recycler | None = None) -> None:
        self._key = key
        self._recycler = recycler if recycler is not None else Recycler()

    def _terms(self) -> bytes:
        """This end's handshake terms: none on one node (nothing leaves the machine)."""
        return b""

    @classmethod
    def available(cls) -> bool:
        return hasattr(socket, "AF_UNIX")

    async def listen(self) -> StreamListener:
        from .zeromq import make_ipc_dir

        if not self.available():
            raise TransportUnavailableError("Unix sockets are not available here")
        try:
            directory = make_ipc_dir()
        except OSError as exc:
            raise TransportUnavailableError(f"cannot make a socket directory: {exc}") from exc
        listener = StreamListener(asyncio.get_running_loop(), self._key, directory, self._recycler)
        try:
            await listener._start()
        except OSError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise TransportUnavailableError(f"cannot listen on a Unix socket: {exc}") from exc
        return listener

    async def _open(self, loop: asyncio.AbstractEventLoop, endpoint: str) -> tuple[asyncio.Transport, _Client]:
        """The connection to ``endpoint``, before the handshake (``OSError``/``ValueError``)."""
        return await loop.create_unix_connection(lambda: _Client(loop), _path(endpoint))

    async def connect(self, endpoint: str, *, identity: bytes) -> StreamLink:
        """Connect and authenticate.

        Raises:
            PeerLostError: nothing listens there, or the connection broke.
            AuthenticationError: the listener does not hold the cluster key.
            TransportUnavailableError: encryption is asked for and the ends share no cipher.
        """
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await self._open(loop, endpoint)
        except (OSError, ValueError) as exc:
            raise PeerLostError(f"cannot connect to {endpoint}: {exc}") from exc
        magic, terms = self._magic, self._terms()
        try:
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT):
                client_nonce = nonce()
                transport.write(magic + client_nonce + terms + struct.pack("<H", len(identity)) + identity)
                answer = await protocol.read(NONCE + len(terms) + MAC)
                server_nonce, server_terms, proof = answer[:NONCE], answer[NONCE:-MAC], answer[-MAC:]
                if not same(proof, mac(self._key, b"s", magic, client_nonce, terms, server_nonce, server_terms,
                                       identity)):
                    raise AuthenticationError(f"stream endpoint {endpoint} does not hold the cluster token")
                sealers = None
                if terms:
                    try:
                        sealers = _agree.agree(self._key, (client_nonce, terms), (server_nonce, server_terms),
                                               identity, outgoing="c2s")
                    except PermissionError as exc:
                        raise TransportUnavailableError(f"stream endpoint {endpoint}: {exc}") from None
                transport.write(mac(self._key, b"c", magic, server_nonce, server_terms, client_nonce, terms,
                                    identity))
                if await protocol.read(1) != _ACK:
                    raise PeerLostError(f"bad handshake acknowledgement from {endpoint}")
        except TimeoutError:
            transport.abort()
            raise PeerLostError(f"stream handshake with {endpoint} timed out") from None
        except BaseException:
            transport.abort()
            raise
        link = StreamLink(loop, transport, protocol, endpoint)
        link.kind = self.name         # "tcp_stream" over TCP (what stats count the messages under)
        link._sealer = sealers[0] if sealers else None
        return link
