"""Torch tensors already in shared memory, passed by handle instead of copied.

A CPU tensor whose storage torch placed in shared memory with its default
``file_descriptor`` strategy (``tensor.share_memory_()``, or a tensor received through
``torch.multiprocessing``) is backed by an unlinked file that its process holds open.
rlinf sends such a buffer by reference: the message names the sender's file descriptor,
the file's identity (device and inode) and size, and the buffer's place in the file
(a :class:`rlinf.transports.descriptors.FdRef`). The receiver opens ``/proc/<sender pid>/fd/<fd>``, checks
that it is that regular file, maps it shared and hands out views. No byte is copied.

Semantics: as with ``torch.multiprocessing``, sender and receiver then share the
tensor's memory, so a write by either after the send is seen by the other. Tensors in
ordinary memory, or shared with the ``file_system`` strategy, are copied as usual.

Lifetimes:

* **Sender** (:class:`FdShares`). A send returns at once; the tensors are *held* (kept
  alive, so their descriptors stay open and name the same files) until the receiver
  reports that it has mapped them, or leaves.
* **Receiver** (:class:`FdMaps`). Mappings are cached by file identity, so sending the
  same storage again costs no system call and no page fault: its pages are already in
  the receiver's page tables. The cache is bounded (``RLINF_SHM_FD_CACHE`` bytes,
  default 2 GiB, passed in as ``cap``; least recently used goes first) and forgets a sender that leaves. A
  cached mapping keeps the file's memory alive after the sender freed the tensor; views
  handed out stay valid for as long as they (or tensors over them) are referenced, even
  after their mapping left the cache. An identity is unique while a mapping of it exists,
  so a cache hit always names the file the sender meant.

``RLINF_SHM_FD=0`` turns the handle path off (every tensor is then copied): the session
then makes no :class:`FdShares`.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import stat
from typing import Any, Hashable, Sequence

from ...config import DEFAULTS
from .. import descriptors
from ...errors import ProtocolError
from ._common import _POPULATE_MAX

__all__ = ["FdShares", "FdMaps", "SharedStorage", "shared_storages", "FD_RELEASE"]

log = logging.getLogger("rlinf.transports.shm")

#: The segment name of a release that drops an :class:`FdShares` hold.
FD_RELEASE = "fd"
#: Bytes of mappings a receiver keeps cached (``RLINF_SHM_FD_CACHE``'s default).
DEFAULT_FD_CACHE = DEFAULTS.shm_fd_cache


class SharedStorage:
    """A torch storage in a shared file of this process: ``[start, end)`` addresses."""

    __slots__ = ("start", "end", "fd", "storage")

    def __init__(self, start: int, end: int, fd: int, storage: Any) -> None:
        self.start, self.end, self.fd, self.storage = start, end, fd, storage


def shared_storages(buffers: Sequence[Any]) -> list[SharedStorage]:
    """The fd-shared torch storages behind ``buffers`` (as the codec encoded them).

    The codec slices each CPU tensor's bytes out of one per-message view that lists the
    message's tensors (``_rlinf_owners``); this reads that list. Nothing is changed:
    ``_get_shared_fd`` only reports the descriptor torch already holds (unlike
    ``_share_fd_cpu_``, which would move a ``file_system`` storage).
    """
    owners = None
    for b in buffers:
        if type(b) is memoryview:
            owners = getattr(b.obj, "_rlinf_owners", None)
            if owners is not None:
                break
    if not owners:
        return []
    found: list[SharedStorage] = []
    seen: set[int] = set()
    for t in owners:
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start in seen or not storage.is_shared():
            continue
        seen.add(start)
        try:
            fd = storage._get_shared_fd()
        except RuntimeError:    # shared, but not through a file descriptor of ours
            continue
        found.append(SharedStorage(start, start + storage.nbytes(), fd, storage))
    return found


class FdShares:
    """The sender's side: references to shared storages, and the holds on them."""

    def __init__(self) -> None:
        self._holds: dict[tuple[str, int], list] = {}
        self._ids = 0

    def __repr__(self) -> str:
        return f"<FdShares holds={len(self._holds)}>"

    @property
    def holds(self) -> int:
        return len(self._holds)

    def reference(self, shared: SharedStorage, dst: str) -> list:
        """The wire form of ``shared`` for ``dst`` (see :class:`rlinf.transports.descriptors.FdRef`),
        holding the storage until ``dst`` releases it.

        Raises:
            OSError: the descriptor cannot be inspected (the caller copies instead).
        """
        st = os.fstat(shared.fd)
        self._ids += 1
        self._holds[(dst, self._ids)] = [shared.storage]
        return [shared.fd, st.st_dev, st.st_ino, st.st_size, self._ids]

    def release(self, reader: str, segment: Any, hold_id: Any) -> bool:
        """``reader`` mapped hold ``hold_id``; False if it names no hold of ours."""
        if segment != FD_RELEASE or type(hold_id) is not int:
            return False
        return self._holds.pop((reader, hold_id), None) is not None

    def unconfirmed(self) -> list[str]:
        """Receivers still to map a held file (what closing waits for)."""
        return sorted({dst for dst, _ in self._holds})

    def reader_gone(self, reader: str) -> None:
        for key in [k for k in self._holds if k[0] == reader]:
            del self._holds[key]

    def close(self) -> None:
        self._holds.clear()


class FdMaps:
    """The receiver's side: mappings of senders' shared files, cached by identity.

    Args:
        cap: bytes of mappings kept cached (``RLINF_SHM_FD_CACHE``; default
            :data:`DEFAULT_FD_CACHE`, 2 GiB).
    """

    def __init__(self, cap: int = DEFAULT_FD_CACHE) -> None:
        self.cap = cap
        self._maps: collections.OrderedDict[tuple[int, int], tuple[mmap.mmap, Hashable]] = \
            collections.OrderedDict()
        self._bytes = 0

    def __repr__(self) -> str:
        return f"<FdMaps cached={len(self._maps)} bytes={self._bytes}>"

    def open(self, src: Hashable, ref: descriptors.FdRef, places: Sequence[tuple[int, int]],
             pid: int | None) -> list[memoryview]:
        """Writable views of ``places`` (``(offset, nbytes)``) in the file ``ref`` names.

        Raises:
            ProtocolError: the sender's pid is unknown, or the file cannot be opened or
                is not the one described.
        """
        key = (ref.dev, ref.ino)
        cached = self._maps.get(key)
        if cached is not None and len(cached[0]) >= ref.size:
            self._maps.move_to_end(key)
            mm = cached[0]
        else:
            mm = self._map(src, ref, pid)
        whole = memoryview(mm)
        return [whole[o:o + n] for o, n in places]

    def _map(self, src: Hashable, ref: descriptors.FdRef, pid: int | None) -> mmap.mmap:
        if pid is None:
            raise ProtocolError(f"cannot open a shared tensor of {src}: its pid is unknown")
        path = f"/proc/{pid}/fd/{ref.fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(f"cannot open a shared tensor of {src} ({path}): {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (ref.dev, ref.ino) \
                    or st.st_size < ref.size:
                raise ProtocolError(f"{src} described a shared tensor that {path} is not")
            populate = getattr(mmap, "MAP_POPULATE", 0) if ref.size <= _POPULATE_MAX else 0
            mm = mmap.mmap(fd, ref.size, flags=mmap.MAP_SHARED | populate)
        except OSError as exc:
            raise ProtocolError(f"cannot map a shared tensor of {src}: {exc}") from exc
        finally:
            os.close(fd)
        self._remember((ref.dev, ref.ino), mm, src)
        return mm

    def _remember(self, key: tuple[int, int], mm: mmap.mmap, src: Hashable) -> None:
        old = self._maps.pop(key, None)
        if old is not None:
            self._bytes -= len(old[0])
        if len(mm) > self.cap:
            return    # used once, never cached
        self._maps[key] = (mm, src)
        self._bytes += len(mm)
        while self._bytes > self.cap:
            _, (evicted, _src) = self._maps.popitem(last=False)
            self._bytes -= len(evicted)

    def peer_gone(self, src: Hashable) -> None:
        """Forget ``src``'s files (views already handed out stay valid)."""
        for key in [k for k, (_, s) in self._maps.items() if s == src]:
            self._bytes -= len(self._maps.pop(key)[0])

    def close(self) -> None:
        self._maps.clear()
        self._bytes = 0
