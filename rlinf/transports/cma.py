"""Reading another process's memory directly: Linux cross-memory attach (CMA).

``process_vm_readv(2)`` copies from another process's address space into ours in one
pass, with no shared file in between. A receiver that wants owned copies
(``shm_views=False``) uses it to *pull* a same-node message's large buffers straight
from the sender's memory: one copy instead of two (into a shared-memory slot, then
out of it). See :mod:`._pull` for the protocol around it.

The kernel allows it only where the reader may ptrace the sender: same user, and, under
Yama's ``ptrace_scope`` >= 1 or a seccomp filter, often not at all. So nothing is
assumed: :func:`verify` proves, per sender, that we can read it, and that the pid we
read names the sender (a 16-byte random cookie at an address the sender gave). The
verified process is held by a pidfd, so a pid that was reused after the sender died is
never read as if it were the sender: every read ends with a check that the pidfd's
process is still alive (it was, then, during the whole read).

Buffer lifetime: :meth:`Process.read` has copied everything when it returns; the
sender must keep the remote buffers unchanged until then (the pull protocol holds them
until the reader says so).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import sys
import threading
from typing import Sequence

import numpy as np

__all__ = ["available", "Remote", "Process", "Cookie", "verify", "address_of"]

#: Most iovecs one call takes (``IOV_MAX`` on Linux).
_IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_call():
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _libc_call()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` and pidfds (Linux >= 5.3), on
    x86-64. Whether a given sender may be read is another matter: see :func:`verify`.

    x86-64 only: the pull protocol (:mod:`._pull`) relies on its store ordering (the
    sender zeroes a token, then its caller may write the buffers; the receiver reads the
    buffers, then the token) without explicit fences, which other architectures need."""
    return _readv is not None and platform.machine() in ("x86_64", "AMD64")


def address_of(buffer) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return np.frombuffer(buffer, np.uint8).ctypes.data


class Remote:
    """``nbytes`` at ``address`` in another process; sliceable like a 1-D uint8 array (so
    :func:`rlinf.util.copier.split` can cut a read into parts)."""

    __slots__ = ("address", "nbytes")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<Remote {self.nbytes} bytes at {self.address:#x}>"

    def __getitem__(self, part: slice) -> Remote:
        start, stop, step = part.indices(self.nbytes)
        if step != 1:
            raise ValueError("a remote range is contiguous")
        return Remote(self.address + start, max(0, stop - start))


class Cookie:
    """The sender's proof of identity: 16 random bytes at a fixed address of this
    process, for as long as the cookie lives."""

    def __init__(self) -> None:
        self._bytes = np.frombuffer(bytearray(os.urandom(16)), np.uint8)
        self.value = self._bytes.tobytes()
        self.address = self._bytes.ctypes.data


class Process:
    """A verified peer process (see :func:`verify`), held by a pidfd. Thread-safe."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<cma.Process pid={self.pid} {'closed' if self._pidfd < 0 else 'open'}>"

    def alive(self) -> bool:
        """Whether the verified process has not exited (and :meth:`close` was not called)."""
        with self._lock:
            if self._pidfd < 0:
                return False
            poller = select.poll()     # not select(): pidfds may be numbered past 1023
            poller.register(self._pidfd, select.POLLIN)
            return not poller.poll(0)

    def read(self, pairs: Sequence[tuple[np.ndarray, Remote]]) -> None:
        """Copy each :class:`Remote` into its ``dst`` (1-D uint8 arrays, equal sizes).

        Raises:
            ProcessLookupError: the process exited (or was closed) before the read ended.
            OSError: the kernel refused the read (``errno`` says why).
        """
        pairs = [(d, r) for d, r in pairs if r.nbytes]
        for start in range(0, len(pairs), _IOV_MAX):
            chunk = pairs[start:start + _IOV_MAX]
            local = (_Iovec * len(chunk))(*[(d.ctypes.data, d.nbytes) for d, _ in chunk])
            remote = (_Iovec * len(chunk))(*[(r.address, r.nbytes) for _, r in chunk])
            want = sum(r.nbytes for _, r in chunk)
            got = _readv(self.pid, local, len(chunk), remote, len(chunk), 0)
            if got != want:
                code = ctypes.get_errno() if got < 0 else errno.EFAULT
                if not self.alive():
                    raise ProcessLookupError(errno.ESRCH, f"process {self.pid} exited during the read")
                raise OSError(code, f"process_vm_readv from pid {self.pid}: {os.strerror(code)} "
                                    f"({max(got, 0)} of {want} bytes)")
        if not self.alive():
            raise ProcessLookupError(errno.ESRCH, f"process {self.pid} exited during the read")

    def close(self) -> None:
        """Forget the process (idempotent); reads fail from now on."""
        with self._lock:
            fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)


def verify(pid: int, address: int, cookie: bytes) -> Process:
    """Prove that we may read process ``pid`` and that it is the one that put ``cookie``
    at ``address``: the process, held by a pidfd.

    Raises:
        OSError: it cannot be read (no such process, ptrace not allowed, another pid
            namespace, ...), or the bytes there are not ``cookie``.
    """
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    if len(cookie) < 8:
        raise ValueError(f"a cookie of {len(cookie)} bytes proves nothing")
    pidfd = os.pidfd_open(pid)     # first: the cookie read next proves the pidfd's process
    process = Process(pid, pidfd)
    try:
        got = np.zeros(len(cookie), np.uint8)
        process.read([(got, Remote(address, len(cookie)))])
        if got.tobytes() != cookie:
            raise OSError(errno.EINVAL, f"process {pid} is not the sender (its cookie differs)")
    except BaseException:
        process.close()
        raise
    return process
