"""The data-plane frame layout, packed and validated in one place.

A frame set on a data link is ``[header, *payload_frames]``. The header is a msgpack
array ``[VERSION, src, incarnation, entries, packed]``; each entry describes one
message::

    [kind, tag, codec_header, layout]

``kind`` is :data:`USER` for messages handed to ``recv`` or :data:`SYSTEM` for rlinf's
own traffic (goodbyes, shared-memory releases, ...). Two layouts exist:

* ``packed`` false (a large message): ``layout[i]`` says how many payload frames carry
  buffer ``i`` (large buffers are cut into chunks of at most :data:`MAX_FRAME` bytes;
  see BENCHMARKS.md for why).
* ``packed`` true (coalesced small messages): all buffers of all entries are
  concatenated into one payload frame and ``layout[i]`` is buffer ``i``'s size in bytes.
  One frame instead of one per buffer keeps the per-message cost low.

An entry may carry a fifth item, a shared-memory *slot* (see :class:`SlotRef`)::

    [kind, tag, codec_header, layout, [segment, offset, size, generation, private]]

Then a negative ``layout[i]`` (in either layout) marks buffer ``i`` as carried by the
slot instead of the frames: it holds ``-layout[i]`` bytes, placed in the slot by
:func:`slot_layout` (in buffer order, each at a :data:`SLOT_ALIGN`-byte boundary).
Only the descriptor travels through ZeroMQ; see ``rlinf/transports/shm.py``.

An entry may carry a sixth item, *relays*: places in other slots that this sender
forwards by reference (see ``rlinf/transports/_relay.py``); the fifth item is then the
entry's own slot or nil::

    [kind, tag, codec_header, layout, slot_or_nil, [[segment, offset, size, relay_id], ...]]

A layout item ``[r, offset, nbytes]`` marks a buffer carried by relay ``r`` at
``offset`` within it. A relay names a segment of the sender (a link to the owner's file)
and is mapped copy-on-write; it is released with ``[segment, relay_id]``.

A relay may instead be a torch storage the sender holds in shared memory (see
:class:`FdRef` and ``rlinf/transports/_fdshare.py``): ``[fd, dev, ino, size, hold_id]``,
the sender's file descriptor and the file's identity; it is mapped shared and released
with ``["fd", hold_id]`` once mapped.

An entry may carry a seventh item, its *GPU buffers* in a CUDA IPC slot of the sender's
(see :class:`GpuRef` and ``rlinf/transports/cuda_ipc.py``); the fifth and sixth items are
then the slot and relays, or nil::

    [kind, tag, codec_header, layout, slot_or_nil, relays_or_nil,
     [slot_id, generation, device, share_or_nil, event_or_nil, [[index, offset, nbytes], ...]]]

``layout`` then describes the host buffers only; buffer ``index`` of the message is the
device buffer at ``offset`` in the slot. ``share`` and ``event`` (torch's IPC description
of the slot and its ready event) come with the slot's first message to this receiver.

An entry may carry an eighth item instead of a slot, relays and GPU buffers (those three
are then nil): its large buffers are left in the sender's memory for the receiver to
*pull* (see :class:`PullRef` and ``rlinf/transports/_pull.py``)::

    [kind, tag, codec_header, layout, nil, nil, nil, [pull_id, [address, ...], token_address, token]]

A negative ``layout[i]`` then marks buffer ``i`` as pulled: ``-layout[i]`` bytes at the
next address, in buffer order. The 8 bytes at ``token_address`` hold ``token`` for as long
as the sender holds the buffers for the receiver.

Entries are in send order.

Every size and count is checked before anything is allocated; a bad header raises
:class:`~rlinf.errors.ProtocolError` and costs the sender its frames, not the receiver
its life.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import ProtocolError

__all__ = ["VERSION", "USER", "SYSTEM", "MAX_FRAME", "SLOT_ALIGN", "Entry", "SlotRef", "FdRef", "GpuRef", "PullRef",
           "pack_header",
           "HeaderPacker", "unpack_header", "slot_layout", "parse_segment_name"]

VERSION = 1
USER = 0
SYSTEM = 1
#: Largest payload frame; bigger buffers are chunked (page-fault cost of huge frames).
MAX_FRAME = 16 << 20
#: The integers msgpack carries (user tags, channel keys): [-2**63, 2**64 - 1].
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
MAX_HEADER = 64 << 20
#: Headers shorter than this are unpacked with msgpack's defaults (see unpack_header).
_SMALL_HEADER = 1 << 16
MAX_ENTRIES = 1 << 20
MAX_FRAMES = 1 << 22
#: Largest shared-memory slot a peer may describe (bounds every size taken from it).
MAX_SLOT = 1 << 40
#: Alignment of each buffer inside a slot (covers every dtype and cache lines).
SLOT_ALIGN = 64
_PAGE = 4096
#: Segment file names: ``rlinf-<pid>-<token>-<n>`` (the pid lets a sweeper find a dead
#: process's segments; nothing else may appear, so a name can never leave /dev/shm).
#: ``rlinf-<pid>-<pid namespace>-<pool>-<n>`` (see :mod:`rlinf.transports.leftovers`).
_SEGMENT_NAME = re.compile(r"rlinf-([0-9]{1,10})-(?:[0-9a-f]{1,16}|x)-[0-9a-f]{1,32}-[0-9]{1,12}")

_packer_opts = {"use_bin_type": True}


@dataclass(slots=True)
class Entry:
    """One message inside a frame set (see the module docstring)."""

    kind: int
    tag: Any
    codec_header: bytes
    frame_counts: list
    slot: SlotRef | None = None
    relays: list[SlotRef | FdRef] | None = None
    gpu: GpuRef | None = None
    pull: PullRef | None = None


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a message's shared-memory buffers are: a validated slot descriptor.

    Attributes:
        segment: file name in ``/dev/shm`` (``rlinf-<pid>-<token>-<n>``).
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


def _unpack_pull(raw: Any, pulled: int) -> PullRef:
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


def _unpack_gpu(raw: Any, host_buffers: int) -> GpuRef:
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
        # torch uses these unchecked: the counter offset is written to, the size and
        # offset bound the views, and the device is where the handle is opened
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


def _unpack_slot(raw: Any) -> SlotRef:
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


def _unpack_relays(raw: Any) -> list[SlotRef | FdRef]:
    if not (isinstance(raw, list) and 0 < len(raw) <= MAX_ENTRIES):
        raise ProtocolError("malformed relay list")
    relays: list[SlotRef | FdRef] = []
    for item in raw:
        if isinstance(item, list) and len(item) == 5:
            relays.append(_unpack_fd(item))
            continue
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("malformed relay")
        segment, offset, size, relay_id = item
        slot = _unpack_slot([segment, offset, size, relay_id, True])
        relays.append(slot)
    return relays


def _unpack_fd(item: list) -> FdRef:
    if not all(type(v) is int and v >= 0 for v in item):
        raise ProtocolError("malformed shared-file reference")
    fd, dev, ino, size, hold_id = item
    if fd >= 1 << 31 or not 0 < size <= MAX_SLOT:
        raise ProtocolError("bad shared-file reference bounds")
    return FdRef(fd, dev, ino, size, hold_id)


def _relayed_place(item: list, relays: list[SlotRef | FdRef] | None) -> None:
    """Check a ``[r, offset, nbytes]`` layout item against the entry's relays."""
    if relays is None or len(item) != 3 or not all(type(v) is int for v in item):
        raise ProtocolError("bad relayed buffer layout")
    r, offset, nbytes = item
    if not (0 <= r < len(relays) and offset >= 0 and nbytes > 0 and offset + nbytes <= relays[r].size):
        raise ProtocolError("relayed buffer outside its relay")


def _unpack_entry(raw: Any, limit: int, low: int) -> tuple[Entry, int]:
    """An entry with a slot and/or relays (or a malformed one): the entry, and the
    payload bytes/frames it announces."""
    if not (isinstance(raw, list) and 4 <= len(raw) <= 8):
        raise ProtocolError("malformed message entry")
    kind, tag, codec_header, counts = raw[:4]
    if kind not in (USER, SYSTEM) or not isinstance(codec_header, bytes) or not isinstance(counts, list):
        raise ProtocolError("malformed message entry")
    if not isinstance(tag, (int, str)) or isinstance(tag, bool):
        raise ProtocolError("message tag must be an int or str")
    if len(raw) == 8:
        return _unpack_pull_entry(raw, limit, low)
    slot = _unpack_slot(raw[4]) if len(raw) >= 5 and (len(raw) == 5 or raw[4] is not None) else None
    relays = _unpack_relays(raw[5]) if len(raw) >= 6 and raw[5] is not None else None
    gpu = _unpack_gpu(raw[6], len(counts)) if len(raw) == 7 else None
    total = in_slot = 0
    align = SLOT_ALIGN - 1
    for c in counts:
        if type(c) is int:
            if c < 0:
                if slot is None or c < -MAX_SLOT:
                    raise ProtocolError("bad buffer layout")
                in_slot += (align - c) & ~align
            elif low <= c <= limit:
                total += c
            else:
                raise ProtocolError("bad buffer layout")
        elif type(c) is list:
            _relayed_place(c, relays)
        else:
            raise ProtocolError("bad buffer layout")
    if slot is not None and not 0 < in_slot <= slot.size:
        raise ProtocolError(f"slot of {slot.size} bytes cannot hold the {in_slot} bytes announced")
    return Entry(kind, tag, codec_header, counts, slot, relays, gpu), total


def _unpack_pull_entry(raw: list, limit: int, low: int) -> tuple[Entry, int]:
    """An entry whose large buffers are pulled (its eighth item; see the module docstring)."""
    kind, tag, codec_header, counts, slot, relays, gpu, pull = raw
    if slot is not None or relays is not None or gpu is not None:
        raise ProtocolError("a pulled message carries no slot, relays or GPU buffers")
    total = pulled = span = 0
    for c in counts:
        if type(c) is not int:
            raise ProtocolError("bad buffer layout")
        if c < 0:
            pulled += 1
            span -= c
        elif low <= c <= limit:
            total += c
        else:
            raise ProtocolError("bad buffer layout")
    if not 0 < span <= MAX_SLOT:
        raise ProtocolError("bad pulled buffer sizes")
    return Entry(kind, tag, codec_header, counts, pull=_unpack_pull(pull, pulled)), total


def pack_header(src: str, incarnation: str, entries: list[list], packed: bool = False) -> bytes:
    """Pack a frame-set header. ``entries`` are ``[kind, tag, codec_header, layout]``,
    optionally followed by a slot descriptor (see the module docstring)."""
    return msgpack.packb([VERSION, src, incarnation, entries, packed], **_packer_opts)


class HeaderPacker:
    """Packs the frame-set headers of one sender, as :func:`pack_header` does.

    The constant start of the header (version, ``src``, ``incarnation``) is packed once
    and the packer is reused: a small message's header costs one pack of its entries.
    Not thread-safe: one per communicator, shared by its sending queues (loop thread);
    its msgpack buffer takes 256 KiB.
    """

    __slots__ = ("_prefix", "_pack")

    def __init__(self, src: str, incarnation: str) -> None:
        packer = msgpack.Packer(**_packer_opts)
        # fixarray of 5 items: VERSION, src, incarnation, entries, packed
        self._prefix = b"\x95" + packer.pack(VERSION) + packer.pack(src) + packer.pack(incarnation)
        self._pack = packer.pack

    def pack(self, entries: list[list], packed: bool = False) -> bytes:
        """The header of a frame set carrying ``entries`` (see :func:`pack_header`)."""
        return self._prefix + self._pack(entries) + (b"\xc3" if packed else b"\xc2")


def unpack_header(data, frames: list) -> tuple[str, str, list[Entry], bool]:
    """Validate and unpack a frame-set header against the payload frames that came with it.

    Returns:
        ``(src, incarnation, entries, packed)``.

    Raises:
        ProtocolError: wrong version, bad shape, or a layout that does not match the frames.
    """
    if len(data) > MAX_HEADER:
        raise ProtocolError(f"data header of {len(data)} bytes exceeds {MAX_HEADER}")
    try:
        if len(data) < _SMALL_HEADER:
            # msgpack's default limits are the data's length, so within ours (an ext
            # value, allowed by them, fails the type checks below); no keywords to parse
            obj = msgpack.unpackb(data)
        else:
            obj = msgpack.unpackb(
                data, raw=False, strict_map_key=False, use_list=True,
                max_bin_len=MAX_HEADER, max_str_len=1 << 20, max_array_len=MAX_ENTRIES,
                max_map_len=1 << 16, max_ext_len=0,
            )
    except Exception as exc:  # msgpack raises many types for garbage input
        raise ProtocolError(f"undecodable data header: {exc}") from exc
    if not (isinstance(obj, list) and len(obj) == 5):
        raise ProtocolError("data header is not a 5-item array")
    version, src, incarnation, raw_entries, packed = obj
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version {version!r} (expected {VERSION})")
    if (not isinstance(src, str) or not isinstance(incarnation, str) or not isinstance(raw_entries, list)
            or not isinstance(packed, bool)):
        raise ProtocolError("data header has fields of the wrong type")
    entries = []
    append = entries.append
    total = 0
    limit = MAX_HEADER if packed else MAX_FRAMES
    low = 0 if packed else 1
    for raw in raw_entries:
        if type(raw) is list and len(raw) == 4:   # the common entry: no shared memory
            kind, tag, codec_header, counts = raw
            if (kind != USER and kind != SYSTEM) or type(codec_header) is not bytes or type(counts) is not list:
                raise ProtocolError("malformed message entry")
            if type(tag) is not int and type(tag) is not str:
                raise ProtocolError("message tag must be an int or str")
            for c in counts:
                if type(c) is not int or c < low or c > limit:
                    raise ProtocolError("bad buffer layout")
                total += c
            append(Entry(kind, tag, codec_header, counts))
        else:
            entry, n = _unpack_entry(raw, limit, low)
            total += n
            append(entry)
    if packed:
        have = len(frames) and memoryview(frames[0]).nbytes
        if len(frames) > 1 or total != have:
            raise ProtocolError(f"header announces {total} packed bytes, {have} arrived")
    elif total != len(frames):
        raise ProtocolError(f"header announces {total} payload frames, {len(frames)} arrived")
    return src, incarnation, entries, packed


def chunk_count(nbytes: int) -> int:
    """How many frames a buffer of ``nbytes`` takes (at least one)."""
    return max(1, -(-nbytes // MAX_FRAME))
