"""The shared-memory transport behind the :mod:`..base` contract (see :mod:`rlinf.transports.shm`).

Framing, its own: a frame set goes over the carrier link as ``[header, descriptor]``
(the slot's buffers) or ``[header, descriptor, *buffers]`` (inline, past the pool's
cap), where ``descriptor`` is the msgpack array ``[reply_to, reader_key, slot_or_nil,
sizes]``: where to send the slot back, the key the receiver is known by, the slot
(:class:`~rlinf.transports.descriptors.SlotRef` in its wire form) and each buffer's size.
The header is the caller's, carried as is.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Awaitable, Callable, Sequence

import msgpack

from ...errors import ClosedError, ProtocolError, RlinfError, TransportUnavailableError, WouldBlock
from ._common import available, DEFAULT_OFFLOAD, SHM_DIR
from ._pool import ShmPool
from ._reader import ShmReader
from ..base import Link, Listener, Received, Tracker, Transport
from ..descriptors import MAX_SLOT, slot_layout, unpack_slot

log = logging.getLogger("rlinf.transports.shm")

_RELEASE = b"rlinf.shm.release"


class ShmLink(Link):
    """Sends frame sets whose buffers travel in a shared-memory slot (the
    :class:`~..base.Link` contract, over a ``carrier`` link that moves the header and
    the slot's descriptor).

    Buffer lifetime: :meth:`try_send` copies the buffers into a slot, so the caller may
    reuse them once it returns; except a tracked send of :attr:`ShmTransport.offload`
    bytes or more, copied in an executor thread: keep its buffers until
    :meth:`released` returned for the tracker it gave (meanwhile later frame sets raise
    :class:`~..base.WouldBlock`, so the order holds). Past the pool's cap the buffers go
    inline on the carrier link, whose rule then applies (its tracker is passed on).
    """

    kind = "shm"

    def __init__(self, transport: ShmTransport, carrier: Link, endpoint: str) -> None:
        self._transport = transport
        self._carrier = carrier
        self.endpoint = endpoint
        self._closed: BaseException | None = None
        self._copying: asyncio.Task | None = None      # the offloaded frame set in flight
        self._closing: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"<ShmLink {self.endpoint}{' closed' if self._closed else ''}>"

    def try_send(self, frames: Sequence[Any], *, track: bool = False) -> Tracker | None:
        if self._closed is not None:
            raise self._closed
        if self._copying is not None:
            raise WouldBlock(f"link to {self.endpoint}: a copy into shared memory is in flight")
        transport, header = self._transport, frames[0]
        views = [b if type(b) is memoryview else memoryview(b) for b in frames[1:]]
        sizes = [v.nbytes for v in views]
        offsets, end = slot_layout(sizes)
        slot = transport.pool.acquire(end, {self.endpoint: 1}) if end else None
        if slot is None:
            control = msgpack.packb([transport.reply_to, self.endpoint, None, sizes])
            return self._carrier.try_send([header, control, *views], track=track)
        if track and end >= transport.offload:
            copying = asyncio.get_running_loop().run_in_executor(None, transport.pool.fill, slot, views, offsets)
            self._copying = asyncio.get_running_loop().create_task(self._hand_over(copying, header, slot, sizes))
            self._copying.add_done_callback(self._handed_over)
            return self._copying
        try:
            transport.pool.fill(slot, views, offsets)
            self._carrier.try_send([header, self._descriptor(slot, sizes)])
        except BaseException:
            transport.pool.cancel(slot)     # never reached the peer: reusable at once
            raise
        return None

    def _descriptor(self, slot, sizes: list[int]) -> bytes:
        return msgpack.packb([self._transport.reply_to, self.endpoint, slot.ref().to_wire(), sizes])

    async def _hand_over(self, copying: asyncio.Future, header: bytes, slot, sizes: list[int]) -> None:
        """Once the slot is filled, hand its descriptor to the carrier (waiting for room)."""
        try:
            await asyncio.shield(copying)     # cancelled, the slot must not be freed mid-copy
            control = self._descriptor(slot, sizes)
            while True:       # not carrier.send(): once the carrier took it, the slot is the reader's
                try:
                    self._carrier.try_send([header, control])
                    return
                except WouldBlock:
                    await self._carrier.wait_writable()
        except BaseException:
            # never reached the peer: reusable once nothing writes into it any more
            pool = self._transport.pool
            if copying.done():
                pool.cancel(slot)
            else:
                copying.add_done_callback(lambda _: pool.cancel(slot))
            raise

    def _handed_over(self, task: asyncio.Task) -> None:
        self._copying = None
        if not task.cancelled():
            task.exception()      # retrieved here; released() raises it to its caller

    async def wait_writable(self) -> None:
        if self._closed is not None:
            raise self._closed
        if self._copying is not None:
            await asyncio.wait([self._copying])
        else:
            await self._carrier.wait_writable()
        if self._closed is not None:
            raise self._closed

    async def released(self, tracker: Tracker | None) -> None:
        """Wait until the buffers of ``tracker`` were copied into the slot and its
        descriptor handed to the carrier (or, sent inline, until the carrier released them).

        Raises:
            ClosedError / PeerLostError: the descriptor never reached the carrier.
        """
        if isinstance(tracker, asyncio.Future):
            await asyncio.wait([tracker])       # our cancellation does not cancel the send
            if tracker.cancelled():             # by close()
                raise self._closed or ClosedError(f"link to {self.endpoint} is closed")
            tracker.result()
        elif tracker is not None:
            await self._carrier.released(tracker)

    def close(self, exc: BaseException | None = None) -> None:
        if self._closed is None:
            self._closed = exc or ClosedError(f"link to {self.endpoint} is closed")
        if self._copying is not None:
            self._copying.cancel()
        self._carrier.close(exc)

    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> Awaitable[None] | None:
        """Refuse new sends now; the frame set being copied still goes out (within
        ``linger_ms``), then the carrier closes gracefully with what is left of it."""
        if self._closed is None:
            self._closed = exc or ClosedError(f"link to {self.endpoint} is closed")
        if self._copying is None:
            return self._carrier.close_gracefully(linger_ms, exc)
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close_after(linger_ms, exc))
        return self._closing

    async def _close_after(self, linger_ms: int, exc: BaseException | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0, linger_ms) / 1000
        copying = self._copying
        if copying is not None:
            await asyncio.wait([copying], timeout=max(0.0, deadline - loop.time()))
            copying.cancel()
        flushed = self._carrier.close_gracefully(int(max(0.0, deadline - loop.time()) * 1000), exc)
        if flushed is not None:
            await flushed


class ShmListener(Listener):
    """Receives what :class:`ShmLink` sends; frames are writable views of the slot.

    Buffer lifetime: a received frame (and anything decoded over it) keeps the slot
    busy until garbage-collected; then the slot goes back to the sender.
    """

    def __init__(self, transport: ShmTransport, carrier: Listener) -> None:
        self._transport = transport
        self._carrier = carrier
        self.endpoints = dict(carrier.endpoints)
        self._handler: Callable[[Received], None] | None = None
        self._queue: collections.deque[Received] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._closed = False
        carrier.set_handler(self._on_frames)

    def set_handler(self, handler: Callable[[Received], None]) -> None:
        self._handler = handler
        while self._queue:
            handler(self._queue.popleft())

    async def recv(self) -> Received:
        """Next frame set, for callers that did not set a handler."""
        while not self._queue:
            if self._closed:
                raise ClosedError("listener is closed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def _on_frames(self, received: Received) -> None:
        try:
            frames = self._transport.unpack(received)
        except ProtocolError as exc:
            log.warning("rlinf: dropped a bad shared-memory frame set: %r", exc)
            return
        out = Received(received.peer, received.header, frames)
        if self._handler is not None:
            self._handler(out)
            return
        self._queue.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._carrier.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ClosedError("listener is closed"))


class ShmTransport(Transport):
    """Shared memory behind the :mod:`.base` contract, over a ``carrier`` transport.

    The carrier (e.g. a :class:`~rlinf.transports.zeromq.ZmqTransport`) moves the slot
    descriptors and, from each receiver back to the sender's own carrier listener, the
    releases. Call :meth:`close` when done (unlinks the pool).

    Args:
        carrier: the transport that carries descriptors.
        cap: the pool's cap in bytes (default :func:`default_cap`).
        offload: copies of this many bytes or more run in an executor (default
            :data:`DEFAULT_OFFLOAD`).
    """

    name = "shm"

    def __init__(self, carrier: Transport, *, cap: int | None = None, offload: int | None = None) -> None:
        if not self.available():
            raise TransportUnavailableError(f"shared memory needs Linux and a writable {SHM_DIR}")
        self._carrier = carrier
        self.pool = ShmPool(cap)
        self.reader = ShmReader(self._on_release_threadsafe)
        self.offload = DEFAULT_OFFLOAD if offload is None else offload
        self.reply_to = ""
        self._reply_listener: Listener | None = None
        self._reply_links: dict[str, Link] = {}
        self._pending: dict[str, list] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def available(cls) -> bool:
        return available()

    async def listen(self) -> ShmListener:
        self._loop = asyncio.get_running_loop()
        return ShmListener(self, await self._carrier.listen())

    async def connect(self, endpoint: str, *, identity: bytes) -> ShmLink:
        self._loop = asyncio.get_running_loop()
        if self._reply_listener is None:     # where receivers send our slots back
            self._reply_listener = await self._carrier.listen()
            self._reply_listener.set_handler(self._on_release_frames)
            self.reply_to = next(iter(self._reply_listener.endpoints.values()))
        return ShmLink(self, await self._carrier.connect(endpoint, identity=identity), endpoint)

    def unpack(self, received: Received) -> list:
        """The buffers of a frame set sent by a :class:`ShmLink` (views of its slot)."""
        if not received.frames:
            raise ProtocolError("shared-memory frame set without a descriptor")
        try:
            reply_to, reader_key, raw_slot, sizes = msgpack.unpackb(
                received.frames[0], max_str_len=4096, max_array_len=1 << 20, max_bin_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"bad shared-memory descriptor: {exc}") from exc
        if not isinstance(reply_to, str) or not isinstance(reader_key, str) or not isinstance(sizes, list) \
                or not all(type(n) is int and 0 <= n <= MAX_SLOT for n in sizes):
            raise ProtocolError("bad shared-memory descriptor")
        if raw_slot is None:
            if len(received.frames) != 1 + len(sizes):
                raise ProtocolError("inline buffers do not match the descriptor")
            return list(received.frames[1:])
        slot = unpack_slot(raw_slot)
        filled = [n for n in sizes if n]
        if not 0 < slot_layout(filled)[1] <= slot.size:
            raise ProtocolError(f"slot of {slot.size} bytes cannot hold the {sum(filled)} bytes announced")
        views = iter(self.reader.open((reply_to, reader_key), slot, filled))
        return [next(views) if n else memoryview(b"") for n in sizes]

    def _on_release_threadsafe(self, src: Any, segment: str, generation: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._queue_release(src, segment, generation)
        else:
            loop.call_soon_threadsafe(self._queue_release, src, segment, generation)

    def _queue_release(self, src: tuple[str, str], segment: str, generation: int) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush_releases)
        self._pending.setdefault(src, []).append([segment, generation])

    def _flush_releases(self) -> None:
        pending, self._pending = self._pending, {}
        for src, items in pending.items():
            task = self._loop.create_task(self._send_release(src, items))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_release(self, src: tuple[str, str], items: list) -> None:
        reply_to, reader_key = src
        try:
            link = self._reply_links.get(src)
            if link is None:   # presenting the key the sender knows us by
                link = self._reply_links[src] = await self._carrier.connect(reply_to, identity=reader_key.encode())
            await link.send(_RELEASE, [msgpack.packb(items)])
        except RlinfError as exc:   # the sender is gone: it retires its slots itself
            log.debug("rlinf: could not return shared-memory slots to %s: %r", reply_to, exc)

    def _on_release_frames(self, received: Received) -> None:
        if received.header != _RELEASE or len(received.frames) != 1:
            return
        try:
            items = msgpack.unpackb(received.frames[0], max_array_len=1 << 20, max_str_len=4096)
        except (ValueError, TypeError, msgpack.UnpackException):
            return
        reader = received.peer.decode(errors="replace")
        for item in items if isinstance(items, list) else ():
            if isinstance(item, list) and len(item) == 2:
                self.pool.release(reader, *item)

    def close(self) -> None:
        """Close the release path, stop reporting releases and unlink the pool."""
        self.reader.close()
        for link in self._reply_links.values():
            link.close()
        self._reply_links.clear()
        if self._reply_listener is not None:
            self._reply_listener.close()
        for task in self._tasks:
            task.cancel()
        self.pool.close()
