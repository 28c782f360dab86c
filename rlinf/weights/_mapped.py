"""A puller's mappings of the holders' buckets (same node), kept for reuse.

A holder reuses its buckets (the files stay, their contents change), so a puller keeps
the last few mappings it used: mapping and faulting in 1 GiB costs about as much as
copying it, and a mapping already faulted in shows each new version at no cost.
Mappings are copy-on-write (``MAP_PRIVATE``): a puller never writes into a holder's
memory, and the pages it only reads are the holder's own, so they show its later writes.

Buffer lifetime: an array returned by :meth:`Mappings.get` stays valid while referenced,
even after the mapping is evicted or the file unlinked (the pages live until then).
"""

from __future__ import annotations

import collections
import mmap
import os

import numpy as np

from ..transports.shm import SHM_DIR

__all__ = ["Mappings"]

_MADV_POPULATE_READ = 22


class Mappings:
    """The mapped buckets of one puller, least recently used evicted past ``keep``."""

    def __init__(self, keep: int = 4, directory: str = SHM_DIR) -> None:
        self.keep = keep
        self._dir = directory
        self._maps: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, segment: str, size: int) -> np.ndarray:
        """The holder's file ``segment``, all of it, as a uint8 array (at least ``size``
        bytes: its data, then its stamp, :func:`~rlinf.weights._buckets.read_stamp`).

        Raises:
            FileNotFoundError / OSError: the file is gone (its holder died) or is
                smaller than ``size`` (not a bucket of this version).
            ValueError: ``segment`` is not a plain file name.
        """
        if not segment or "/" in segment or segment.startswith("."):
            raise ValueError(f"not a segment name: {segment!r}")
        array = self._maps.get(segment)
        if array is not None and array.size >= size:
            self._maps.move_to_end(segment)
            return array
        fd = os.open(os.path.join(self._dir, segment), os.O_RDONLY | os.O_CLOEXEC)
        try:
            length = os.fstat(fd).st_size
            if length < size or size <= 0:
                raise OSError(f"segment {segment} has {length} bytes, the version needs {size}")
            mm = mmap.mmap(fd, length, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        try:
            mm.madvise(_MADV_POPULATE_READ)      # fault the pages in now, in one call
        except (OSError, ValueError, AttributeError):
            pass
        array = np.frombuffer(mm, np.uint8, length)
        self._maps[segment] = array
        while len(self._maps) > self.keep:
            self._maps.popitem(last=False)
        return array

    def close(self) -> None:
        """Drop every mapping (each is unmapped once no array over it is referenced)."""
        self._maps.clear()
