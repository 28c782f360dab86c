"""The data-plane frame layout, packed and validated in one place.

A frame set on a data link is ``[header, *payload_frames]``. The header is a msgpack
array ``[VERSION, src, incarnation, entries, packed, epoch, seq, skip, ack_epoch, ack,
ahead, held, held_bytes, held_bulk]``; the last nine carry the delivery protocol and the
flow control of the pair
(see :mod:`rlinf.core._delivery` and :mod:`rlinf.core._credit`): the entries are
messages ``seq``, ``seq + 1``, ... of the sender's log ``epoch`` to this receiver, and
``ack`` acknowledges the receiver's own log ``ack_epoch`` to the sender (every message
below ``ack`` arrived; a negative ``ack``, ``-(n + 1)``, also asks for everything from
``n`` on to be sent again; ``ack_epoch`` 0: no acknowledgement); ``ahead``, when not 0,
says that every message from ``ack + 1`` to ``ahead - 1`` arrived too (delivered ahead of
message ``ack``, a bulk message still on its way); ``held``, ``held_bytes`` and
``held_bulk`` say how many of the receiver's user messages from the sender (and their
bytes, small ones and bulk ones apart) wait in its mailbox, not yet received by its
application, as of that acknowledgement. ``skip``, when not 0, is ``n + 1`` for a bulk
message ``n`` still on its way on another link that this frame set may overtake (none of
its entries has that message's tag). A frame set without entries only acknowledges. Each entry describes
one message::

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
Only the descriptor travels through ZeroMQ; see :mod:`rlinf.transports.shm`.

An entry may carry a sixth item, *relays*: places in other slots that this sender
forwards by reference (see ``rlinf/transports/shm/_relay.py``); the fifth item is then the
entry's own slot or nil::

    [kind, tag, codec_header, layout, slot_or_nil, [[segment, offset, size, relay_id], ...]]

A layout item ``[r, offset, nbytes]`` marks a buffer carried by relay ``r`` at
``offset`` within it. A relay names a segment of the sender (a link to the owner's file)
and is mapped copy-on-write; it is released with ``[segment, relay_id]``.

A relay may instead be a torch storage the sender holds in shared memory (see
:class:`FdRef` and ``rlinf/transports/shm/_fdshare.py``): ``[fd, dev, ino, size, hold_id]``,
the sender's file descriptor and the file's identity; it is mapped shared and released
with ``["fd", hold_id]`` once mapped.

An entry may carry a seventh item, its *GPU buffers* in a CUDA IPC slot of the sender's
(see :class:`GpuRef` and ``rlinf/transports/cuda/ipc.py``); the fifth and sixth items are
then the slot and relays, or nil::

    [kind, tag, codec_header, layout, slot_or_nil, relays_or_nil,
     [slot_id, generation, device, share_or_nil, event_or_nil, [[index, offset, nbytes], ...]]]

``layout`` then describes the host buffers only; buffer ``index`` of the message is the
device buffer at ``offset`` in the slot. ``share`` and ``event`` (torch's IPC description
of the slot and its ready event) come with the slot's first message to this receiver.

An entry may carry an eighth item instead of a slot, relays and GPU buffers (those three
are then nil): its large buffers are left in the sender's memory for the receiver to
*pull* (see :class:`PullRef` and ``rlinf/transports/shm/_pull.py``)::

    [kind, tag, codec_header, layout, nil, nil, nil, [pull_id, [address, ...], token_address, token]]

A negative ``layout[i]`` then marks buffer ``i`` as pulled: ``-layout[i]`` bytes at the
next address, in buffer order. The 8 bytes at ``token_address`` hold ``token`` for as long
as the sender holds the buffers for the receiver.

Entries are in send order.

Every size and count is checked before anything is allocated; a bad header raises
:class:`~rlinf.errors.ProtocolError` and costs the sender its frames, not the receiver
its life.

This module owns the header: the entries, their layouts and the packing. The buffer
descriptors an entry carries (:class:`SlotRef`, :class:`FdRef`, :class:`GpuRef`,
:class:`PullRef`), their validators, :func:`slot_layout`, :func:`parse_segment_name` and
the size limits belong to the transports that use them (:mod:`rlinf.transports.descriptors`);
they are imported from there and re-exported here for the session layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import ProtocolError
from ..transports.descriptors import (
    INT_MAX, INT_MIN, MAX_FRAMES, MAX_HEADER, MAX_SLOT, SLOT_ALIGN, FdRef, GpuRef, PullRef, SlotRef,
    parse_segment_name, slot_layout, unpack_gpu, unpack_pull, unpack_relays, unpack_slot,
)

__all__ = ["VERSION", "USER", "SYSTEM", "MAX_FRAME", "Entry", "pack_header", "HeaderPacker", "unpack_header", "unpack",
           "check_tag", "split_frames", "bulk_frames", "plain_entry", "system_entry", "void_entry", "VOID", "gpu_entry", "slot_entry", "pull_entry", "with_layout", "CODEC_HEADER",
           "LAYOUT",
           # the transports' descriptors and limits, re-exported (see the module docstring)
           "SLOT_ALIGN", "MAX_SLOT", "MAX_FRAMES", "MAX_HEADER", "INT_MIN", "INT_MAX", "SlotRef", "FdRef", "GpuRef",
           "PullRef", "slot_layout", "parse_segment_name"]

VERSION = 4
USER = 0
SYSTEM = 1
#: Largest payload frame; bigger buffers are chunked (page-fault cost of huge frames).
MAX_FRAME = 16 << 20
#: Headers shorter than this are unpacked with msgpack's defaults (see unpack_header).
_SMALL_HEADER = 1 << 16
MAX_ENTRIES = 1 << 20
_U32 = (1 << 32) - 1
_SEQ_END = 1 << 63

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


def split_frames(buffers: list[Any]) -> tuple[list[Any], list[int], int]:
    """Cut buffers into frames of at most ``MAX_FRAME`` bytes (views, no copy).

    Returns:
        ``(frames, frame_counts, total_bytes)``.
    """
    frames, counts, total = [], [], 0
    for buf in buffers:
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        n = mv.nbytes
        total += n
        if n <= MAX_FRAME:
            frames.append(mv)
            counts.append(1)
        else:
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            pieces = range(0, n, MAX_FRAME)
            frames.extend(mv[i:i + MAX_FRAME] for i in pieces)
            counts.append(len(pieces))
    return frames, counts, total


def bulk_frames(buffers: list[Any]) -> tuple[list[memoryview], list[int], int]:
    """One frame per buffer, for the bulk stream (which reads each into place whole).

    Returns:
        ``(frames, frame_counts, total_bytes)``, as :func:`split_frames`.
    """
    frames = []
    for buf in buffers:
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        frames.append(mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
    return frames, [1] * len(frames), sum(f.nbytes for f in frames)


def check_tag(tag: Any) -> None:
    """Check a user's tag: an ``int`` that msgpack carries (a ``str`` tag is rlinf's own).

    Raises:
        TypeError: not an int. ValueError: outside ``[-2**63, 2**64 - 1]``.
    """
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not INT_MIN <= tag <= INT_MAX:
        raise ValueError(f"tag must lie in [-2**63, 2**64 - 1], got {tag}")


#: Positions in an outgoing entry (a list, packed by msgpack as it is: see the module
#: docstring). Build entries with the functions below, never by hand.
KIND, TAG, CODEC_HEADER, LAYOUT = 0, 1, 2, 3


def plain_entry(kind: int, tag: Any, codec_header: bytes, layout: list | None) -> list:
    """A message whose buffers travel in the frames (``layout`` None: filled in by
    :func:`with_layout` when the frames are final)."""
    return [kind, tag, codec_header, layout]


def system_entry(tag: str, codec_header: bytes = b"") -> list:
    """A SYSTEM message without buffers (a notice, the goodbye)."""
    return [SYSTEM, tag, codec_header, []]


def gpu_entry(kind: int, tag: Any, codec_header: bytes, layout: list | None, gpu: list) -> list:
    """A message whose device buffers wait in a CUDA IPC slot (``gpu``, see
    :class:`GpuRef`); ``layout`` describes its host buffers."""
    return [kind, tag, codec_header, layout, None, None, gpu]


def slot_entry(kind: int, tag: Any, codec_header: bytes, layout: list, slot: list | None,
               relays: list | None = None, gpu: list | None = None) -> list:
    """A message whose buffers sit in shared memory: our ``slot`` (see :class:`SlotRef`)
    and/or ``relays`` (other slots forwarded by reference), with ``gpu`` its CUDA IPC
    buffers, if any."""
    if gpu is not None:
        return [kind, tag, codec_header, layout, slot, relays, gpu]
    if relays is not None:
        return [kind, tag, codec_header, layout, slot, relays]
    return [kind, tag, codec_header, layout, slot]


def pull_entry(tag: Any, codec_header: bytes, layout: list, pull: list) -> list:
    """A user message whose large buffers the receiver pulls from our memory (``pull``,
    see :class:`PullRef`)."""
    return [USER, tag, codec_header, layout, None, None, None, pull]


#: The SYSTEM tag of a void entry: it stands for a message that was sent but can no
#: longer be sent again (see :func:`void_entry`).
VOID = "void"


def void_entry(entry: list) -> list:
    """A SYSTEM entry taking the place of ``entry`` in a sender's log: its codec header
    is ``msgpack([kind, tag])`` of the message, which its receiver reports as lost."""
    return [SYSTEM, VOID, msgpack.packb([entry[KIND], entry[TAG]], **_packer_opts), []]


def with_layout(entry: list, layout: list) -> list:
    """``entry`` with its layout filled in (a copy; what follows the layout is kept)."""
    return [entry[KIND], entry[TAG], entry[CODEC_HEADER], layout, *entry[4:]]


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
    slot = unpack_slot(raw[4]) if len(raw) >= 5 and (len(raw) == 5 or raw[4] is not None) else None
    relays = unpack_relays(raw[5]) if len(raw) >= 6 and raw[5] is not None else None
    gpu = unpack_gpu(raw[6], len(counts)) if len(raw) == 7 else None
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
    return Entry(kind, tag, codec_header, counts, pull=unpack_pull(pull, pulled)), total


def pack_header(src: str, incarnation: str, entries: list[list], packed: bool = False, epoch: int = 0,
                seq: int = 0, skip: int = 0, ack_epoch: int = 0, ack: int = 0, ahead: int = 0, held: int = 0,
                held_bytes: int = 0, held_bulk: int = 0) -> bytes:
    """Pack a frame-set header. ``entries`` are ``[kind, tag, codec_header, layout]``,
    optionally followed by a slot descriptor (see the module docstring)."""
    return msgpack.packb([VERSION, src, incarnation, entries, packed, epoch, seq, skip, ack_epoch, ack, ahead, held,
                          held_bytes, held_bulk], **_packer_opts)


class HeaderPacker:
    """Packs the frame-set headers of one sender, as :func:`pack_header` does.

    The constant start of the header (version, ``src``, ``incarnation``) is packed once
    and the packer is reused. A header is packed in two steps: :meth:`body` (the
    entries: once per frame set, kept for a resend) and :meth:`seal` (the delivery
    fields, packed again for each sending). Not thread-safe: one per communicator,
    shared by its sending queues (loop thread); its msgpack buffer takes 256 KiB.
    """

    __slots__ = ("_prefix", "_pack")

    def __init__(self, src: str, incarnation: str) -> None:
        packer = msgpack.Packer(**_packer_opts)
        # fixarray of 14 items: VERSION, src, incarnation, entries, packed, epoch, seq, skip, ack_epoch,
        # ack, ahead, held, held_bytes, held_bulk
        self._prefix = b"\x9e" + packer.pack(VERSION) + packer.pack(src) + packer.pack(incarnation)
        self._pack = packer.pack

    def body(self, entries: list[list], packed: bool = False) -> bytes:
        """The header up to its delivery fields."""
        return self._prefix + self._pack(entries) + (b"\xc3" if packed else b"\xc2")

    def seal(self, body: bytes, epoch: bytes, seq: int, skip: int, ack_epoch: bytes, ack: int, ahead: int = 0,
             held: int = 0, held_bytes: int = 0, held_bulk: int = 0) -> bytes:
        """``body`` completed with the delivery and flow-control fields (epochs already packed)."""
        pack = self._pack
        return (body + epoch + pack(seq) + pack(skip) + ack_epoch + pack(ack) + pack(ahead) + pack(held)
                + pack(held_bytes) + pack(held_bulk))

    def pack(self, entries: list[list], packed: bool = False) -> bytes:
        """A whole header with delivery fields 0 (see :func:`pack_header`)."""
        return self.body(entries, packed) + b"\x00" * 9


def unpack(data, frames: list) -> tuple[str, str, list[Entry], bool, int, int, int, int, int, int, int, int, int]:
    """Validate and unpack a frame-set header against the payload frames that came with it.

    Returns:
        ``(src, incarnation, entries, packed, epoch, seq, skip, ack_epoch, ack, ahead, held, held_bytes,
        held_bulk)``.

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
    if not (isinstance(obj, list) and len(obj) == 14):
        if isinstance(obj, list) and obj and obj[0] != VERSION:
            raise ProtocolError(f"unsupported wire version {obj[0]!r} (expected {VERSION})")
        raise ProtocolError("data header is not a 14-item array")
    (version, src, incarnation, raw_entries, packed, epoch, seq, skip, ack_epoch, ack, ahead, held, held_bytes,
     held_bulk) = obj
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version {version!r} (expected {VERSION})")
    if (not isinstance(src, str) or not isinstance(incarnation, str) or not isinstance(raw_entries, list)
            or not isinstance(packed, bool)):
        raise ProtocolError("data header has fields of the wrong type")
    if not (type(epoch) is int and type(seq) is int and type(ack_epoch) is int and type(ack) is int
            and 0 <= epoch <= _U32 and 0 <= ack_epoch <= _U32 and 0 <= seq < _SEQ_END and -_SEQ_END < ack < _SEQ_END
            and type(held) is int and type(held_bytes) is int and 0 <= held < _SEQ_END and 0 <= held_bytes < _SEQ_END
            and type(held_bulk) is int and type(skip) is int and 0 <= held_bulk < _SEQ_END and 0 <= skip <= seq
            and type(ahead) is int and 0 <= ahead < _SEQ_END):
        raise ProtocolError("data header has bad delivery fields")
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
    return src, incarnation, entries, packed, epoch, seq, skip, ack_epoch, ack, ahead, held, held_bytes, held_bulk


def unpack_header(data, frames: list) -> tuple[str, str, list[Entry], bool]:
    """:func:`unpack` without the delivery fields: ``(src, incarnation, entries, packed)``."""
    return unpack(data, frames)[:4]

