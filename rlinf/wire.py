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

Entries are in send order.

Every size and count is checked before anything is allocated; a bad header raises
:class:`~rlinf.errors.ProtocolError` and costs the sender its frames, not the receiver
its life.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ProtocolError

__all__ = ["VERSION", "USER", "SYSTEM", "MAX_FRAME", "Entry", "pack_header", "unpack_header"]

VERSION = 1
USER = 0
SYSTEM = 1
#: Largest payload frame; bigger buffers are chunked (page-fault cost of huge frames).
MAX_FRAME = 16 << 20
MAX_HEADER = 64 << 20
MAX_ENTRIES = 1 << 20
MAX_FRAMES = 1 << 22

_packer_opts = {"use_bin_type": True}


@dataclass(slots=True)
class Entry:
    """One message inside a frame set (see the module docstring)."""

    kind: int
    tag: Any
    codec_header: bytes
    frame_counts: list[int]


def pack_header(src: str, incarnation: str, entries: list[list], packed: bool = False) -> bytes:
    """Pack a frame-set header. ``entries`` are ``[kind, tag, codec_header, layout]``."""
    return msgpack.packb([VERSION, src, incarnation, entries, packed], **_packer_opts)


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
    total = 0
    limit = MAX_HEADER if packed else MAX_FRAMES
    for raw in raw_entries:
        if not (isinstance(raw, list) and len(raw) == 4):
            raise ProtocolError("malformed message entry")
        kind, tag, codec_header, counts = raw
        if kind not in (USER, SYSTEM) or not isinstance(codec_header, bytes) or not isinstance(counts, list):
            raise ProtocolError("malformed message entry")
        if not isinstance(tag, (int, str)) or isinstance(tag, bool):
            raise ProtocolError("message tag must be an int or str")
        for c in counts:
            if type(c) is not int or c < (0 if packed else 1) or c > limit:
                raise ProtocolError("bad buffer layout")
            total += c
        entries.append(Entry(kind, tag, codec_header, counts))
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
