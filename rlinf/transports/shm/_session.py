"""A communicator's shared-memory state (see :mod:`.shm`): pool, reader, relay and notices."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Callable, Sequence

from .. import descriptors
from ...codec import is_device_buffer
from ...util.copier import Copier
from ...util.procs import process_gone
from ...errors import ProtocolError, RlinfError
from ._fdshare import DEFAULT_FD_CACHE, FD_RELEASE, FdMaps, FdShares
from ._relay import Relay
from ._common import DEFAULT_OFFLOAD, sweep
from ._pool import Recycler, ShmPool, _Slot
from ._reader import ShmReader

log = logging.getLogger("rlinf.transports.shm")

#: A reader holding this many of our slots (or :data:`WINDOW_BYTES`) is behind: a
#: send to it waits for one back (:meth:`ShmSession.room`) instead of growing the pool
#: by a new segment per message.
WINDOW_SLOTS = 32
WINDOW_BYTES = 256 << 20
#: Seconds without a release after which a reader at its window counts as holding its
#: views (a queue that keeps items, say): sends to it stop waiting until it is down to
#: half its window.
STALL = 0.05
#: Seconds a notice (a release or a first mapping) may wait for company: what we owe a
#: sender goes out with our next message to it (:meth:`ShmSession.ahead`), else with
#: the other notices collected within this delay, in one message per sender. The
#: communicator flushes earlier once many are owed.
NOTICE_DELAY = 0.5e-3
#: Releases of at least this many bytes of slots travel ahead of our next message to
#: their sender, in its frame set; smaller ones right after it (:meth:`ShmSession.ahead`).
AHEAD_BYTES = 1 << 20


class ShmPeer:
    """What a :class:`ShmSession` keeps about one peer (by address): a
    :class:`~rlinf.transports.base.PeerState`, handed out by :meth:`ShmSession.peer`
    and closed once (:meth:`close`) when the peer is gone. The slots it holds of ours,
    the segments of its we map and the relays to it are kept by the pool, the reader
    and the relay (by its address); closing retires them all.

    Attributes:
        address: the peer's.
        releases, mapped: the notices we owe it as a sender (slots released, segments
            mapped), not sent yet. owed_bytes: bytes of the slots in ``releases``.
        room: set on its releases (a send waiting for room in its window waits on it).
        holding: it kept its window full for :data:`STALL`: sends no longer wait for it.
        closed: it is gone.
    """

    __slots__ = ("address", "releases", "mapped", "owed_bytes", "room", "holding", "closed", "_session")

    def __init__(self, session: ShmSession, address: str) -> None:
        self.address = address
        self.releases: list[list] = []
        self.mapped: list[str] = []
        self.owed_bytes = 0
        self.room: asyncio.Event | None = None
        self.holding = self.closed = False
        self._session = session

    def __repr__(self) -> str:
        return (f"<ShmPeer {self.address} owed={len(self.releases)}+{len(self.mapped)} "
                f"holding={self.holding}{' closed' if self.closed else ''}>")

    def close(self, *, process_gone: bool = False) -> None:
        """It left or died: retire the slots it held, forget its segments, and sweep them
        when its process is gone from this machine (``process_gone``: known gone here;
        else it may still run, having left without exiting or its liveness unknown)."""
        if not self.closed:
            self.closed = True
            self._session._forget(self, alive=not process_gone)


class ShmSession:
    """A communicator's shared-memory state: its pool, its reader, and the notices
    (releases, first mappings) it owes each sender, batched (see :data:`NOTICE_DELAY`).

    Args:
        loop: the communicator's loop (notices are sent from it).
        send_notice: ``send_notice(dst, obj)`` sends a SYSTEM ``"shm"`` message; it may
            raise an :class:`~rlinf.errors.RlinfError` when ``dst`` is gone.
        views: receivers keep zero-copy views (else :meth:`owned` copies out).
        cap: the pool's cap (``RLINF_SHM_CAP``; default :func:`default_cap`).
        offload: copies of at least this many bytes run in an executor thread
            (``RLINF_SHM_OFFLOAD``).
        fd_share: pass torch tensors already in shared memory by handle
            (``RLINF_SHM_FD``; see :mod:`._fdshare`).
        fd_cache: bytes of senders' shared files kept mapped (``RLINF_SHM_FD_CACHE``).
        copy_threads: threads per large copy, the caller included
            (``RLINF_COPY_THREADS``; default :func:`rlinf.util.copier.default_threads`).
        recycler: private memory for copy-outs (shared with the communicator's other
            receive paths; a new one by default).
        guard_relays: make a slot copy-on-write here before relaying views of it, so that
            this process's later writes into them never reach their receiver. False for
            a process that never writes into what it forwards (the channel process): the
            remap costs ~6 ms per 64 MiB once a mapping's pages are present.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, send_notice: Callable[[str, Any], None], *,
                 views: bool = True, cap: int | None = None, recycler: Recycler | None = None,
                 guard_relays: bool = True, offload: int = DEFAULT_OFFLOAD, fd_share: bool = True,
                 fd_cache: int = DEFAULT_FD_CACHE, copy_threads: int | None = None) -> None:
        self.pool = ShmPool(cap)
        self.reader = ShmReader(self._released, self._mapped)
        self.fd_maps = FdMaps(fd_cache)
        self.relay = Relay(self.reader.locate, self.pool, live=lambda: self.reader.relayable,
                           fds=FdShares() if fd_share else None,
                           privatize=self.reader.privatize if guard_relays else None)
        self.views = views
        self._recycler = recycler if recycler is not None else Recycler(cap)
        self.copier = Copier(copy_threads)     # large copies into and out of slots, split across threads
        self.offload = offload
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._send_notice = send_notice
        self.peers: dict[str, ShmPeer] = {}     # what we keep about each peer, by address
        self._owing: set[str] = set()            # peers we owe notices to
        self._owed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._changed: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<ShmSession {self.pool!r} {self.reader!r} views={self.views}>"

    def peer(self, address: str) -> ShmPeer:
        """What we keep about ``address`` (made on first use; a closed one is replaced:
        a restarted peer starts afresh)."""
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = ShmPeer(self, address)
        return peer

    # -- sending ---------------------------------------------------------------------------
    def export(self, buffers: Sequence[Any], sizes: Sequence[int], readers: dict[str, int],
               *, private: bool = False) -> tuple[_Slot, list[int], asyncio.Future | None] | None:
        """Copy the non-empty ``buffers`` into a slot for ``readers``.

        Returns:
            ``(slot, layout, copying)``, where ``layout`` is the entry layout (negative:
            in the slot; 0: an empty buffer, inline) and ``copying`` a future of the copy
            when it runs in the executor (the slot may not be announced before it is
            done), else None. None when the pool cannot serve it: send inline.
        """
        full = [b for b, n in zip(buffers, sizes) if n]
        offsets, end = descriptors.slot_layout([n for n in sizes if n])
        slot = self.pool.acquire(end, readers, private=private)
        if slot is None:
            return None
        copying = None
        if end >= self.offload:
            copying = self._loop.run_in_executor(None, ShmPool.fill, slot, full, offsets, self.copier)
        else:
            ShmPool.fill(slot, full, offsets, self.copier)
        return slot, [-n if n else 0 for n in sizes], copying

    def behind(self, reader: str) -> bool:
        """Whether a send to ``reader`` should wait for :meth:`room` (cheap: one lookup)."""
        if not self.pool.holding(reader):    # (the common case, first: every send asks)
            return False     # (a peer that gave every slot back is no longer holding: see _wake)
        slots, nbytes = self.pool.held(reader)
        peer = self.peers.get(reader)
        if slots >= WINDOW_SLOTS or nbytes >= WINDOW_BYTES:
            return peer is None or not peer.holding
        if peer is not None and peer.holding and slots <= WINDOW_SLOTS // 2 and nbytes <= WINDOW_BYTES // 2:
            peer.holding = False
        return False

    async def room(self, reader: str) -> None:
        """Wait while ``reader`` is at its window and keeps releasing slots (each release
        restarts the :data:`STALL` clock); a reader that releases nothing for that long
        is taken to be holding its views, and is not waited for again until it is down
        to half its window. Returns early if ``reader`` goes away."""
        peer = self.peer(reader)     # (never a closed one: closing forgets it)
        if peer.room is None:
            peer.room = asyncio.Event()
        event = peer.room
        while self.behind(reader):
            event.clear()
            try:
                async with asyncio.timeout(STALL):
                    await event.wait()
            except TimeoutError:
                peer.holding = True
                log.debug("rlinf: %s holds %s slots; not waiting for it", reader, self.pool.held(reader))
                return

    def _wake(self, reader: str) -> None:
        """``reader`` gave slots back: a send waiting for room looks again, and one that
        gave them all back is not taken for holding its views any more."""
        peer = self.peers.get(reader)
        if peer is not None:
            if peer.holding and not self.pool.holding(reader):
                peer.holding = False
            if peer.room is not None:
                peer.room.set()

    def discard(self, slot: _Slot, copying: asyncio.Future | None, reader: str) -> None:
        """``reader``'s message in ``slot`` was dropped unsent: count it as released
        (once the copy into the slot finished; other readers of it are unaffected)."""
        name, generation = slot.name, slot.generation
        if copying is None or copying.done():
            self._unsent(reader, name, generation)
        else:
            copying.add_done_callback(lambda _: self._unsent(reader, name, generation))

    def _unsent(self, reader: str, name: str, generation: int) -> None:
        self.pool.release(reader, name, generation)
        self._wake(reader)

    # -- receiving -------------------------------------------------------------------------
    def open(self, src: str, slot: descriptors.SlotRef, counts: Sequence[Any], pid: int | None) -> list[memoryview]:
        """Views of an entry's slot buffers (``counts``: its layout); see :meth:`ShmReader.open`.

        A slot that cannot be opened (its sender's ``/dev/shm`` is not ours, say) is
        released at once, so that it does not stay busy in the sender's pool; the error
        reaches the receive that takes the message."""
        try:
            return self.reader.open(src, slot, [-c for c in counts if type(c) is int and c < 0], pid)
        except ProtocolError:
            if not self.reader.closed:
                self._note(src, slot.segment, slot.generation)
            raise

    def open_relayed(self, src: str, relays: list[descriptors.SlotRef | descriptors.FdRef], counts: Sequence[Any],
                     pid: int | None) -> list[memoryview]:
        """Views of an entry's relayed buffers (its ``[r, offset, nbytes]`` layout items),
        in layout order. A relayed slot is released once all of its views are gone; a
        shared file (:class:`~rlinf.transports.descriptors.FdRef`) as soon as it is mapped."""
        places: dict[int, list[tuple[int, int]]] = {}
        order = []
        for c in counts:
            if type(c) is list:
                places.setdefault(c[0], []).append((c[1], c[2]))
                order.append(c[0])
        views = {}
        for r, p in places.items():
            relay = relays[r]
            if type(relay) is descriptors.FdRef:
                views[r] = iter(self.fd_maps.open(src, relay, p, pid))
                self._note(src, FD_RELEASE, relay.hold_id)
            else:
                views[r] = iter(self.reader.open_at(src, relay, p, pid))
        return [next(views[r]) for r in order]

    def owned(self, buffers: list) -> list:
        """Copy-out: owned copies of a received message's host buffers, in recycled
        private memory (dropping the views then releases the slot); GPU buffers are
        passed through (CUDA IPC made them owned already). Thread-safe."""
        host = [i for i, b in enumerate(buffers) if type(b) is memoryview or not is_device_buffer(b)]
        if len(host) == len(buffers):
            return self._recycler.copy(buffers, self.copier)
        out = list(buffers)
        for i, copy in zip(host, self._recycler.copy([buffers[i] for i in host], self.copier)):
            out[i] = copy
        return out

    def _released(self, src: str, segment: str, generation: int) -> None:
        if threading.get_ident() == self._loop_thread:
            self._note(src, segment, generation)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._note, src, segment, generation)

    def _mapped(self, src: str, segment: str) -> None:
        self._note(src, segment, None)

    def _note(self, src: str, segment: str, generation: int | None) -> None:
        if self.reader.closed:
            return
        if self._timer is None:
            self._timer = self._loop.call_later(NOTICE_DELAY, self.flush)
        self._owed += 1
        peer = self.peer(src)
        self._owing.add(src)
        if generation is None:
            peer.mapped.append(segment)
        else:
            peer.releases.append([segment, generation])
            peer.owed_bytes += self.reader.mapped_bytes(segment)

    @property
    def owed(self) -> int:
        """How many notices are waiting to be sent."""
        return self._owed

    def take(self, src: str) -> list | None:
        """What we owe ``src`` (the notice's body), to send with a message to it now;
        None if nothing."""
        if src not in self._owing:
            return None
        self._owing.discard(src)
        peer = self.peers[src]
        owed = [peer.releases, peer.mapped]
        peer.releases, peer.mapped, peer.owed_bytes = [], [], 0
        self._owed -= len(owed[0]) + len(owed[1])
        if not self._owing:
            self._stop_timer()
        return owed

    def ahead(self, src: str) -> bool | None:
        """How what we owe ``src`` goes with our next message to it: ahead of it in its
        frame set (True: it returns a slot of at least :data:`AHEAD_BYTES`, which the
        sender's next message may then reuse instead of taking a second one), or right
        after it (False: small slots; carried ahead they would add ~12 us to a reply's
        latency on both sides). None: we owe ``src`` nothing."""
        if src not in self._owing:
            return None
        return self.peers[src].owed_bytes >= AHEAD_BYTES

    def flush_to(self, src: str) -> None:
        """Send what we owe ``src`` now, in a notice of its own."""
        owed = self.take(src)
        if owed is not None:
            try:
                self._send_notice(src, owed)
            except RlinfError as exc:   # the sender is gone: it retires or sweeps its slots
                log.debug("rlinf: shared-memory notice to %s not sent: %r", src, exc)

    def flush(self) -> None:
        """Send the notices collected so far, one message per sender."""
        self._stop_timer()
        for src in list(self._owing):
            self.flush_to(src)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_notice(self, src: str, obj: Any) -> None:
        """A SYSTEM ``"shm"`` message from ``src``: ``[[[segment, generation], ...], [segment, ...]]``."""
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], list) and isinstance(obj[1], list)):
            log.warning("rlinf: malformed shared-memory notice from %s", src)
            return
        for segment in obj[1]:
            self.pool.confirm(src, segment)
            self.relay.confirm(src, segment)
        for item in obj[0]:
            if not (isinstance(item, list) and len(item) == 2
                    and (self.pool.release(src, *item) or self.relay.release(src, *item))):
                log.debug("rlinf: ignored a release from %s that matches no slot sent to it: %r", src, item)
        if obj[0]:
            self._wake(src)
        if self._changed is not None:
            self._changed.set()

    # -- membership and lifecycle ----------------------------------------------------------
    def _forget(self, peer: ShmPeer, *, alive: bool) -> None:
        """``peer`` closed (see :meth:`ShmPeer.close`): what the pool, the relay, the
        reader and the shared files keep for its address goes, and so does it."""
        address = peer.address
        if self.peers.get(address) is peer:
            del self.peers[address]
        for other in self.pool.reader_gone(address):
            self._wake(other)         # it co-read retired slots: it holds fewer of ours now
        self.relay.reader_gone(address, alive=alive)
        self.fd_maps.peer_gone(address)
        if address in self._owing:
            self._owing.discard(address)
            self._owed -= len(peer.releases) + len(peer.mapped)
        peer.releases, peer.mapped, peer.owed_bytes = [], [], 0
        if peer.room is not None:
            peer.room.set()
        for pid in self.reader.peer_gone(address):
            if pid != os.getpid() and process_gone(pid):
                sweep(pid)
        if self._changed is not None:
            self._changed.set()

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every reader of a busy slot has mapped its
        file, so that closing may unlink it. Call before saying goodbye."""
        self.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._changed = asyncio.Event()
        try:
            while self._unconfirmed() and loop.time() < deadline:
                self._changed.clear()
                try:
                    async with asyncio.timeout(deadline - loop.time()):
                        await self._changed.wait()
                except TimeoutError:
                    break
        finally:
            self._changed = None
        late = self._unconfirmed()
        if late:
            log.warning("rlinf: closing before %s mapped their shared memory; those messages are lost", late)

    def _unconfirmed(self) -> list[str]:
        fds = self.relay.fds.unconfirmed() if self.relay.fds is not None else ()
        return sorted({*self.pool.unconfirmed(), *self.relay.unconfirmed(), *fds})

    def close(self) -> None:
        """Send what is owed, stop reporting, and unlink the pool. Idempotent."""
        if not self.reader.closed:
            self.flush()
        self._stop_timer()
        self.reader.close()
        self.relay.close()
        self.fd_maps.close()
        self.pool.close()
        self.copier.close()
