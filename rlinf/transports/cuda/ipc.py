"""CUDA IPC: GPU buffers to another process of this node without touching host memory.

Measured on an H200 (docs/benchmarks.md): opening a CUDA IPC memory handle costs
~120 ms and opening an IPC event handle ~120 µs, while recording and waiting on an
event costs 1-3 µs. So nothing is opened per message:

* The sender keeps, per receiver and device, a pool of device *slots* (allocations of
  torch's caching allocator, sized by powers of two from 1 MiB) and shares each slot
  with its receiver once. A message's GPU buffers are copied into one slot on the
  sender's current stream, so the copy follows whatever work is already queued there;
  then the slot's interprocess *ready* event is recorded. Nothing waits on the host.
* The receiver opens each slot and its event once, makes its current stream wait on
  the event (a device-side wait, not a synchronisation; skipped when the copy is
  already done) and gets views of the slot.
* When the last view is garbage-collected the slot goes back: unless the current
  stream of the thread that dropped it is idle, the receiver records its own
  interprocess *free* event there, and the sender's stream waits on that event before
  it writes the slot again. (Waits between two processes' streams are skipped when they
  are not needed: on one GPU they make it switch between the two processes' contexts.)
* Device numbers differ between processes (``CUDA_VISIBLE_DEVICES``): the sender names
  the slot's device in the receiver's numbering, found by the device's uuid.

A slot is never shared with a second receiver and never rewritten while a view of it
lives. A pool grows up to a cap per receiver (``RLINF_CUDA_IPC_CAP``, default 2 GiB);
past it the communicator stages the message through host memory instead of failing.

Buffer lifetime:

* sender: ``send`` returns once the copy is queued on the current stream. The caller
  may then write its tensors from that stream (or any work ordered after it); writes
  from another stream must wait for it, as for any CUDA work.
* receiver: the tensors are views of the sender's slot, valid for as long as they (or
  views of them) are referenced. Decoding them (``recv`` returning) orders the caller's
  current stream after the sender's copy. They live on the sender's device; a receiver
  whose current device differs gets a copy on its own device instead, and so does one
  that asked for owned copies (``shm_views=False``). A view must be dropped from the
  stream that last used it, or after that stream's work (the slot is rewritten once the
  dropping thread's current stream has done what it had queued).

The shared allocation itself is kept alive by torch's CUDA IPC reference counting
(``torch.multiprocessing``'s mechanism): a slot the sender drops stays allocated until
its receiver has dropped its mapping, or until the sender learns that the receiver's
process is gone. Both sides forget each other's slots only when the peer left or its
process is gone (a peer taken for lost for a while keeps them, and goes on with them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Sequence

from ...config import DEFAULTS
from .. import descriptors
from ...errors import ProtocolError

log = logging.getLogger("rlinf.transports.cuda.ipc")

__all__ = ["available", "CudaIpcReader", "CudaIpcSender", "DEFAULT_CAP", "OPEN_STALL", "STALL"]

#: torch's size of an IPC memory or event handle.
HANDLE_SIZE = 64
#: Smallest slot; slots are powers of two from here (reuse across nearby sizes). Up to
#: 1 MiB, torch's allocator carves them out of 2 MiB segments: one IPC open per segment.
MIN_SLOT = 256 << 10
#: Alignment of each buffer inside a slot (covers every dtype and vector loads).
ALIGN = 256
#: Bytes of slots per receiver (``RLINF_CUDA_IPC_CAP``'s default, 2 GiB; the communicator
#: passes the setting).
DEFAULT_CAP = DEFAULTS.cuda_ipc_cap
#: A receiver holding this many of our slots (or half the cap) is behind: a send to it
#: waits for one back (at most :data:`STALL` seconds) before the pool grows further.
WINDOW_SLOTS = 64
#: Seconds a send to a receiver that is behind waits for a slot to come back; past it the
#: receiver counts as keeping its views and the pool grows (up to the cap; beyond it,
#: messages are staged through host memory).
STALL = 0.05
#: The same wait while the receiver has not yet given back one of the new slots it was
#: sent: it may still be opening them (~120 ms each on an H200).
OPEN_STALL = 1.0


def available() -> bool:
    """Whether torch is importable with a usable CUDA device (imports torch)."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except RuntimeError:
        return False


def _slot_size(nbytes: int) -> int:
    return max(MIN_SLOT, 1 << (nbytes - 1).bit_length())


def _as_torch(buf: Any, torch: Any) -> Any:
    """A flat uint8 device buffer (torch or cupy) as a torch tensor (no copy)."""
    if type(buf).__module__.startswith("torch"):
        return buf
    return torch.as_tensor(buf, device=f"cuda:{buf.device.id}")


def device_of(buf: Any) -> int:
    """The CUDA device index of a torch or cupy device buffer."""
    dev = getattr(buf, "device", None)
    index = getattr(dev, "index", None)
    if index is not None:
        return index
    return int(getattr(dev, "id", 0))


class _Slot:
    """A device allocation of the sender's, shared with one receiver."""

    __slots__ = ("id", "reader", "device", "peer_device", "size", "tensor", "ready", "share", "announced",
                 "generation", "busy", "free_event", "must_wait", "returned")

    def __init__(self, slot_id: int, reader: str, device: int, peer_device: int, size: int, torch: Any) -> None:
        self.id = slot_id
        self.reader = reader
        self.device = device                  # ours
        self.peer_device = peer_device        # the same GPU in the receiver's numbering
        self.size = size
        self.tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
        with torch.cuda.device(device):
            self.ready = torch.cuda.Event(interprocess=True)
        self.share: tuple | None = None       # torch's IPC description, made once
        self.announced = False                # the receiver has been sent the share
        self.generation = 0
        self.busy = False
        self.free_event = None                # the receiver's, once it gave the slot back
        self.must_wait = False                # its last give-back recorded free_event
        self.returned = False                 # the receiver gave it back once (it opened it)


class CudaIpcSender:
    """Slots per receiver: copy, announce, take back, retire (loop thread only).

    Args:
        cap: bytes of slots per receiver (default :data:`DEFAULT_CAP`).
        torch: the torch module (the tests pass a fake one to check the bookkeeping
            without a GPU).
    """

    def __init__(self, cap: int | None = None, *, torch: Any = None) -> None:
        if torch is None:
            import torch

        self._torch = torch
        self.cap = DEFAULT_CAP if cap is None else cap
        self._slots: dict[int, _Slot] = {}
        self._free: dict[tuple[str, int, int], list[_Slot]] = {}
        self._held: dict[str, int] = {}       # reader -> bytes of its slots
        self._busy: dict[str, int] = {}       # reader -> bytes of its busy slots
        self._busy_count: dict[str, int] = {}  # reader -> its busy slots
        self.retired: dict[str, list[int]] = {}   # reader -> slots it should forget (see _evict)
        self._next = 1

    def __repr__(self) -> str:
        return f"<CudaIpcSender slots={len(self._slots)} busy={sum(s.busy for s in self._slots.values())}>"

    def busy_bytes(self, reader: str) -> int:
        """Bytes of ``reader``'s slots that it has not given back."""
        return self._busy.get(reader, 0)

    def behind(self, reader: str) -> bool:
        """Whether ``reader`` holds :data:`WINDOW_SLOTS` of our slots or half the cap."""
        return self._busy_count.get(reader, 0) >= WINDOW_SLOTS or self._busy.get(reader, 0) * 2 > self.cap

    def opening(self, reader: str) -> bool:
        """Whether ``reader`` holds a slot it never gave back (it may still be opening it)."""
        return any(s.busy and not s.returned for s in self._slots.values() if s.reader == reader)

    def export(self, buffers: Sequence[Any], places: Sequence[int], reader: str, peer_device: int) -> list | None:
        """Copy the device buffers ``buffers[i]`` for ``i`` in ``places`` into one slot
        for ``reader`` and return the wire form of its :class:`~rlinf.transports.descriptors.GpuRef`, or
        None when they can't go by CUDA IPC (several devices, or ``reader`` at its cap).

        ``peer_device``: the buffers' device in ``reader``'s numbering.
        """
        device = device_of(buffers[places[0]])
        if any(device_of(buffers[i]) != device for i in places[1:]):
            return None
        sizes = [buffers[i].nbytes for i in places]
        offsets, total = descriptors.slot_layout(sizes, ALIGN)
        slot = self._acquire(reader, device, peer_device, max(total, 1))
        if slot is None:
            return None
        try:
            share, handle = self._fill(slot, buffers, places, offsets, sizes)
        except Exception as exc:     # a device in a bad state, out of memory for the share: staged
            log.warning("rlinf: CUDA IPC copy for %s failed: %r", reader, exc)
            self._give_back(slot)
            return None
        return [slot.id, slot.generation, peer_device, share, handle,
                [[i, off, n] for i, off, n in zip(places, offsets, sizes)]]

    def _fill(self, slot: _Slot, buffers: Sequence[Any], places: Sequence[int], offsets: list[int],
              sizes: list[int]) -> tuple[list | None, bytes | None]:
        """Queue the copies into ``slot`` on the current stream, after what may still read
        or write it; record its ready event. The share and event handle when it is new."""
        torch = self._torch
        stream = torch.cuda.current_stream(slot.device)
        if not slot.ready.query():                 # a discarded message's copy may still be queued
            stream.wait_event(slot.ready)
        if slot.must_wait and not slot.free_event.query():
            stream.wait_event(slot.free_event)     # the receiver's last reads come first
        target = slot.tensor
        for i, off, n in zip(places, offsets, sizes):
            if n:
                target[off:off + n].copy_(_as_torch(buffers[i], torch), non_blocking=True)
        slot.ready.record(stream)
        if slot.announced:
            return None, None
        if slot.share is None:
            slot.share = slot.tensor.untyped_storage()._share_cuda_()
        share, handle = [slot.peer_device, *slot.share[1:]], bytes(slot.ready.ipc_handle())
        slot.announced = True
        return share, handle

    def _acquire(self, reader: str, device: int, peer_device: int, nbytes: int) -> _Slot | None:
        size = _slot_size(nbytes)
        if size > self.cap:
            return None
        free = self._free.get((reader, device, size))
        if free:
            slot = free.pop()
        else:
            if self._held.get(reader, 0) + size > self.cap and not self._evict(reader, size):
                return None
            slot = _Slot(self._next, reader, device, peer_device, size, self._torch)
            self._next += 1
            self._slots[slot.id] = slot
            self._held[reader] = self._held.get(reader, 0) + size
        slot.busy = True
        slot.generation += 1
        self._busy[reader] = self._busy.get(reader, 0) + size
        self._busy_count[reader] = self._busy_count.get(reader, 0) + 1
        return slot

    def _evict(self, reader: str, size: int) -> bool:
        """Drop free slots of ``reader`` (of other sizes: none of ``size`` is free) until
        a slot of ``size`` fits in its cap; the receiver is told to forget them
        (:attr:`retired`), and torch frees each once it has. False if they can't make room."""
        free = sorted((s for key, slots in self._free.items() if key[0] == reader for s in slots),
                      key=lambda s: -s.size)
        if self._held.get(reader, 0) - sum(s.size for s in free) + size > self.cap:
            return False
        for slot in free:
            if self._held[reader] + size <= self.cap:
                break
            self._free[(reader, slot.device, slot.size)].remove(slot)
            del self._slots[slot.id]
            self._held[reader] -= slot.size
            if slot.announced:
                self.retired.setdefault(reader, []).append(slot.id)
        return True

    def _give_back(self, slot: _Slot) -> None:
        slot.busy = False
        self._busy[slot.reader] -= slot.size
        self._busy_count[slot.reader] -= 1
        self._free.setdefault((slot.reader, slot.device, slot.size), []).append(slot)

    def discard(self, descriptor: list) -> None:
        """The message carrying ``descriptor`` was never sent: its slot is free again
        (and, if this was its announcement, announced with the next message)."""
        slot = self._slots.get(descriptor[0])
        if slot is not None and slot.busy and slot.generation == descriptor[1]:
            if descriptor[3] is not None:
                slot.announced = False
            self._give_back(slot)

    def release(self, reader: str, slot_id: int, generation: int, free_handle: bytes | None,
                wait: bool = True) -> bool:
        """``reader`` gave ``slot_id`` back (``wait``: after the work queued when it
        recorded its free event); False when that does not match what it holds."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.reader != reader or not slot.busy or slot.generation != generation:
            return False
        if free_handle is not None and slot.free_event is None:
            self._open_event(slot, free_handle)
        slot.must_wait = wait and slot.free_event is not None
        slot.returned = True
        self._give_back(slot)
        return True

    def reject(self, reader: str, slot_id: int, generation: int) -> bool:
        """``reader`` could not use ``slot_id`` (never announced to it, or it could not map
        it): drop the slot; a new one, announced afresh, takes its place."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.reader != reader or not slot.busy or slot.generation != generation:
            return False
        self._give_back(slot)
        self._free[(reader, slot.device, slot.size)].remove(slot)
        del self._slots[slot.id]
        self._held[reader] -= slot.size
        if slot.share is not None:        # whatever it mapped is gone with the failure
            _release_counter(self._torch, slot)
        return True

    def _open_event(self, slot: _Slot, handle: bytes) -> None:
        try:
            slot.free_event = self._torch.cuda.Event.from_ipc_handle(slot.device, handle)
        except Exception as exc:       # torch raises several types for a bad handle
            log.warning("rlinf: bad CUDA IPC event from %s: %r", slot.reader, exc)

    def reader_gone(self, reader: str, *, process_gone: bool) -> None:
        """Drop ``reader``'s slots. When its process is gone it can no longer drop its
        mappings, so its references are released here (else torch keeps the memory)."""
        mine = [s for s in self._slots.values() if s.reader == reader]
        for slot in mine:
            del self._slots[slot.id]
            if process_gone and slot.share is not None:   # opened by it or not: it holds one count
                _release_counter(self._torch, slot)
        for key in [k for k in self._free if k[0] == reader]:
            del self._free[key]
        for table in (self._held, self._busy, self._busy_count, self.retired):
            table.pop(reader, None)
        if mine:
            mine.clear()
            self.collect()

    def collect(self) -> None:
        """Let torch free the slots we dropped whose receivers have unmapped them."""
        self._torch.cuda.ipc_collect()

    def close(self) -> None:
        for table in (self._slots, self._free, self._held, self._busy, self._busy_count, self.retired):
            table.clear()


def _release_counter(torch: Any, slot: _Slot) -> None:
    share = slot.share
    try:
        torch.UntypedStorage._release_ipc_counter(share[4], share[5], device=slot.device)
    except Exception as exc:   # its file already gone: nothing is held for it
        log.debug("rlinf: CUDA IPC counter of slot %d: %r", slot.id, exc)


class _Mapped:
    """A slot of a sender's, opened here once."""

    __slots__ = ("whole", "device", "ready", "free_event", "free_sent")

    def __init__(self, whole: Any, device: int, ready: Any) -> None:
        self.whole = whole
        self.device = device
        self.ready = ready
        self.free_event = None
        self.free_sent = False


class _Lease:
    """The views of one message: torch keeps this object while any view lives (the
    ``__cuda_array_interface__`` it was made from) and its end gives the slot back."""

    __slots__ = ("__cuda_array_interface__", "whole", "_done", "__weakref__")

    def __init__(self, whole: Any, start: int, nbytes: int, done: Callable[[], None]) -> None:
        self.whole = whole           # the mapping stays open while the views live
        self._done = done
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (whole.data_ptr() + start, False),
            "version": 3, "strides": None,
        }

    def __del__(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()


class CudaIpcReader:
    """Slots of other processes, opened once; hands out views and gives slots back.

    Args:
        loop: the communicator's loop (releases are sent from it).
        on_release: ``on_release(src, item)`` with ``item = [slot_id, generation,
            free_handle_or_None, wait, src_incarnation]``, on the loop thread.
        views: receivers keep views (else they get owned copies and the slot goes back at once).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_release: Callable[[str, list], None],
                 *, views: bool = True, torch: Any = None) -> None:
        if torch is None:
            import torch

            torch.cuda.init()        # what torch.multiprocessing does before opening a handle
        self._torch = torch
        self._loop = loop
        self._thread = threading.get_ident()
        self._on_release = on_release
        self._views = views
        self._mapped: dict[tuple[str, str, int], _Mapped] = {}

    def __repr__(self) -> str:
        return f"<CudaIpcReader mapped={len(self._mapped)}>"

    def open(self, src: str, incarnation: str, gpu: descriptors.GpuRef) -> tuple[list[tuple[int, Any]], Callable]:
        """The device buffers ``(index, tensor)`` of one received entry, and ``ready()``,
        which orders the caller's current stream after their copy (call it before use).

        Raises:
            ProtocolError: the slot was never announced or cannot be opened here, or the
                views (or copies) cannot be made; the slot then goes back to the sender.
        """
        key = (src, incarnation, gpu.slot)
        mapped = self._mapped.get(key)
        if gpu.share is not None:
            try:
                mapped = self._mapped[key] = self._map(src, gpu)
            except ProtocolError:
                self._reject(key, gpu.generation)
                raise
        elif mapped is None:
            self._reject(key, gpu.generation)
            raise ProtocolError(f"CUDA IPC slot {gpu.slot} of {src} was never announced here")
        try:
            if mapped.whole.numel() < gpu.span:
                raise ProtocolError(f"CUDA IPC slot of {src} is smaller than its buffers")
            return self._views_of(key, mapped, gpu)
        except Exception as exc:     # out of memory for a copy, a device in a bad state, ...
            self._release(key, mapped, gpu.generation)
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"cannot read the CUDA IPC slot of {src}: {exc!r}") from exc

    def refuse(self, src: str, incarnation: str, gpu: descriptors.GpuRef) -> None:
        """An entry whose other buffers could not be read: give its slot back unread."""
        key = (src, incarnation, gpu.slot)
        mapped = self._mapped.get(key)
        if mapped is not None and gpu.share is None:
            self._release(key, mapped, gpu.generation)
        else:
            self._reject(key, gpu.generation)

    def _reject(self, key: tuple, generation: int) -> None:
        self._mapped.pop(key, None)
        self._on_release(key[0], ["reject", key[2], generation, key[1]])

    def _map(self, src: str, gpu: descriptors.GpuRef) -> _Mapped:
        torch = self._torch
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*gpu.share)
            ready = torch.cuda.Event.from_ipc_handle(gpu.device, gpu.event)
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        except Exception as exc:     # torch raises several types for what it cannot open
            raise ProtocolError(f"cannot open a CUDA IPC slot of {src}: {exc!r}") from exc
        return _Mapped(whole, gpu.device, ready)

    def _views_of(self, key: tuple, mapped: _Mapped, gpu: descriptors.GpuRef) -> tuple[list, Callable]:
        torch = self._torch
        here = torch.cuda.current_device()
        generation = gpu.generation
        if not self._views or here != mapped.device:
            _wait(torch, mapped.ready, mapped.device)
            out = [(i, self._copy(mapped.whole[off:off + n], here)) for i, off, n in gpu.places]
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(here))
            self._release(key, mapped, generation)
            return out, lambda: _wait(torch, copied, here)
        start = min(off for _i, off, _n in gpu.places)
        end = max(off + n for _i, off, n in gpu.places)
        lease = _Lease(mapped.whole, start, end - start, lambda: self._release(key, mapped, generation))
        region = torch.as_tensor(lease, device=f"cuda:{mapped.device}")
        del lease      # the region's storage holds it now
        views = [(i, region[off - start:off - start + n]) for i, off, n in gpu.places]
        return views, lambda: _wait(torch, mapped.ready, mapped.device)

    def _copy(self, view: Any, device: int) -> Any:
        out = self._torch.empty(view.numel(), dtype=view.dtype, device=f"cuda:{device}")
        out.copy_(view)
        return out

    def _release(self, key: tuple, mapped: _Mapped, generation: int) -> None:
        """The views of one message are gone (any thread): mark the slot free after the
        work this thread's current stream has queued, then tell its sender (loop thread)."""
        if self._mapped.get(key) is not mapped:    # forgotten (the sender left), or another incarnation's
            return
        try:
            handle, wait = self._mark_free(mapped)
        except Exception as exc:     # no safe way to say when the slot is free: it stays ours
            log.warning("rlinf: a CUDA IPC slot of %s is kept: %r", key[0], exc)
            return
        item = [key[2], generation, handle, wait, key[1]]
        if threading.get_ident() == self._thread:
            self._on_release(key[0], item)
            return
        try:
            self._loop.call_soon_threadsafe(self._on_release, key[0], item)
        except RuntimeError:       # the loop is closed: the process is ending
            pass

    def _mark_free(self, mapped: _Mapped) -> tuple[bytes | None, bool]:
        """``(free event handle if new, wait)``: unless this thread's current stream is
        idle, record the slot's free event on it (the sender's stream will wait on it)."""
        torch = self._torch
        stream = torch.cuda.current_stream(mapped.device)
        if stream.query():
            return None, False
        if mapped.free_event is None:
            with torch.cuda.device(mapped.device):
                mapped.free_event = torch.cuda.Event(interprocess=True)
        mapped.free_event.record(stream)
        handle = None
        if not mapped.free_sent:
            handle = bytes(mapped.free_event.ipc_handle())
            mapped.free_sent = True
        return handle, True

    def retire(self, src: str, incarnation: str, slot: int) -> None:
        """``src`` dropped ``slot``: forget it (views still alive keep their mapping).
        Dropping the mapping lets the sender reuse the memory: torch synchronises our
        current stream first, so it is made to wait for the last reads recorded."""
        mapped = self._mapped.pop((src, incarnation, slot), None)
        if mapped is not None and mapped.free_event is not None and not mapped.free_event.query():
            self._torch.cuda.current_stream(mapped.device).wait_event(mapped.free_event)

    def forget_others(self, src: str, incarnation: str) -> None:
        """``src`` restarted as ``incarnation``: forget the slots of its earlier ones."""
        for key in [k for k in self._mapped if k[0] == src and k[1] != incarnation]:
            del self._mapped[key]

    def peer_gone(self, src: str, incarnation: str | None = None) -> None:
        """Forget ``src``'s slots (of ``incarnation``, or all); views still alive keep
        their mapping until they die."""
        for key in [k for k in self._mapped if k[0] == src and (incarnation is None or k[1] == incarnation)]:
            del self._mapped[key]

    def close(self) -> None:
        self._mapped.clear()


def _wait(torch: Any, event: Any, device: int) -> None:
    """Order ``device``'s current stream after ``event`` (nothing when it has happened)."""
    if not event.query():
        torch.cuda.current_stream(device).wait_event(event)
