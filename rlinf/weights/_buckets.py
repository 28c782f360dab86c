"""A holder's buckets: shared-memory files that versions are captured into, reused.

A bucket is a file in ``/dev/shm`` named after its process (``rlinf-<pid>-...``, so the
survivors sweep it if the process dies; ``atexit`` and :meth:`Buckets.close` unlink it
otherwise), reserved with ``posix_fallocate`` (a full ``/dev/shm`` fails here, not with a
SIGBUS later), mapped once and pre-faulted. Creating one costs about as much as
writing it (1 GiB: a few hundred ms), so it runs in a thread (:meth:`Buckets.take` is a
coroutine), and buckets are kept for reuse: writing into pages already mapped runs
several times faster than into fresh ones.

Every fill of a bucket is *stamped*: a random 64-bit value in the file's last 8 bytes,
written before the bucket is filled (:meth:`Buckets.take`) and carried with the
version's reference. A puller reading another process's bucket checks the stamp after
copying (:func:`read_stamp`): a different one means the bucket was reused meanwhile (its
version was freed under it, as when the store's directory left), so the copy may be
torn and the pull fails instead of returning it.

A bucket whose bytes are still being sent (zero-copy views of it in messages not yet
written out, :meth:`Buckets.reading`) is not reused when given back: it is kept aside
and freed once the last of those sends is done.

Bookkeeping is on the event loop's thread; only the creation runs elsewhere.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import mmap
import os
import secrets
import weakref

import numpy as np

from ..errors import RlinfError
from ..transports import leftovers
from ..transports.shm import SHM_DIR

__all__ = ["Bucket", "Buckets", "read_stamp", "STAMP"]

_MADV_POPULATE_WRITE = 23
#: A free bucket up to this factor larger than asked is reused rather than a new one made.
_SLACK = 1.25
_KEEP_FREE = 2
#: Bytes at the end of every bucket that hold its stamp.
STAMP = 8


def read_stamp(mapped: np.ndarray) -> int:
    """The stamp of a bucket mapped whole as ``mapped`` (uint8, the file's full length)."""
    return int(mapped[-STAMP:].view(np.uint64)[0])


class Bucket:
    """One shared-memory file: ``name`` (in ``/dev/shm``), ``size`` bytes, ``array`` (uint8,
    the whole file), ``stamp`` (of its current fill, in the last :data:`STAMP` bytes)."""

    __slots__ = ("name", "path", "size", "array", "stamp", "_mm")

    def __init__(self, name: str, path: str, size: int, mm: mmap.mmap) -> None:
        self.name, self.path, self.size, self._mm = name, path, size, mm
        self.array = np.frombuffer(mm, np.uint8, size)
        self.stamp = 0

    def restamp(self) -> None:
        """A new fill begins: a fresh stamp, written before any of the fill's bytes."""
        self.stamp = (int.from_bytes(os.urandom(STAMP), "little") >> 1) | 1     # fits an int64 on the wire
        self.array[-STAMP:].view(np.uint64)[0] = self.stamp

    def __repr__(self) -> str:
        return f"<Bucket {self.name} {self.size} bytes>"


def _create(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):        # kernels before 5.14: touch every page instead
        np.frombuffer(mm, np.uint8, size)[::mmap.PAGESIZE] = 0
    return mm


_ALL: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _unlink_at_exit() -> None:
    for buckets in list(_ALL):
        buckets.close()


class Buckets:
    """The buckets of one holder: :meth:`take` one (free or new), :meth:`give` it back."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self._dir = directory
        self._prefix = f"{leftovers.prefix()}w{secrets.token_hex(3)}-"
        self._seq = itertools.count()
        self._free: list[Bucket] = []
        self._all: dict[str, Bucket] = {}
        self._reading: collections.Counter = collections.Counter()   # bucket name -> sends in flight
        self._parked: dict[str, Bucket] = {}          # given back while sent from: freed after
        self.closed = False
        _ALL.add(self)

    def __repr__(self) -> str:
        return (f"<Buckets {len(self._all)} ({sum(b.size for b in self._all.values()) >> 20} MiB), "
                f"{len(self._free)} free>")

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held (free buckets included)."""
        return sum(b.size for b in self._all.values())

    def __len__(self) -> int:
        return len(self._all)

    async def take(self, nbytes: int) -> Bucket:
        """A bucket of at least ``nbytes`` (plus its stamp), freshly stamped: a free one
        that fits, else a new one (made in a thread; the free ones that do not fit are
        dropped first).

        Raises:
            RlinfError: no room in ``/dev/shm`` for it. ClosedError-like RlinfError when closed.
        """
        if self.closed:
            raise RlinfError("the weight store's holder is closed")
        size = -(-(nbytes + STAMP) // mmap.PAGESIZE) * mmap.PAGESIZE
        fits = [b for b in self._free if size <= b.size <= size * _SLACK]
        if fits:
            bucket = min(fits, key=lambda b: b.size)
            self._free.remove(bucket)
            bucket.restamp()
            return bucket
        for stale in self._free:        # another size: make room for the new one
            self._drop(stale)
        self._free.clear()
        name = f"{self._prefix}{next(self._seq)}"
        path = os.path.join(self._dir, name)
        made = asyncio.get_running_loop().run_in_executor(None, _create, path, size)
        try:
            mm = await asyncio.shield(made)
        except OSError as exc:
            raise RlinfError(f"no room for a {size}-byte weight bucket in {self._dir} ({exc}; this process "
                             f"holds {self.nbytes >> 20} MiB of buckets)") from exc
        except asyncio.CancelledError:   # it is made all the same: keep it (or unlink it)
            made.add_done_callback(lambda f: self._adopt(f, name, path, size))
            raise
        bucket = self._adopt(made, name, path, size)
        if bucket is None:
            raise RlinfError("the weight store's holder is closed")
        self._free.remove(bucket)
        bucket.restamp()
        return bucket

    def _adopt(self, made: asyncio.Future, name: str, path: str, size: int) -> Bucket | None:
        """A new bucket's file is ready: track it (free), or unlink it if closed."""
        if made.cancelled() or made.exception() is not None:
            return None
        bucket = Bucket(name, path, size, made.result())
        self._all[name] = bucket
        if self.closed:
            self._drop(bucket)
            return None
        self._free.append(bucket)
        return bucket

    def reading(self, bucket: Bucket, send: asyncio.Future) -> None:
        """``send`` (a message holding a view of ``bucket``) reads it until it is done:
        a :meth:`give` meanwhile takes effect only once every such send is done."""
        self._reading[bucket.name] += 1
        send.add_done_callback(lambda _: self._read(bucket))

    def _read(self, bucket: Bucket) -> None:
        self._reading[bucket.name] -= 1
        if self._reading[bucket.name] <= 0:
            del self._reading[bucket.name]
            parked = self._parked.pop(bucket.name, None)
            if parked is not None:
                self.give(parked)

    def give(self, bucket: Bucket) -> None:
        """``bucket`` holds no version any more: keep it for the next one (two at most
        are kept free: a steady publisher needs one, a slow reader's release a second),
        once no send reads it (:meth:`reading`)."""
        if self._all.get(bucket.name) is not bucket:
            return
        if self._reading[bucket.name]:
            self._parked[bucket.name] = bucket
            return
        if len(self._free) >= _KEEP_FREE:
            self._drop(bucket)
        else:
            self._free.append(bucket)

    def _drop(self, bucket: Bucket) -> None:
        self._all.pop(bucket.name, None)
        try:
            os.unlink(bucket.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink every bucket (pullers' mappings stay valid until they drop them). Idempotent."""
        self.closed = True
        for bucket in list(self._all.values()):
            self._drop(bucket)
        self._free.clear()
        self._parked.clear()
