"""The buffer descriptors transports put on the wire, and how each is checked before use.

A transport that does not carry a buffer's bytes in the frame set sends a small
*descriptor* of where the receiver finds them instead. This module owns those records,
the one definition of how buffers are placed in a slot, the form of shared-memory
segment names, and the limits every transport checks sizes against. The message
format above the transports (:mod:`rlinf.core.wire`) embeds the descriptors in its
entries and takes them from here; transports use this module, never the message format.

The descriptors, as they travel (msgpack arrays) and what they become:

* :class:`SlotRef` — a shared-memory slot of the sender (:mod:`.shm`):
  ``[segment, offset, size, generation, private]``.
* :class:`FdRef` — a file the sender holds open, reached through
  ``/proc/<pid>/fd`` (:mod:`.shm._fdshare`): ``[fd, dev, ino, size, hold_id]``.
* :class:`GpuRef` — a CUDA IPC slot of the sender (:mod:`.cuda.ipc`):
  ``[slot_id, generation, device, share_or_nil, event_or_nil, [[index, offset, nbytes], ...]]``.
* :class:`PullRef` — buffers left in the sender's memory for the receiver to read
  (:mod:`.shm._pull`): ``[pull_id, [address, ...], token_address, token]``.

Checks: a peer's descriptor is untrusted input. Each ``unpack_*`` function takes the
raw msgpack value and returns the record only if every field has its type and lies
within its bound (:data:`MAX_SLOT`, the integers msgpack carries, a segment name that
cannot leave ``/dev/shm``, torch's IPC share within its slot); anything else raises
:class:`~rlinf.errors.ProtocolError` before a file is opened, memory is mapped or an
address is read. What a record names is checked again where it is used (the slot lies
within the file, the file's identity matches, the pid in a segment name is the
sender's): those checks need the file or the sender and live in the transport.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError

__all__ = ["SlotRef", "FdRef", "GpuRef", "PullRef", "unpack_slot", "unpack_relays", "unpack_gpu", "unpack_pull",
           "slot_layout", "parse_segment_name", "max_frame_set", "MAX_HEADER", "MAX_FRAMES", "MAX_SLOT", "MAX_RELAYS",
           "SLOT_ALIGN", "INT_MIN", "INT_MAX"]

#: The integers msgpack carries (descriptor fields, user tags, channel keys): [-2**63, 2**64 - 1].
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
#: Largest first frame (the header) of a frame set any transport accepts.
MAX_HEADER = 64 << 20
#: Most payload frames one frame set may carry (a large message: one per buffer chunk).
MAX_FRAMES = 1 << 22
#: Largest shared-memory slot a peer may describe (bounds every size taken from it).
MAX_SLOT = 1 << 40
#: Most relays (forwarded slots or files) one message may name.
MAX_RELAYS = 1 << 20
#: Alignment of each buffer inside a slot (covers every dtype and cache lines).
SLOT_ALIGN = 64
#: Slot offsets in a segment are multiples of this (the smallest page size rlinf maps).
_PAGE = 4096
#: Segment file names: ``rlinf-<pid>-<pid namespace>-<pool>-<n>`` (see
#: :mod:`rlinf.transports.leftovers`; the pid lets a sweeper find a dead process's
#: segments). Nothing else may appear, so a name can never leave ``/dev/shm``.
_SEGMENT_NAME = re.compile(r"rlinf-([0-9]{1,10})-(?:[0-9a-f]{1,16}|x)-[0-9a-f]{1,32}-[0-9]{1,12}")


@functools.cache
def max_frame_set() -> int:
    """The most bytes one frame set received over a stream (frame table included) may
    claim: no more than this machine's memory (it is held whole until delivered), and
    never more than :data:`MAX_SLOT`. A larger claim is refused before allocating."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):      # not reported here
        return MAX_SLOT
    return min(MAX_SLOT, memory) if memory > 0 else MAX_SLOT


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a message's shared-memory buffers are: a validated slot descriptor.

    Attributes:
        segment: file name in ``/dev/shm`` (``rlinf-<pid>-<ns>-<token>-<n>``).
        pid: the creating process, parsed from ``segment``.
        offset: start of the slot in the segment (page-aligned).
        size: bytes of the slot; the buffers placed by :func:`slot_layout` fit in it.
        generation: the sender's use count of the slot, echoed back on release.
        private: several readers share the slot: map it copy-on-write.
    """

    segment: str
    pid: int
    offset: int
    size: int
    generation: int
    private: bool

    def to_wire(self) -> list:
        return [self.segment, self.offset, self.size, self.generation, self.private]


@dataclass(frozen=True, slots=True)
class FdRef:
    """A file the sender holds open, named by reference: a validated handle descriptor.

    Attributes:
        fd: the descriptor in the sender (opened as ``/proc/<sender pid>/fd/<fd>``).
        dev, ino: the file's identity; the receiver checks it after opening.
        size: bytes of the file to map; the buffers placed in it fit.
        hold_id: echoed back on release (``["fd", hold_id]``).
    """

    fd: int
    dev: int
    ino: int
    size: int
    hold_id: int


@dataclass(frozen=True, slots=True)
class GpuRef:
    """Where a message's GPU buffers are: a validated CUDA IPC slot descriptor.

    Attributes:
        slot: the sender's slot id, echoed back on release.
        generation: the slot's use count, echoed back on release.
        device: the CUDA device of the slot.
        share: torch's IPC description of the slot (its first message only), else None.
        event: the IPC handle of the slot's ready event (with ``share``), else None.
        places: ``(index, offset, nbytes)`` per device buffer, in message order.
        span: the end of the last buffer in the slot.
    """

    slot: int
    generation: int
    device: int
    share: tuple | None
    event: bytes | None
    places: tuple[tuple[int, int, int], ...]
    span: int


@dataclass(frozen=True, slots=True)
class PullRef:
    """Where a message's pulled buffers are: a validated pull descriptor.

    Attributes:
        pull_id: the sender's number for the message, echoed back once pulled.
        addresses: where each pulled buffer starts in the sender's memory, in order.
        token_address: where the sender keeps the word that says its hold lasts.
        token: the word's value while it does (0 once the sender revoked the hold).
    """

    pull_id: int
    addresses: tuple[int, ...]
    token_address: int
    token: int


def slot_layout(sizes: list[int], align: int = SLOT_ALIGN) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes inside a slot, and the bytes they span.

    The one definition of the in-slot placement, used by the sender (to copy) and the
    receiver (to slice): in order, each buffer at the next ``align`` boundary (a power
    of two: :data:`SLOT_ALIGN` in shared memory; CUDA IPC slots use their own).
    """
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = (end + n + align - 1) & ~(align - 1)
    return offsets, end


def parse_segment_name(name: Any) -> int:
    """The pid in a segment name; raises ``ProtocolError`` for anything else."""
    if type(name) is str:
        pid = _segment_pid(name)
        if pid is not None:
            return pid
    raise ProtocolError(f"bad shared-memory segment name {name!r}")


@functools.lru_cache(maxsize=1024)
def _segment_pid(name: str) -> int | None:
    """Memo of :func:`parse_segment_name` (a pure function): every message through
    shared memory names one of a few segments."""
    match = _SEGMENT_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))


def unpack_slot(raw: Any) -> SlotRef:
    """A :class:`SlotRef` from its wire form ``[segment, offset, size, generation, private]``.

    Raises:
        ProtocolError: a bad segment name, a bound out of range or a misaligned offset.
    """
    if not (isinstance(raw, list) and len(raw) == 5):
        raise ProtocolError("malformed shared-memory slot")
    segment, offset, size, generation, private = raw
    pid = parse_segment_name(segment)
    for value in (offset, size, generation):
        if type(value) is not int or not 0 <= value <= MAX_SLOT:
            raise ProtocolError("bad shared-memory slot bounds")
    if size == 0 or offset % _PAGE or not isinstance(private, bool):
        raise ProtocolError("bad shared-memory slot bounds")
    return SlotRef(segment, pid, offset, size, generation, private)


def unpack_relays(raw: Any) -> list[SlotRef | FdRef]:
    """The relays of a message: each ``[segment, offset, size, relay_id]`` (a slot of
    another sender's segment, mapped copy-on-write: a private :class:`SlotRef` whose
    generation is the relay id) or ``[fd, dev, ino, size, hold_id]`` (an :class:`FdRef`).

    Raises:
        ProtocolError: not a list of 1 to :data:`MAX_RELAYS` valid relays.
    """
    if not (isinstance(raw, list) and 0 < len(raw) <= MAX_RELAYS):
        raise ProtocolError("malformed relay list")
    relays: list[SlotRef | FdRef] = []
    for item in raw:
        if isinstance(item, list) and len(item) == 5:
            relays.append(_unpack_fd(item))
            continue
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("malformed relay")
        segment, offset, size, relay_id = item
        relays.append(unpack_slot([segment, offset, size, relay_id, True]))
    return relays


def _unpack_fd(item: list) -> FdRef:
    if not all(type(v) is int and v >= 0 for v in item):
        raise ProtocolError("malformed shared-file reference")
    fd, dev, ino, size, hold_id = item
    if fd >= 1 << 31 or not 0 < size <= MAX_SLOT:
        raise ProtocolError("bad shared-file reference bounds")
    return FdRef(fd, dev, ino, size, hold_id)


def unpack_pull(raw: Any, pulled: int) -> PullRef:
    """A :class:`PullRef` announcing ``pulled`` buffers.

    Raises:
        ProtocolError: malformed, an address or the token out of range, or not one
            address per pulled buffer.
    """
    if not (isinstance(raw, list) and len(raw) == 4 and type(raw[0]) is int and isinstance(raw[1], list)):
        raise ProtocolError("malformed pull descriptor")
    pull_id, addresses, token_address, token = raw
    if not (0 <= pull_id <= INT_MAX and len(addresses) == pulled
            and all(type(a) is int and 0 < a <= INT_MAX for a in addresses)
            and type(token_address) is int and 0 < token_address <= INT_MAX
            and type(token) is int and 0 < token <= INT_MAX):
        raise ProtocolError("bad pull descriptor")
    return PullRef(pull_id, tuple(addresses), token_address, token)


_SHARE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)
#: torch's CUDA IPC reference-counter files: ``/torch_<pid>_<random>_<n>``, with
#: CUDA_IPC_REF_COUNTER_FILE_SIZE (10000) counters each.
_REF_COUNTER_NAME = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
_REF_COUNTERS = 10000
#: Bounds of handles: a CUDA IPC event handle is 64 bytes; torch prefixes a memory
#: handle with a version and a type byte, and an expandable segment's is longer.
_MAX_EVENT_HANDLE = 256
_MAX_MEMORY_HANDLE = 1 << 16


def unpack_gpu(raw: Any, host_buffers: int) -> GpuRef:
    """A :class:`GpuRef` for a message with ``host_buffers`` buffers besides its GPU ones.

    torch opens a share without checking it (the counter offset is written to, the
    size and offset bound the views), so every field it uses is bounded here.

    Raises:
        ProtocolError: malformed, a share out of bounds, or places that repeat an
            index, name one past the message's buffers or lie beyond the share.
    """
    if not (isinstance(raw, list) and len(raw) == 6):
        raise ProtocolError("malformed GPU buffer descriptor")
    slot, generation, device, share, event, places = raw
    if not (type(slot) is int and type(generation) is int and type(device) is int
            and 0 <= device < 1 << 16 and isinstance(places, list) and places):
        raise ProtocolError("malformed GPU buffer descriptor")
    if share is not None:
        if not (isinstance(share, list) and len(share) == len(_SHARE_TYPES)
                and all(type(v) is t for v, t in zip(share, _SHARE_TYPES))
                and type(event) is bytes and 0 < len(event) <= _MAX_EVENT_HANDLE):
            raise ProtocolError("malformed CUDA IPC share")
        s_device, handle, size, offset, counters, counter, s_event, _sync = share
        if not (s_device == device and 0 < len(handle) <= _MAX_MEMORY_HANDLE and len(s_event) <= _MAX_EVENT_HANDLE
                and 0 < size <= MAX_SLOT and 0 <= offset <= MAX_SLOT
                and _REF_COUNTER_NAME.fullmatch(counters.decode("ascii", "replace"))
                and 0 <= counter < _REF_COUNTERS):
            raise ProtocolError("CUDA IPC share out of bounds")
        share = tuple(share)
    elif event is not None:
        raise ProtocolError("malformed CUDA IPC share")
    total = host_buffers + len(places)
    seen, span, out = set(), 0, []
    for item in places:
        if not (isinstance(item, list) and len(item) == 3 and all(type(v) is int for v in item)):
            raise ProtocolError("bad GPU buffer layout")
        i, offset, nbytes = item
        if not (0 <= i < total and i not in seen and 0 <= offset <= MAX_SLOT and 0 <= nbytes <= MAX_SLOT):
            raise ProtocolError("bad GPU buffer layout")
        seen.add(i)
        span = max(span, offset + nbytes)
        out.append((i, offset, nbytes))
    if share is not None and span > share[2]:
        raise ProtocolError("GPU buffers beyond their CUDA IPC slot")
    return GpuRef(slot, generation, device, share, event, tuple(out), span)
