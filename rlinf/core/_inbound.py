"""A received frame set's entries, with their buffers rebuilt wherever they travelled.

The data plane carries a message's buffers in one of six ways (see :mod:`rlinf.core.wire`):
inside one packed blob shared by coalesced small messages, as payload frames (a large
buffer as several chunks), in the sender's shared-memory slot, in another process's
slot relayed by the sender, in the sender's own memory for us to pull, or (GPU buffers)
in the sender's CUDA IPC slot.
:class:`FrameReader` turns each entry back into a list of buffers, so that the
communicator only delivers messages.

Buffer lifetime: buffers are views of the received frames, of the packed blob, or of
shared memory (valid, and the slot kept busy, for as long as they or anything decoded
over them is referenced); chunked buffers are joined into recycled private memory,
which is reused once nothing references it. GPU buffers are views of the sender's CUDA
IPC slot, which goes back to it once they are all garbage-collected. Pulled buffers are
recycled private memory, filled once their entry's ``pulling`` future is done.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterator, NamedTuple

import numpy as np

from . import wire
from ..errors import ClosedError, DecodeError, PeerLostError, ProtocolError
from ..transports import shm

__all__ = ["FrameReader", "Rebuilt"]

log = logging.getLogger("rlinf.core.communicator")

_NO_BYTES = memoryview(b"")

class Rebuilt(NamedTuple):
    """One received entry with its buffers rebuilt."""

    entry: wire.Entry
    buffers: list
    nbytes: int
    #: some buffers are views of a sender's shared memory (held until garbage-collected)
    in_shm: bool
    #: a DecodeError when its shared memory could not be opened (its buffers are missing)
    error: DecodeError | None
    #: GPU buffers from CUDA IPC: orders the decoding thread's stream after their copy
    ready: Callable[[], None] | None
    #: a future, done once pulled buffers hold their data
    pulling: asyncio.Future | None


class FrameReader:
    """Rebuilds the buffers of received entries.

    Args:
        session: the communicator's shared-memory session, or None without shared memory.
        recycler: private memory for chunked buffers.
        pid_of: ``pid_of(address)``: the sender's pid when known (its slots must be its own).
        on_bad_slot: called once per entry whose shared memory could not be opened.
        open_gpu: ``open_gpu(src, incarnation, gpu)`` returns an entry's device buffers as
            ``(index, buffer)`` pairs and their ``ready()`` (see
            :meth:`~rlinf.transports.cuda.ipc.CudaIpcReader.open`).
        refuse_gpu: ``refuse_gpu(src, incarnation, gpu)`` gives back the GPU slot of an
            entry whose other buffers could not be read.
        pull: the communicator's pulls (:class:`~rlinf.transports.shm.PullSession`), or None.
    """

    def __init__(self, session: shm.ShmSession | None, recycler: shm.Recycler,
                 pid_of: Callable[[str], int | None], on_bad_slot: Callable[[], None],
                 open_gpu: Callable[[str, str, wire.GpuRef], tuple] | None = None,
                 refuse_gpu: Callable[[str, str, wire.GpuRef], None] | None = None,
                 pull: shm.PullSession | None = None) -> None:
        self._shm = session
        self._pull = pull
        self._recycler = recycler
        self._pid_of = pid_of
        self._on_bad_slot = on_bad_slot
        self._open_gpu = open_gpu
        self._refuse_gpu = refuse_gpu

    def entries(self, src: str, entries: list[wire.Entry], frames: list, packed: bool,
                incarnation: str = "") -> Iterator[Rebuilt]:
        """Each entry of a validated frame set (:func:`rlinf.core.wire.unpack_header`) from
        ``src`` (``incarnation``), in order."""
        i = 0
        blob = (frames[0] if frames else _NO_BYTES) if packed else None
        for entry in entries:
            buffers, nbytes, error, ready, pulling = [], 0, None, None, None
            in_slot = relayed = None
            if entry.pull is not None:    # its negative counts are read from the sender's memory
                try:
                    pulled, pulling = self._open_pull(src, incarnation, entry)
                    in_slot = iter(pulled)
                except ProtocolError as exc:
                    self._on_bad_slot()
                    log.warning("rlinf: bad pull descriptor from %s: %r", src, exc)
                    error = DecodeError(f"message from {src} cannot be pulled: {exc}")
            elif entry.slot is not None or entry.relays is not None:
                try:
                    in_slot, relayed = self._open(src, entry)
                except shm.SegmentGone as exc:    # its sender took the memory back: lost, not malformed
                    log.warning("rlinf: a message from %s was lost: %s", src, exc)
                    error = PeerLostError(f"a message from {src} was lost on its way: its sender took back the "
                                          f"shared memory it was in (it took us for lost, or it is gone): {exc}",
                                          peer=src)
                except (ProtocolError, ClosedError) as exc:
                    self._on_bad_slot()
                    log.warning("rlinf: bad shared-memory slot from %s: %r", src, exc)
                    error = DecodeError(f"message from {src} cannot be read from shared memory: {exc}")
            for count in entry.frame_counts:
                if type(count) is list:   # forwarded by reference from another process's slot
                    if relayed is not None:
                        buf = next(relayed)
                        buffers.append(buf)
                        nbytes += buf.nbytes
                    continue
                if count < 0:    # in the entry's shared-memory slot
                    if in_slot is None:
                        continue
                    buf = next(in_slot)
                    buffers.append(buf)
                    nbytes += buf.nbytes
                    continue
                if packed:       # count is a size in bytes within the blob
                    buf = blob[i:i + count]
                elif count == 1:
                    buf = frames[i]
                else:
                    buf = self._join(frames[i:i + count])
                i += count
                buffers.append(buf)
                nbytes += buf.nbytes
            if entry.gpu is not None and error is not None and self._refuse_gpu is not None:
                self._refuse_gpu(src, incarnation, entry.gpu)
            elif entry.gpu is not None and error is None:
                try:
                    ready, n = self._insert_gpu(src, incarnation, entry.gpu, buffers)
                    nbytes += n
                except (ProtocolError, ClosedError) as exc:
                    self._on_bad_slot()
                    log.warning("rlinf: bad CUDA IPC slot from %s: %r", src, exc)
                    error = DecodeError(f"message from {src} cannot be read from its GPU slot: {exc}")
            yield Rebuilt(entry, buffers, nbytes, in_slot is not None or relayed is not None, error, ready,
                          pulling)

    def _open_pull(self, src: str, incarnation: str, entry: wire.Entry) -> tuple[list, asyncio.Future]:
        if self._pull is None:
            raise ProtocolError("pulls are not enabled in this process")
        sizes = [-c for c in entry.frame_counts if c < 0]
        return self._pull.open(src, incarnation, entry.pull, sizes)

    def _insert_gpu(self, src: str, incarnation: str, gpu: wire.GpuRef, buffers: list) -> tuple[Callable, int]:
        """Put an entry's device buffers in their places among its host ``buffers``;
        their ``ready()`` and bytes."""
        if self._open_gpu is None:
            raise ProtocolError("CUDA IPC is not enabled in this process")
        pairs, ready = self._open_gpu(src, incarnation, gpu)
        nbytes = 0
        for index, buf in sorted(pairs, key=lambda p: p[0]):
            if index > len(buffers):
                raise ProtocolError("GPU buffer index beyond the message's buffers")
            buffers.insert(index, buf)
            nbytes += buf.nbytes
        return ready, nbytes

    def _open(self, src: str, entry: wire.Entry) -> tuple[Iterator | None, Iterator | None]:
        session = self._shm
        if session is None:
            raise ProtocolError("shared memory is not enabled in this process")
        pid = self._pid_of(src)
        in_slot = relayed = None
        if entry.slot is not None:
            in_slot = iter(session.open(src, entry.slot, entry.frame_counts, pid))
        if entry.relays is not None:
            relayed = iter(session.open_relayed(src, entry.relays, entry.frame_counts, pid))
        return in_slot, relayed

    def _join(self, frames: list) -> memoryview:
        """Reassemble a chunked buffer into one writable buffer (one copy), in recycled
        memory: pages already faulted in take the copy several times faster than fresh
        ones."""
        total = sum(f.nbytes for f in frames)
        out = self._recycler.take(total)
        offset = 0
        for f in frames:
            n = f.nbytes
            out[offset:offset + n] = np.frombuffer(f, dtype=np.uint8)
            offset += n
        return memoryview(out)

