"""Item payloads: encoded once by the producer, opaque to the channel server.

The producer encodes an item with its codec into ``(header, buffers)``. The server never
decodes it (it needs none of the item's classes and never unpickles anything); the
consumer decodes it with its codec.

* Small items (header + buffers <= ``PACK_LIMIT``) are packed into one bytes blob with
  their sizes: one copy at ``put`` (the caller may reuse its buffers at once); the
  channel's messages carry it inline (see :mod:`._wire`).
* Large items keep their buffers separate, wrapped as uint8 arrays, so every hop sends
  them zero-copy (and receivers get views over the received frames, never copies).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..codec import Codec, buffer_nbytes, is_device_buffer

__all__ = ["PACK_LIMIT", "pack", "unpack"]

#: Items up to this many encoded bytes travel as one packed blob.
PACK_LIMIT = 64 << 10


def pack(codec: Codec, item: Any) -> tuple[tuple, int]:
    """Encode ``item``: returns ``(payload, nbytes)``; ``payload`` is plain codec data.

    Raises:
        EncodeError: ``item`` cannot be encoded (the path inside it is named).
    """
    header, buffers = codec.encode(item)
    nbytes = 0
    device = False
    for b in buffers:
        if is_device_buffer(b):
            device = True
        nbytes += buffer_nbytes(b)
    if not device and nbytes + len(header) <= PACK_LIMIT:
        if not buffers:
            return (0, header), nbytes
        sizes = [len(header)]
        sizes.extend(buffer_nbytes(b) for b in buffers)
        return (1, sizes, b"".join([header, *buffers])), nbytes
    wrapped = [b if is_device_buffer(b) else np.frombuffer(b, dtype=np.uint8) for b in buffers]
    return (2, header, wrapped), nbytes


def unpack(codec: Codec, payload: tuple) -> Any:
    """Decode a payload made by :func:`pack` (arrays in it are views, writable).

    Raises:
        DecodeError: the payload is malformed.
        ValueError: the payload's layout is unknown.
    """
    kind = payload[0]
    if kind == 0:
        return codec.decode(payload[1], [])
    if kind == 1:
        sizes, blob = payload[1], payload[2]
        view = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
        parts, offset = [], 0
        for n in sizes:
            parts.append(view[offset:offset + n])
            offset += n
        if offset != view.nbytes:
            raise ValueError("channel payload sizes do not match its data")
        return codec.decode(parts[0], parts[1:])
    if kind == 2:
        header, buffers = payload[1], payload[2]
        return codec.decode(header, [b if is_device_buffer(b) else memoryview(b) for b in buffers])
    raise ValueError(f"unknown channel payload layout {kind!r}")
