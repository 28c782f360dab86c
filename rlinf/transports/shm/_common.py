"""Shared-memory settings and helpers used by every part of :mod:`.shm`."""

from __future__ import annotations

import logging
import mmap
import os
import sys

import numpy as np

from ...config import DEFAULTS
from ...errors import ProtocolError
from ..leftovers import SHM_DIR, owned_by, remove


log = logging.getLogger("rlinf.transports.shm")

#: Smallest slot (smaller payloads are rounded up to it).
MIN_SLOT = 64 << 10
#: Copies of at least this many bytes run in an executor thread (``RLINF_SHM_OFFLOAD``'s
#: default, 16 MiB; the communicator passes the setting).
DEFAULT_OFFLOAD = DEFAULTS.shm_offload
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23
_U8 = np.uint8
_NUMPY_COPY = 1 << 20
_POPULATE_MAX = 256 << 20



class SegmentGone(ProtocolError):
    """A sender's shared-memory segment named by a descriptor no longer exists: its
    sender took the memory back (it took us for lost, or it is gone and was swept), so
    the message in it is lost, not malformed."""

def available(directory: str = SHM_DIR) -> bool:
    """True when shared memory can be used here (Linux with a writable ``/dev/shm``)."""
    return sys.platform.startswith("linux") and os.path.isdir(directory) and os.access(directory, os.W_OK)


def default_cap(directory: str = SHM_DIR) -> int:
    """The cap of a pool when ``RLINF_SHM_CAP`` is unset: min(4 GiB, half of ``directory``)."""
    try:
        st = os.statvfs(directory)
        return min(4 << 30, st.f_frsize * st.f_blocks // 2)
    except OSError:
        return 0


def sweep(pid: int, directory: str = SHM_DIR) -> int:
    """Unlink every segment of process ``pid`` of this PID namespace (call only once it is
    gone). Returns the count."""
    return sum(remove(path) for path in owned_by(pid, directory))


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
