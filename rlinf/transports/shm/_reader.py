"""The receiver's side of :mod:`.shm`: mappings of senders' segments and views of their slots."""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import logging
import mmap
import os
import weakref
from typing import Callable, Hashable, Sequence

import numpy as np

from .. import descriptors
from ...util.bounded import Doubling
from ...errors import ClosedError, ProtocolError
from ._pagemap import written_runs
from ._common import SHM_DIR, SegmentGone, _PAGE, _POPULATE_MAX, _U8

log = logging.getLogger("rlinf.transports.shm")


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


_MAP_FIXED = 0x10      # Linux


@functools.cache
def _libc_mmap():
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return fn


def _remap_private(base: int, size: int, path: str) -> None:
    """Replace the shared mapping of ``path`` at ``base`` by a copy-on-write one, in
    place: same addresses and bytes, but this process's later writes stay its own.

    Raises:
        OSError: the file cannot be opened or mapped there.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        got = _libc_mmap()(base, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        if got != base:
            raise OSError(ctypes.get_errno(), f"cannot map {path} copy-on-write in place")
    finally:
        os.close(fd)


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
        self._live: dict[int, tuple[int, descriptors.SlotRef]] = {}
        self._bases: dict[str, int] = {}     # shared segment -> address of its mapping
        #: id(weak reference to a slot's exporter) -> (that reference, _released's arguments)
        self._watched: dict[int, tuple] = {}
        self._looked: dict[Hashable, Doubling] = {}   # when to look at a sender's segments again
        self._keys = itertools.count()
        self.closed = False

    def __repr__(self) -> str:
        return f"<ShmReader mapped={len(self._shared) + len(self._private)}{' closed' if self.closed else ''}>"

    def mapped_bytes(self, segment: str) -> int:
        """The size of our mapping of ``segment`` (0 if we have none)."""
        mm = self._shared.get(segment)
        if mm is None:
            mm = self._private.get(segment)
        try:
            return len(mm) if mm is not None else 0
        except ValueError:   # closed meanwhile
            return 0

    def open(self, src: Hashable, slot: descriptors.SlotRef, sizes: Sequence[int],
             pid: int | None = None) -> list[memoryview]:
        """Writable views of the buffers of ``sizes`` bytes in ``slot``, from ``src``.

        Args:
            pid: the sender's pid when known: the segment must be its own.

        Raises:
            ProtocolError: the slot is not ``src``'s, missing, or outside its segment.
        """
        offsets, end = descriptors.slot_layout(sizes)
        if end > slot.size:
            raise ProtocolError("buffers do not fit their slot")
        whole = self._export(src, slot, pid)
        return [whole[o:o + n] for o, n in zip(offsets, sizes)]

    def open_at(self, src: Hashable, slot: descriptors.SlotRef, places: Sequence[tuple[int, int]],
                pid: int | None = None) -> list[memoryview]:
        """Like :meth:`open`, for buffers at explicit ``(offset, nbytes)`` places in the
        slot (a relayed slot: see :mod:`._relay`)."""
        for offset, n in places:
            if offset + n > slot.size:
                raise ProtocolError("buffers do not fit their slot")
        whole = self._export(src, slot, pid)
        return [whole[o:o + n] for o, n in places]

    def _export(self, src: Hashable, slot: descriptors.SlotRef, pid: int | None) -> memoryview:
        """A view of the whole slot; when the last view derived from it is gone, the
        slot is released to ``src``."""
        if self.closed:
            raise ClosedError("shared-memory reader is closed")
        if pid is not None and slot.pid != pid:
            raise ProtocolError(f"{src} described a segment of another process ({slot.segment})")
        cache = self._private if slot.private else self._shared
        mm = cache.get(slot.segment)
        if mm is None:
            self._forget_removed(src)
            mm = cache[slot.segment] = self._map(slot)
            if not slot.private:
                self._bases[slot.segment] = np.frombuffer(mm, _U8, 0).ctypes.data
            self._by_peer[src].add(slot.segment)
            if self._on_map is not None:
                self._on_map(src, slot.segment)
        if slot.offset + slot.size > len(mm):
            raise ProtocolError(f"slot beyond the end of segment {slot.segment}")
        exporter = np.frombuffer(mm, _U8, slot.size, slot.offset)
        key = next(self._keys)
        if not slot.private:
            self._live[key] = (self._bases[slot.segment] + slot.offset, slot)
        # a weak reference with a callback, kept until it fires: a third of the cost of
        # weakref.finalize, which matters once per received message
        ref = weakref.ref(exporter, self._gone)
        self._watched[id(ref)] = (ref, src, slot, mm if slot.private else None, key)
        return memoryview(exporter)

    def _forget_removed(self, src: Hashable) -> None:
        """Drop the cached mappings of ``src``'s segments whose files are gone (unmapped
        once no view of them is left): a sender at its cap drops a free segment to make a
        new one, and retires the slots a departed reader held, and the cached mapping
        (shared or copy-on-write) would keep their memory in use for as long as the
        sender lives.

        Looked at when ``src`` sends a segment not seen before (that is when it may have
        dropped one), and only once its cached segments have doubled since the last look:
        stale mappings stay under the number of live ones, and a sender that keeps
        growing costs each of its segments O(1) checks in all."""
        names = self._by_peer.get(src)
        looked = self._looked.setdefault(src, Doubling())
        if not names or not looked.due(len(names)):
            return
        for name in list(names):
            if not os.path.exists(os.path.join(self._dir, name)):
                self._shared.pop(name, None)
                self._private.pop(name, None)
                self._bases.pop(name, None)
                names.discard(name)
        looked.looked(len(names))

    def _gone(self, ref: weakref.ref) -> None:
        watched = self._watched.pop(id(ref), None)
        if watched is not None:
            self._released(*watched[1:])

    @property
    def relayable(self) -> bool:
        """Whether any slot has live views that :meth:`locate` could find."""
        return bool(self._live)

    def privatize(self, segment: str, path: str) -> bool:
        """Make this process's shared mapping of ``segment`` copy-on-write in place (the
        views into it keep their addresses and bytes): done before its slot is relayed
        (:mod:`._relay`), so that what this process writes after the send returns never
        reaches the file the receiver reads. A new shared mapping of the file takes its
        place in the cache, for the segment's later messages (the sender counts on a
        reader that mapped a segment keeping it mapped: it may unlink the file once the
        reader said so); the views of the old one can no longer be relayed. ``path``
        names the file (our link to it). False if it could not be done."""
        mm = self._shared.get(segment)
        if mm is None:
            return False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:     # not populated: this process seldom touches a slot it relays
                fresh = mmap.mmap(fd, len(mm), flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            _remap_private(self._bases[segment], len(mm), path)
        except OSError as exc:
            log.debug("rlinf: cannot make %s copy-on-write: %s", segment, exc)
            return False
        self._shared[segment] = fresh
        self._bases[segment] = np.frombuffer(fresh, _U8, 0).ctypes.data
        for key in [k for k, (_, slot) in self._live.items() if slot.segment == segment]:
            del self._live[key]
        return True

    def locate(self, address: int, nbytes: int) -> tuple[descriptors.SlotRef, int] | None:
        """The shared (not copy-on-write) slot with live views that holds the ``nbytes``
        at ``address``, and their offset in it; None if no such slot does."""
        for start, slot in list(self._live.values()):
            if start <= address and address + nbytes <= start + slot.size:
                return slot, address - start
        return None

    def _map(self, slot: descriptors.SlotRef) -> mmap.mmap:
        path = os.path.join(self._dir, slot.segment)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise SegmentGone(f"cannot open shared-memory segment {slot.segment}: {exc} (is the sender's "
                                f"{self._dir} ours? Processes that do not share it need different node ids: "
                                "RLINF_NODE_ID)") from exc
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

    def _released(self, src: str, slot: descriptors.SlotRef, private_map: mmap.mmap | None, key: int) -> None:
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
        self._looked.pop(src, None)
        for name in names:
            self._shared.pop(name, None)
            self._private.pop(name, None)
            self._bases.pop(name, None)
        return {descriptors.parse_segment_name(name) for name in names}

    def close(self) -> None:
        """Stop reporting releases and drop the mappings' cache. Idempotent."""
        self.closed = True
        self._shared.clear()
        self._private.clear()
        self._bases.clear()
        self._by_peer.clear()
        self._live.clear()
