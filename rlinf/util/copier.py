"""Large copies split across threads.

One thread copies ~6 GB/s on our 2-vCPU test machines, well below what memory allows:
copying 8 MiB took 0.78-0.85 ms on one thread and 0.24-0.29 ms split between two; 16
MiB 2.5-2.6 ms against 1.3-1.6 ms (``np.copyto``, which releases the GIL). Below ~4 MiB
handing half to another thread costs more than it saves. So a copy of at least
:data:`SPLIT_BYTES` in all is cut into equal parts: the caller copies one and helper
threads the others, and the call returns when all are done.

Where it runs: the sender's copy into a shared-memory slot and the receiver's copy-out
of one (``shm_views=False``). Both already run off the event loop for large payloads,
and in both the peer is usually waiting, so the second CPU would otherwise idle.

``RLINF_COPY_THREADS`` (``Settings.copy_threads``, passed in as ``threads``) sets how
many threads one copy uses in all, the caller included (unset: :func:`default_threads`,
2 on a machine with 2 CPUs or more, else 1; ``1`` turns splitting off).

The same split serves other one-pass copies of ``(dst, src)`` pairs: :meth:`Copier.copy`
takes the function that copies a list of pairs (reads from another process's memory,
:mod:`rlinf.transports.cma`, pass theirs).

Each part is copied by :func:`copy_bytes`: pairs of :data:`STREAM_BYTES` or more with
streaming (non-temporal) stores, by the C extension ``rlinf.util._fastcopy`` (built at
install where a C compiler is found). glibc's ``memcpy`` streams only above a threshold
it derives from the last-level cache size, and a VM that reports the host's whole L3
(480 MiB here) puts it near 360 MiB: below it, every destination line is read before it
is written. Measured here (one thread, GB/s, ``np.copyto`` / streamed): data not in the
cache (a state dict's tensors, a message produced a while ago) 6.8 / 11.5 at 2 MiB, 7.2 /
13.2 at 32 MiB; the same buffers copied again and again (in the cache) 13.3 / 17.3 at 2
MiB, 14.3 / 13.8 at 32 MiB, but 28.3 / 22.4 at 1 MiB, which fits the 4 MiB L2: hence
the threshold. A 1 GiB state dict's 290 tensors pack on two threads in 85 ms with
``np.copyto``, 61 ms streamed (one 1 GiB copy: 50 ms).

Buffer lifetime: the copy has finished, in every part, when :meth:`Copier.copy` returns;
it keeps no reference to the arrays.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

try:
    from ._fastcopy import STREAMING as _STREAMING, copy as _stream_copy
except ImportError:          # not built (no C compiler at install): numpy copies everything
    _STREAMING, _stream_copy = False, None

__all__ = ["Copier", "SPLIT_BYTES", "STREAM_BYTES", "byte_view", "copy_bytes", "default_threads", "streaming",
           "wrote"]

#: Copies of fewer bytes in all run on the calling thread alone.
SPLIT_BYTES = 8 << 20
#: Parts are cut at multiples of this (whole pages; the distance between source and
#: destination addresses, which decides memcpy's speed, is the same in every part).
_GRAIN = 64 << 10

#: A copy of at least this many bytes streams past the cache (when :func:`streaming`).
STREAM_BYTES = 2 << 20

#: ``(dst, src)``: ``src`` is a 1-D uint8 array, or anything with ``nbytes`` that slices
#: like one (e.g. :class:`rlinf.transports.cma.Remote`).
Pair = tuple[np.ndarray, Any]


def default_threads() -> int:
    """Threads per copy, caller included, when none is set: 2, or 1 on a 1-CPU machine."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def split(pairs: Sequence[Pair], parts: int) -> list[list[Pair]]:
    """``pairs`` of equal-sized 1-D uint8 ``(dst, src)`` arrays, cut into at most
    ``parts`` lists of about the same number of bytes (each a list of sub-pairs)."""
    total = sum(src.nbytes for _, src in pairs)
    share = -(-total // parts)
    share = -(-share // _GRAIN) * _GRAIN
    out: list[list[Pair]] = [[]]
    room = share
    for dst, src in pairs:
        off, n = 0, src.nbytes
        while off < n:
            if room == 0:
                out.append([])
                room = share
            take = min(room, n - off)
            out[-1].append((dst[off:off + take], src[off:off + take]))
            off += take
            room -= take
    return out


def streaming() -> bool:
    """True where large copies use streaming stores (the C extension is built, x86-64)."""
    return bool(_STREAMING)


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (numpy arrays of the same shape), releasing the GIL:
    streamed past the cache from :data:`STREAM_BYTES` on where :func:`streaming`, else
    (also for arrays that are not C-contiguous) by ``np.copyto``."""
    if _STREAMING and src.nbytes >= STREAM_BYTES and dst.flags.c_contiguous and dst.flags.writeable \
            and src.flags.c_contiguous and dst.dtype == src.dtype and not dst.dtype.hasobject \
            and dst.shape == src.shape:       # (objects are references: never copied as bytes)
        _stream_copy(dst, src)
    else:
        np.copyto(dst, src)


def byte_view(x: Any, *, write: bool = False) -> np.ndarray | None:
    """A 1-D uint8 numpy view of the bytes of ``x`` (a numpy array or a torch tensor)
    when they are its values, contiguous in host memory, else None: a GPU, sparse,
    quantized or strided tensor, a conjugate or negative view, an array of objects.
    ``write``: the caller writes through the view (then calls :func:`wrote`); also None
    for what torch would refuse an in-place write to (an inference tensor outside
    inference mode), so that the caller's fallback raises torch's own error.

    Buffer lifetime: the view shares ``x``'s memory and keeps it alive."""
    if type(x).__module__.startswith("torch"):
        import torch

        if (x.layout is not torch.strided or x.is_quantized or x.device.type != "cpu" or not x.is_contiguous()
                or x.is_conj() or x.is_neg()):
            return None
        if write and ((x.is_inference() and not torch.is_inference_mode_enabled())
                      or not hasattr(torch.autograd.graph, "increment_version")):
            return None
        if not x.numel():
            return np.empty(0, np.uint8)
        return x.detach().reshape(-1).view(torch.uint8).numpy()
    if x.dtype.hasobject or not x.flags.c_contiguous:
        return None
    return x.reshape(-1).view(np.uint8)


def wrote(x: Any) -> None:
    """``x`` was written through ``byte_view(x, write=True)``: a torch tensor's version
    counter moves on as an in-place ``copy_`` moves it (autograd then refuses a backward
    through a graph that saved the old values); nothing for a numpy array."""
    if type(x).__module__.startswith("torch"):
        import torch

        torch.autograd.graph.increment_version(x)


def _copy_all(pairs: Sequence[Pair]) -> None:
    for dst, src in pairs:
        copy_bytes(dst, src)


class Copier:
    """Copies ``(dst, src)`` uint8 arrays, splitting large copies across threads.

    Thread-safe; the helper threads start on the first large copy. Call :meth:`close`
    when done (idempotent; later copies run on the caller's thread alone).

    Args:
        threads: threads per copy, the caller included (default :func:`default_threads`).
        split_bytes: copies of fewer bytes in all are not split.
    """

    def __init__(self, threads: int | None = None, *, split_bytes: int = SPLIT_BYTES) -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"a copy needs at least one thread, got {self.threads}")
        self.split_bytes = split_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Copier threads={self.threads} split_bytes={self.split_bytes}>"

    def copy(self, pairs: Sequence[Pair], fn: Callable[[Sequence[Pair]], None] = _copy_all) -> None:
        """Copy each ``src`` into its ``dst`` (of equal sizes) with ``fn(pairs)`` (by
        default :func:`copy_bytes` pair by pair), each part of a large copy on its own thread."""
        if self.threads == 1 or sum(src.nbytes for _, src in pairs) < self.split_bytes:
            fn(pairs)
            return
        pool = self._helpers()
        if pool is None:
            fn(pairs)
            return
        mine, *theirs = split(pairs, self.threads)
        futures: list[Future] = [pool.submit(fn, part) for part in theirs]
        try:
            fn(mine)
        finally:   # every part is done before we return, also when ours failed
            errors = [exc for exc in (future.exception() for future in futures) if exc is not None]
        if errors:
            raise errors[0]

    def _helpers(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="rlinf-copy")
            return self._pool

    def close(self) -> None:
        """Stop the helper threads once their current parts are done."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
