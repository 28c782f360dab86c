"""Same-node shared memory: large CPU buffers cross with one copy, as pooled slots.

Design (see ``docs/transports.md`` for the whole picture):

* **Pool** (:class:`ShmPool`, the sender's side). Each process owns files in
  ``/dev/shm`` named ``rlinf-<pid>-<token>-<n>``, one *slot* per file, in size classes
  (eighth-of-a-power-of-two steps, >= 64 KiB). A file is created on demand, reserved
  with ``posix_fallocate`` (a full ``/dev/shm`` is an error here, never a SIGBUS later),
  mapped once and pre-faulted (``MADV_POPULATE_WRITE``, else a write per page), then
  reused: writing into pages already mapped runs ~10x faster than into fresh ones. The
  pool grows up to a cap (``RLINF_SHM_CAP``, default min(4 GiB, half of ``/dev/shm``)),
  evicting free slots first; past the cap :meth:`ShmPool.acquire` returns None and the
  caller sends inline (ZeroMQ) instead. Nothing fails for lack of shared memory.
* **Export.** The sender copies the message's buffers once into a free slot (placed by
  :func:`rlinf.wire.slot_layout`) and sends only a small descriptor
  (:class:`rlinf.wire.SlotRef`). The slot is *busy* until every reader released it.
* **Views** (:class:`ShmReader`, the receiver's side). The receiver maps each sender
  segment once (cached, pre-faulted) and gets writable zero-copy views. A
  ``weakref.finalize`` on the object that exports them fires when the last view is
  garbage-collected (on whatever thread) and reports the release; the communicator
  batches releases into one SYSTEM message per sender and loop iteration. A slot is
  never rewritten while a reader holds a view into it: only a release frees it, and
  one from a peer it was not sent to, or for an older use of the slot, is ignored.
* **Several readers** (multicast): the slot carries a reader count and is mapped
  copy-on-write (``MAP_PRIVATE``) by each reader, so one reader's writes stay its own.
  On release the reader drops the pages it wrote (its private copies, found through
  ``/proc/self/pagemap``; ``MADV_DONTNEED``) so the next use of the slot reads the new
  data; pages it only read stay mapped and already show it.
* **Cleanup.** Closing unlinks the pool's files (after the readers of in-flight slots
  confirmed they mapped them, bounded by a timeout). A reader that leaves or dies
  makes the sender retire the slots it held (unlinked, never reused: a departed
  process may still hold views). A sender that dies is swept (:func:`sweep`) by the
  survivors that notice and by the manager of its machine; ``atexit`` unlinks too.

Buffer lifetime: :meth:`ShmPool.fill` copies, so the caller may reuse its buffers once
it returns. Views from :meth:`ShmReader.open` stay valid (and the slot stays busy) for
as long as any of them, or any array decoded over them, is referenced.

:class:`ShmTransport` packages the same pieces behind the :mod:`.base` contract (a
carrier transport moves the descriptors and the releases), for the conformance suite and
for tools; the communicator uses the pool and reader directly, per message.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import mmap
import os
import secrets
import sys
import threading
import weakref
from typing import Any, Callable, Hashable, Sequence

import msgpack
import numpy as np

from .. import wire
from ..devices import process_gone
from ..errors import ClosedError, ProtocolError, RlinfError, TransportUnavailableError
from ._pagemap import written_runs
from ._relay import Relay
from .base import Link, Listener, Received, Transport

__all__ = ["ShmPool", "ShmReader", "ShmSession", "ShmTransport", "ShmLink", "ShmListener", "Recycler", "Relay",
           "available", "sweep", "default_cap", "copy_out", "SHM_DIR"]

log = logging.getLogger("rlinf.transports.shm")

SHM_DIR = "/dev/shm"
#: Smallest slot (smaller payloads are rounded up to it).
MIN_SLOT = 64 << 10
#: Copies of at least this many bytes run in an executor thread (``RLINF_SHM_OFFLOAD``).
DEFAULT_OFFLOAD = 16 << 20
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23
_U8 = np.uint8
_NUMPY_COPY = 1 << 20
_POPULATE_MAX = 256 << 20


def available(directory: str = SHM_DIR) -> bool:
    """True when shared memory can be used here (Linux with a writable ``/dev/shm``)."""
    return sys.platform.startswith("linux") and os.path.isdir(directory) and os.access(directory, os.W_OK)


def _parse_bytes(text: str, name: str) -> int:
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"{name} must be a byte count like 4294967296 or 4G, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {text!r}")
    return value


def default_cap(directory: str = SHM_DIR) -> int:
    """``RLINF_SHM_CAP`` (bytes, or with a K/M/G suffix), else min(4 GiB, half of ``/dev/shm``)."""
    raw = os.environ.get("RLINF_SHM_CAP", "").strip()
    if raw:
        return _parse_bytes(raw, "RLINF_SHM_CAP")
    try:
        st = os.statvfs(directory)
        return min(4 << 30, st.f_frsize * st.f_blocks // 2)
    except OSError:
        return 0


def offload_threshold() -> int:
    """Copies of this many bytes or more go to an executor (``RLINF_SHM_OFFLOAD``)."""
    raw = os.environ.get("RLINF_SHM_OFFLOAD", "").strip()
    return _parse_bytes(raw, "RLINF_SHM_OFFLOAD") if raw else DEFAULT_OFFLOAD


def sweep(pid: int, directory: str = SHM_DIR) -> int:
    """Unlink every segment of process ``pid`` (call only once it is gone). Returns the count."""
    prefix, count = f"rlinf-{int(pid)}-", 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, name))
                count += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("rlinf: cannot remove %s/%s: %s", directory, name, exc)
    return count


def _slot_size(n: int) -> int:
    """Size class for ``n`` bytes: eighth-of-a-power-of-two steps (<= 12.5% waste)."""
    n = max(n, MIN_SLOT)
    step = max(_PAGE, 1 << ((n - 1).bit_length() - 4))
    return -(-n // step) * step


def _prefault(mm: mmap.mmap, size: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):   # kernels before 5.14: touch every page instead
        np.frombuffer(mm, _U8, size)[::_PAGE] = 0


class Recycler:
    """Private (not shared) memory for the receiver's owned copies, reused once every
    array over a buffer is garbage-collected: a copy into pages already faulted in runs
    several times faster than into fresh ones. Thread-safe.

    Args:
        limit: most bytes kept for reuse (``RLINF_SHM_CAP``'s default rule).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_cap() if limit is None else limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A private uint8 array of ``n`` bytes; its memory is reused after it dies."""
        size = _slot_size(n)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._kept -= size
        if buf is None:
            buf = np.empty(size, _U8)
        out = buf[:n]
        weakref.finalize(out, self._give_back, buf).atexit = False
        return out

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.size <= self.limit:
                self._free.setdefault(buf.size, []).append(buf)
                self._kept += buf.size

    def copy(self, buffers: Sequence[Any]) -> list[memoryview]:
        """Owned copies of ``buffers``, all in one recycled buffer (one copy each)."""
        views = [b if type(b) is memoryview else memoryview(b) for b in buffers]
        sizes = [v.nbytes for v in views]
        offsets, end = wire.slot_layout(sizes)
        dst = self.take(end)
        whole = memoryview(dst)
        for v, off, n in zip(views, offsets, sizes):
            if n >= _NUMPY_COPY:
                np.copyto(dst[off:off + n], np.frombuffer(v, _U8))
            elif n:
                whole[off:off + n] = v if v.format == "B" and v.ndim == 1 else v.cast("B")
        return [whole[o:o + n] for o, n in zip(offsets, sizes)]


def _drop_written(mm: mmap.mmap, offset: int, size: int) -> None:
    """Drop the pages of ``mm[offset:offset + size]`` this process wrote (its private
    copies), so they show the file's bytes again. Pages only read are left mapped: they
    already show the file, and faulting them in again would cost ~0.9 µs each."""
    start = offset - offset % _PAGE
    length = -(-(offset + size - start) // _PAGE) * _PAGE
    base = np.frombuffer(mm, _U8, 0).ctypes.data if len(mm) else 0
    runs = written_runs(base + start, length) if base else None
    for off, n in [(0, length)] if runs is None else runs:
        mm.madvise(mmap.MADV_DONTNEED, start + off, n)


def copy_out(buffers: Sequence[Any]) -> list:
    """Owned copies of ``buffers`` in fresh memory (one copy each)."""
    return Recycler(0).copy(buffers)


class _Slot:
    __slots__ = ("name", "path", "mm", "array", "view", "size", "generation", "readers", "private", "confirmed")

    def __init__(self, name: str, path: str, mm: mmap.mmap, size: int) -> None:
        self.name, self.path, self.mm, self.size = name, path, mm, size
        self.array = np.frombuffer(mm, _U8, size)
        self.view = memoryview(self.array)
        self.generation = 0
        self.readers: dict[str, int] = {}
        self.private = False
        self.confirmed: set[str] = set()      # readers known to have mapped the file

    def ref(self) -> wire.SlotRef:
        return wire.SlotRef(self.name, os.getpid(), 0, self.size, self.generation, self.private)

    def to_wire(self) -> list:
        """``self.ref().to_wire()``, without building the record (hot path)."""
        return [self.name, 0, self.size, self.generation, self.private]


_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _unlink_at_exit() -> None:
    for pool in list(_POOLS):
        pool.unlink_all()


class ShmPool:
    """The sender's slots (loop thread only, except :meth:`fill`). See the module docstring.

    Args:
        cap: most bytes of shared memory to hold (default :func:`default_cap`).
        directory: where segments live (``/dev/shm``).
    """

    def __init__(self, cap: int | None = None, *, directory: str = SHM_DIR) -> None:
        self.cap = default_cap(directory) if cap is None else cap
        self._dir = directory
        self._prefix = f"rlinf-{os.getpid()}-{secrets.token_hex(4)}-"
        self._seq = itertools.count()
        self._generations = itertools.count(1)
        self._free: dict[int, list[_Slot]] = {}
        self._busy: dict[str, _Slot] = {}
        self.links: set[str] = set()   # paths of our names for other processes' segments
        self.mapped = 0
        self.created = 0      # segments ever created (the rest of the exports reused one)
        self.exports = 0
        self.fallbacks = 0
        self.closed = False
        self._warned = False
        _POOLS.add(self)

    def __repr__(self) -> str:
        free = sum(len(v) for v in self._free.values())
        return (f"<ShmPool {self._prefix}* busy={len(self._busy)} free={free} "
                f"mapped={self.mapped >> 20} MiB cap={self.cap >> 20} MiB>")

    @property
    def busy(self) -> int:
        """Slots a reader still holds."""
        return len(self._busy)

    def segment_names(self) -> list[str]:
        """Names of the segments this pool holds now (busy and free)."""
        return sorted([*self._busy, *(s.name for v in self._free.values() for s in v)])

    def acquire(self, nbytes: int, readers: dict[str, int], *, private: bool = False) -> _Slot | None:
        """A slot of at least ``nbytes`` for ``readers`` (address -> count), or None.

        None means: over the cap or no shared memory left; send inline instead.
        """
        if self.closed:
            return None
        size = _slot_size(nbytes)
        slot = self._take_free(size)
        if slot is None:
            slot = self._create(size)
            if slot is None:
                self.fallbacks += 1
                return None
        slot.generation = next(self._generations)
        slot.readers = dict(readers)
        slot.private = private
        self._busy[slot.name] = slot
        self.exports += 1
        return slot

    def _take_free(self, size: int) -> _Slot | None:
        free = self._free.get(size)
        if not free:   # the smallest free class that still fits within 2x
            fits = [k for k, v in self._free.items() if v and size < k <= 2 * size]
            if not fits:
                return None
            free = self._free[min(fits)]
        return free.pop()

    def _create(self, size: int) -> _Slot | None:
        if size > self.cap:
            return None
        while self.mapped + size > self.cap and self._evict_one():
            pass
        if self.mapped + size > self.cap:
            return None
        name = f"{self._prefix}{next(self._seq)}"
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._warn(f"cannot create {path}: {exc}")
            return None
        try:
            os.posix_fallocate(fd, 0, size)      # ENOSPC here, not SIGBUS on first write
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(path)
            self._warn(f"cannot reserve {size} bytes in {self._dir}: {exc}")
            return None
        finally:
            os.close(fd)
        _prefault(mm, size)
        self.mapped += size
        self.created += 1
        return _Slot(name, path, mm, size)

    def _evict_one(self) -> bool:
        for size, free in self._free.items():
            if free:
                self._drop(free.pop())
                return True
        return False

    def _drop(self, slot: _Slot) -> None:
        self.mapped -= slot.size
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("rlinf: shared memory unavailable, sending inline instead: %s", message)

    @staticmethod
    def fill(slot: _Slot, buffers: Sequence[Any], offsets: Sequence[int]) -> None:
        """Copy ``buffers`` into ``slot`` at ``offsets`` (thread-safe). Buffers of 1 MiB
        and more are copied by numpy, which releases the GIL; smaller ones by a
        memoryview assignment, which costs a third as much per call."""
        view = slot.view
        for buf, off in zip(buffers, offsets):
            mv = buf if type(buf) is memoryview else memoryview(buf)
            n = mv.nbytes
            if n >= _NUMPY_COPY:
                np.copyto(slot.array[off:off + n], np.frombuffer(mv, _U8))
            else:
                if mv.format != "B" or mv.ndim != 1:
                    mv = mv.cast("B")
                view[off:off + n] = mv

    def cancel(self, slot: _Slot) -> None:
        """Give back a slot whose message was never sent."""
        if self._busy.pop(slot.name, None) is slot:
            self._park(slot)

    def _park(self, slot: _Slot) -> None:
        if self.closed:
            self._drop(slot)
        else:
            self._free.setdefault(slot.size, []).append(slot)

    def release(self, reader: str, name: Any, generation: Any) -> bool:
        """``reader`` dropped its views of ``name``'s use ``generation``.

        Returns False (and changes nothing) for a release that does not match a use of
        a slot sent to ``reader``: stale, duplicated or forged.
        """
        slot = self._busy.get(name) if isinstance(name, str) else None
        if slot is None or slot.generation != generation or reader not in slot.readers:
            return False
        slot.confirmed.add(reader)
        left = slot.readers[reader] - 1
        if left:
            slot.readers[reader] = left
        else:
            del slot.readers[reader]
            if not slot.readers:
                del self._busy[name]
                self._park(slot)
        return True

    def confirm(self, reader: str, name: Any) -> None:
        """``reader`` mapped segment ``name`` (it no longer needs the file to exist)."""
        slot = self._busy.get(name) if isinstance(name, str) else None
        if slot is not None:
            slot.confirmed.add(reader)

    def unconfirmed(self) -> list[str]:
        """Readers still to map a busy slot's file (what closing waits for)."""
        return sorted({r for s in self._busy.values() for r in s.readers if r not in s.confirmed})

    def reader_gone(self, reader: str) -> int:
        """``reader`` left or died: retire the slots it held (unlinked, never reused)."""
        retired = [s for s in self._busy.values() if reader in s.readers]
        for slot in retired:
            del self._busy[slot.name]
            self._drop(slot)
        return len(retired)

    def close(self) -> None:
        """Unlink every segment. Views readers hold stay valid (the memory lives on
        until the last mapping goes). Idempotent."""
        self.closed = True
        self.unlink_all()

    def unlink_all(self) -> None:
        for slot in [*self._busy.values(), *(s for v in self._free.values() for s in v)]:
            self._drop(slot)
        self._busy.clear()
        self._free.clear()
        for path in list(self.links):
            self.unlink_link(path)

    def link(self, segment: str) -> tuple[str, str]:
        """A second name of ours for another process's ``segment`` (a hard link, so the
        file outlives the owner's name; see :mod:`._relay`). Unlinked with the pool.

        Raises:
            OSError: the segment is gone (or links are not possible here).
        """
        name = f"{self._prefix}{next(self._seq)}"
        path = os.path.join(self._dir, name)
        os.link(os.path.join(self._dir, segment), path)
        self.links.add(path)
        return name, path

    def unlink_link(self, path: str) -> None:
        self.links.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmReader:
    """The receiver's mappings of senders' segments (see the module docstring).

    Args:
        on_release: ``on_release(src, segment, generation)``, called once the last view
            of a slot is garbage-collected — on whatever thread collected it.
        on_map: ``on_map(src, segment)``, called (loop thread) when a segment is mapped.
        directory: where segments live.
    """

    def __init__(self, on_release: Callable[[Hashable, str, int], None],
                 on_map: Callable[[Hashable, str], None] | None = None, *, directory: str = SHM_DIR) -> None:
        self._on_release = on_release
        self._on_map = on_map
        self._dir = directory
        self._shared: dict[str, mmap.mmap] = {}
        self._private: dict[str, mmap.mmap] = {}
        self._by_peer: dict[str, set[str]] = collections.defaultdict(set)
        #: slots with live views, for :meth:`locate`: key -> (start address, SlotRef)
        self._live: dict[int, tuple[int, wire.SlotRef]] = {}
        self._keys = itertools.count()
        self.closed = False

    def __repr__(self) -> str:
        return f"<ShmReader mapped={len(self._shared) + len(self._private)}{' closed' if self.closed else ''}>"

    def open(self, src: Hashable, slot: wire.SlotRef, sizes: Sequence[int], pid: int | None = None) -> list[memoryview]:
        """Writable views of the buffers of ``sizes`` bytes in ``slot``, from ``src``.

        Args:
            pid: the sender's pid when known: the segment must be its own.

        Raises:
            ProtocolError: the slot is not ``src``'s, missing, or outside its segment.
        """
        offsets, end = wire.slot_layout(sizes)
        if end > slot.size:
            raise ProtocolError("buffers do not fit their slot")
        whole = self._export(src, slot, pid)
        return [whole[o:o + n] for o, n in zip(offsets, sizes)]

    def open_at(self, src: Hashable, slot: wire.SlotRef, places: Sequence[tuple[int, int]],
                pid: int | None = None) -> list[memoryview]:
        """Like :meth:`open`, for buffers at explicit ``(offset, nbytes)`` places in the
        slot (a relayed slot: see :mod:`._relay`)."""
        for offset, n in places:
            if offset + n > slot.size:
                raise ProtocolError("buffers do not fit their slot")
        whole = self._export(src, slot, pid)
        return [whole[o:o + n] for o, n in places]

    def _export(self, src: Hashable, slot: wire.SlotRef, pid: int | None) -> memoryview:
        """A view of the whole slot; when the last view derived from it is gone, the
        slot is released to ``src``."""
        if self.closed:
            raise ClosedError("shared-memory reader is closed")
        if pid is not None and slot.pid != pid:
            raise ProtocolError(f"{src} described a segment of another process ({slot.segment})")
        cache = self._private if slot.private else self._shared
        mm = cache.get(slot.segment)
        if mm is None:
            mm = cache[slot.segment] = self._map(slot)
            self._by_peer[src].add(slot.segment)
            if self._on_map is not None:
                self._on_map(src, slot.segment)
        if slot.offset + slot.size > len(mm):
            raise ProtocolError(f"slot beyond the end of segment {slot.segment}")
        exporter = np.frombuffer(mm, _U8, slot.size, slot.offset)
        key = next(self._keys)
        if not slot.private:
            self._live[key] = (exporter.ctypes.data, slot)
        done = weakref.finalize(exporter, self._released, src, slot, mm if slot.private else None, key)
        done.atexit = False
        return memoryview(exporter)

    @property
    def relayable(self) -> bool:
        """Whether any slot has live views that :meth:`locate` could find."""
        return bool(self._live)

    def locate(self, address: int, nbytes: int) -> tuple[wire.SlotRef, int] | None:
        """The shared (not copy-on-write) slot with live views that holds the ``nbytes``
        at ``address``, and their offset in it; None if no such slot does."""
        for start, slot in list(self._live.values()):
            if start <= address and address + nbytes <= start + slot.size:
                return slot, address - start
        return None

    def _map(self, slot: wire.SlotRef) -> mmap.mmap:
        path = os.path.join(self._dir, slot.segment)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory segment {slot.segment}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if slot.offset + slot.size > size:   # touching past the end would be a SIGBUS
                raise ProtocolError(f"slot beyond the end of segment {slot.segment}")
            if slot.private:   # copy-on-write; populating a writable private map would copy it
                return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            # Pre-faulting is a one-time cost per segment, but it runs on the loop: above
            # _POPULATE_MAX the pages fault in where the receiver first touches them.
            populate = getattr(mmap, "MAP_POPULATE", 0) if size <= _POPULATE_MAX else 0
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        except OSError as exc:
            raise ProtocolError(f"cannot map shared-memory segment {slot.segment}: {exc}") from exc
        finally:
            os.close(fd)

    def _released(self, src: str, slot: wire.SlotRef, private_map: mmap.mmap | None, key: int) -> None:
        self._live.pop(key, None)
        if private_map is not None:
            try:   # drop this reader's copy-on-write pages: the next use reads fresh data
                _drop_written(private_map, slot.offset, slot.size)
            except (OSError, ValueError):
                log.warning("rlinf: cannot reset private pages of %s", slot.segment)
                return   # never release a slot we could not reset: it would show stale data
            if self._private.get(slot.segment) is private_map \
                    and not os.path.exists(os.path.join(self._dir, slot.segment)):
                self._private.pop(slot.segment, None)   # retired: nobody can send it again
        if not self.closed:
            self._on_release(src, slot.segment, slot.generation)

    def peer_gone(self, src: Hashable) -> set[int]:
        """Forget ``src``'s segments (views already handed out stay valid).

        Returns:
            The pids that created them (for a sweep once they are gone).
        """
        names = self._by_peer.pop(src, ())
        for name in names:
            self._shared.pop(name, None)
            self._private.pop(name, None)
        return {wire.parse_segment_name(name) for name in names}

    def close(self) -> None:
        """Stop reporting releases and drop the mappings' cache. Idempotent."""
        self.closed = True
        self._shared.clear()
        self._private.clear()
        self._by_peer.clear()
        self._live.clear()


class ShmSession:
    """A communicator's shared-memory state: its pool, its reader, and the notices
    (releases, first mappings) it owes each sender, batched per loop iteration.

    Args:
        loop: the communicator's loop (notices are sent from it).
        send_notice: ``send_notice(dst, obj)`` sends a SYSTEM ``"shm"`` message; it may
            raise an :class:`~rlinf.errors.RlinfError` when ``dst`` is gone.
        views: receivers keep zero-copy views (else :meth:`owned` copies out).
        cap: the pool's cap (default :func:`default_cap`).
        recycler: private memory for copy-outs (shared with the communicator's other
            receive paths; a new one by default).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, send_notice: Callable[[str, Any], None], *,
                 views: bool = True, cap: int | None = None, recycler: Recycler | None = None) -> None:
        self.pool = ShmPool(cap)
        self.reader = ShmReader(self._released, self._mapped)
        self.relay = Relay(self.reader.locate, self.pool)
        self.views = views
        self._recycler = recycler if recycler is not None else Recycler()
        self.offload = offload_threshold()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._send_notice = send_notice
        self._pending: dict[str, tuple[list, list]] = {}
        self._owed = 0
        self._changed: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<ShmSession {self.pool!r} {self.reader!r} views={self.views}>"

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
        offsets, end = wire.slot_layout([n for n in sizes if n])
        slot = self.pool.acquire(end, readers, private=private)
        if slot is None:
            return None
        copying = None
        if end >= self.offload:
            copying = self._loop.run_in_executor(None, ShmPool.fill, slot, full, offsets)
        else:
            ShmPool.fill(slot, full, offsets)
        return slot, [-n if n else 0 for n in sizes], copying

    def discard(self, slot: _Slot, copying: asyncio.Future | None, reader: str) -> None:
        """``reader``'s message in ``slot`` was dropped unsent: count it as released
        (once the copy into the slot finished; other readers of it are unaffected)."""
        name, generation = slot.name, slot.generation
        if copying is None or copying.done():
            self.pool.release(reader, name, generation)
        else:
            copying.add_done_callback(lambda _: self.pool.release(reader, name, generation))

    # -- receiving -------------------------------------------------------------------------
    def open(self, src: str, slot: wire.SlotRef, counts: Sequence[Any], pid: int | None) -> list[memoryview]:
        """Views of an entry's slot buffers (``counts``: its layout); see :meth:`ShmReader.open`."""
        return self.reader.open(src, slot, [-c for c in counts if type(c) is int and c < 0], pid)

    def open_relayed(self, src: str, relays: list[wire.SlotRef], counts: Sequence[Any],
                     pid: int | None) -> list[memoryview]:
        """Views of an entry's relayed buffers (its ``[r, offset, nbytes]`` layout items),
        in layout order; one release per relay, once all of its views are gone."""
        places: dict[int, list[tuple[int, int]]] = {}
        order = []
        for c in counts:
            if type(c) is list:
                places.setdefault(c[0], []).append((c[1], c[2]))
                order.append(c[0])
        views = {r: iter(self.reader.open_at(src, relays[r], p, pid)) for r, p in places.items()}
        return [next(views[r]) for r in order]

    def owned(self, buffers: list) -> list:
        """Copy-out: owned copies of a received message's buffers, in recycled private
        memory (dropping the views then releases the slot). Thread-safe."""
        return self._recycler.copy(buffers)

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
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._owed += 1
        releases, mapped = self._pending.setdefault(src, ([], []))
        if generation is None:
            mapped.append(segment)
        else:
            releases.append([segment, generation])

    @property
    def owed(self) -> int:
        """How many notices are waiting to be sent."""
        return self._owed

    def flush(self) -> None:
        """Send the notices collected so far, one message per sender."""
        pending, self._pending, self._owed = self._pending, {}, 0
        for src, (releases, mapped) in pending.items():
            try:
                self._send_notice(src, [releases, mapped])
            except RlinfError as exc:   # the sender is gone: it retires or sweeps its slots
                log.debug("rlinf: shared-memory notice to %s not sent: %r", src, exc)

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
        if self._changed is not None:
            self._changed.set()

    # -- membership and lifecycle ----------------------------------------------------------
    def peer_gone(self, address: str) -> None:
        """``address`` left or died: retire what it held, forget its segments, and sweep
        them when its process is gone from this machine."""
        self.pool.reader_gone(address)
        self.relay.reader_gone(address)
        self._owed -= sum(map(len, self._pending.pop(address, ((), ()))))
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
            while (self.pool.unconfirmed() or self.relay.unconfirmed()) and loop.time() < deadline:
                self._changed.clear()
                try:
                    async with asyncio.timeout(deadline - loop.time()):
                        await self._changed.wait()
                except TimeoutError:
                    break
        finally:
            self._changed = None
        late = sorted({*self.pool.unconfirmed(), *self.relay.unconfirmed()})
        if late:
            log.warning("rlinf: closing before %s mapped their shared memory; those messages are lost", late)

    def close(self) -> None:
        """Send what is owed, stop reporting, and unlink the pool. Idempotent."""
        if not self.reader.closed:
            self.flush()
        self.reader.close()
        self.relay.close()
        self.pool.close()


# -- the transport contract (base.py) over a carrier transport ------------------------------
_RELEASE = b"rlinf.shm.release"


class ShmLink(Link):
    """Sends frame sets whose buffers travel in a shared-memory slot.

    Buffer lifetime: :meth:`send` copies the buffers into a slot, so it returns as soon
    as the carrier accepted the descriptor and the caller may reuse its buffers at once.
    Past the pool's cap the buffers go inline on the carrier link (its own rule applies).
    """

    def __init__(self, transport: ShmTransport, carrier: Link, endpoint: str) -> None:
        self._transport = transport
        self._carrier = carrier
        self.endpoint = endpoint
        self._closed: ClosedError | None = None

    def __repr__(self) -> str:
        return f"<ShmLink {self.endpoint}{' closed' if self._closed else ''}>"

    async def send(self, header: bytes, buffers: Sequence[Any]) -> None:
        if self._closed is not None:
            raise self._closed
        pool = self._transport.pool
        views = [b if type(b) is memoryview else memoryview(b) for b in buffers]
        sizes = [v.nbytes for v in views]
        offsets, end = wire.slot_layout(sizes)
        slot = pool.acquire(end, {self.endpoint: 1}) if end else None
        if slot is None:
            control = msgpack.packb([self._transport.reply_to, self.endpoint, None, sizes])
            await self._carrier.send(header, [control, *views])
            return
        copying = None
        try:
            if end >= self._transport.offload:
                copying = asyncio.get_running_loop().run_in_executor(None, pool.fill, slot, views, offsets)
                await asyncio.shield(copying)     # a cancelled send must not free a slot mid-copy
            else:
                pool.fill(slot, views, offsets)
            control = msgpack.packb([self._transport.reply_to, self.endpoint, slot.ref().to_wire(), sizes])
            await self._carrier.send(header, [control])
        except BaseException:
            # never reached the peer: reusable once nothing writes into it any more
            if copying is None or copying.done():
                pool.cancel(slot)
            else:
                copying.add_done_callback(lambda _: pool.cancel(slot))
            raise

    def close(self) -> None:
        if self._closed is None:
            self._closed = ClosedError(f"link to {self.endpoint} is closed")
            self._carrier.close()


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
        offload: copies of this many bytes or more run in an executor.
    """

    name = "shm"

    def __init__(self, carrier: Transport, *, cap: int | None = None, offload: int | None = None) -> None:
        if not self.available():
            raise TransportUnavailableError(f"shared memory needs Linux and a writable {SHM_DIR}")
        self._carrier = carrier
        self.pool = ShmPool(cap)
        self.reader = ShmReader(self._on_release_threadsafe)
        self.offload = offload_threshold() if offload is None else offload
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
                or not all(type(n) is int and 0 <= n <= wire.MAX_SLOT for n in sizes):
            raise ProtocolError("bad shared-memory descriptor")
        if raw_slot is None:
            if len(received.frames) != 1 + len(sizes):
                raise ProtocolError("inline buffers do not match the descriptor")
            return list(received.frames[1:])
        # wire.py validates every bound of the slot and of the sizes it must hold
        layout = [-n if n else 0 for n in sizes]
        entry = wire.unpack_header(wire.pack_header("x:0", "x", [[0, 0, b"", layout, raw_slot]], True), [b""])[2][0]
        views = iter(self.reader.open((reply_to, reader_key), entry.slot, [n for n in sizes if n]))
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
        except Exception as exc:   # the sender is gone: it retires its slots itself
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
