"""The sender's side of :mod:`.shm`: pooled slots, and the receiver's recycled private memory."""

from __future__ import annotations

import atexit
import ctypes
import itertools
import logging
import mmap
import os
import secrets
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from .. import leftovers
from .. import descriptors
from ...util.copier import Copier, copy_bytes
from ...util.memory import page_aligned
from ._common import default_cap, SHM_DIR, _NUMPY_COPY, _prefault, _slot_size, _U8

log = logging.getLogger("rlinf.transports.shm")


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
        """A private uint8 array of ``n`` bytes; its memory is reused once neither it nor
        any array or view derived from it is referenced.

        The array's base is a per-call owner object (a ctypes array over the recycled
        buffer) that carries the finalizer: numpy points every view derived from the
        array at that owner, never at the recycled buffer itself (a plain slice
        ``buf[:n]`` would be skipped that way, and its memory handed out again while
        a view of it lived).
        """
        if n <= 0:
            return np.empty(0, _U8)
        size = _slot_size(n)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._kept -= size
        if buf is None:
            buf = page_aligned(size)   # not np.empty: see rlinf.util.memory
        owner = (ctypes.c_uint8 * n).from_buffer(buf)
        weakref.finalize(owner, self._give_back, buf).atexit = False
        return np.frombuffer(owner, _U8, n)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.size <= self.limit:
                self._free.setdefault(buf.size, []).append(buf)
                self._kept += buf.size

    def copy(self, buffers: Sequence[Any], copier: Copier | None = None) -> list[memoryview]:
        """Owned copies of ``buffers``, all in one recycled buffer (one copy each); the
        large ones by ``copier`` when given (see :func:`copy_into`)."""
        views = [b if type(b) is memoryview else memoryview(b) for b in buffers]
        sizes = [v.nbytes for v in views]
        offsets, end = descriptors.slot_layout(sizes)
        dst = self.take(end)
        copy_into(dst, views, offsets, copier)
        whole = memoryview(dst)
        return [whole[o:o + n] for o, n in zip(offsets, sizes)]


def copy_into(dst: np.ndarray, buffers: Sequence[Any], offsets: Sequence[int], copier: Copier | None = None) -> None:
    """Copy ``buffers`` into the uint8 array ``dst`` at ``offsets`` (thread-safe).

    Buffers of 1 MiB and more are copied by :func:`~rlinf.util.copier.copy_bytes`,
    which releases the GIL and streams the large ones (by ``copier`` when given: split
    across threads once they add up to enough), smaller ones by a memoryview
    assignment, which costs a third as much per call."""
    whole = memoryview(dst)
    large = []
    for buf, off in zip(buffers, offsets):
        mv = buf if type(buf) is memoryview else memoryview(buf)
        n = mv.nbytes
        if n >= _NUMPY_COPY:
            large.append((dst[off:off + n], np.frombuffer(mv, _U8)))
        elif n:
            whole[off:off + n] = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    if copier is not None:
        copier.copy(large)
    else:
        for d, src in large:
            copy_bytes(d, src)


def copy_out(buffers: Sequence[Any]) -> list:
    """Owned copies of ``buffers`` in fresh memory (one copy each)."""
    return Recycler(0).copy(buffers)


class _Slot:
    __slots__ = ("name", "path", "mm", "array", "size", "generation", "readers", "private", "confirmed")

    def __init__(self, name: str, path: str, mm: mmap.mmap, size: int) -> None:
        self.name, self.path, self.mm, self.size = name, path, mm, size
        self.array = np.frombuffer(mm, _U8, size)
        self.generation = 0
        self.readers: dict[str, int] = {}
        self.private = False
        self.confirmed: set[str] = set()      # readers known to have mapped the file

    def ref(self) -> descriptors.SlotRef:
        return descriptors.SlotRef(self.name, os.getpid(), 0, self.size, self.generation, self.private)

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
        self._prefix = f"{leftovers.prefix()}{secrets.token_hex(4)}-"
        self._seq = itertools.count()
        self._generations = itertools.count(1)
        self._free: dict[int, list[_Slot]] = {}
        self._busy: dict[str, _Slot] = {}
        self.links: set[str] = set()   # paths of our names for other processes' segments
        self.mapped = 0
        self.created = 0      # segments ever created (the rest of the exports reused one)
        self.exports = 0
        self.fallbacks = 0
        #: reader -> ``[slots, bytes]`` it holds now (see :meth:`held`).
        self._held: dict[str, list[int]] = {}
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

    def holding(self, reader: str) -> bool:
        """Whether ``reader`` holds any of our slots now."""
        return reader in self._held

    def held(self, reader: str) -> tuple[int, int]:
        """``(slots, bytes)`` that ``reader`` holds now: sent to it and not yet released."""
        held = self._held.get(reader)
        return (held[0], held[1]) if held else (0, 0)

    def _hold(self, slot: _Slot, reader: str, sign: int) -> None:
        held = self._held.get(reader)
        if held is None:
            held = self._held[reader] = [0, 0]
        held[0] += sign
        held[1] += sign * slot.size
        if held[0] <= 0:
            del self._held[reader]

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
        for reader in readers:
            self._hold(slot, reader, 1)
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
    def fill(slot: _Slot, buffers: Sequence[Any], offsets: Sequence[int], copier: Copier | None = None) -> None:
        """Copy ``buffers`` into ``slot`` at ``offsets`` (thread-safe; see :func:`copy_into`)."""
        copy_into(slot.array, buffers, offsets, copier)

    def cancel(self, slot: _Slot) -> None:
        """Give back a slot whose message was never sent."""
        if self._busy.pop(slot.name, None) is slot:
            for reader in slot.readers:
                self._hold(slot, reader, -1)
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
            self._hold(slot, reader, -1)
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

    def reader_gone(self, reader: str) -> set[str]:
        """``reader`` left or died: retire the slots it held (unlinked, never reused).
        Returns the other readers of those slots (they hold fewer now)."""
        retired = [s for s in self._busy.values() if reader in s.readers]
        others: set[str] = set()
        for slot in retired:
            del self._busy[slot.name]
            for other in slot.readers:
                self._hold(slot, other, -1)
                others.add(other)
            self._drop(slot)
        others.discard(reader)
        return others

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
        self._held.clear()
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
