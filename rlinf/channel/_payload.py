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

__all__ = ["PACK_LIMIT", "pack", "unpack", "decoded"]

#: Items up to this many encoded bytes travel as one packed blob.
PACK_LIMIT = 64 << 10


def pack(codec: Codec, item: Any) -> tuple[tuple, int]:
    """Encode ``item``: returns ``(payload, nbytes)``; ``payload`` is plain codec data.

    Raises:
        EncodeError: ``item`` cannot be encoded (the path inside it is named).
    """
    header, buffers = codec.encode(item)
    sizes = [len(header)]
    host = True
    for b in buffers:
        if type(b) is memoryview:        # host memory, as the codec gives it (the cheap test)
            sizes.append(b.nbytes)
        else:
            host = host and not is_device_buffer(b)
            sizes.append(buffer_nbytes(b))
    nbytes = sum(sizes) - sizes[0]
    if host and nbytes + sizes[0] <= PACK_LIMIT:
        if not buffers:
            return (0, header), 0
        return (1, sizes, b"".join([header, *buffers])), nbytes
    wrapped = [b if is_device_buffer(b) else np.frombuffer(b, dtype=np.uint8) for b in buffers]
    return (2, header, wrapped), nbytes


#: The layout of a payload decoded ahead of ``get`` (:func:`decoded`); never on the wire.
DECODED = 3


def decoded(codec: Codec, payload: tuple) -> tuple:
    """``payload`` decoded now, as a payload :func:`unpack` returns at once; one that
    cannot be decoded now (malformed, or no device memory for its GPU tensors yet) is
    returned as it is: its ``get`` decodes it again and raises what fails then."""
    try:
        return (DECODED, unpack(codec, payload))
    except Exception:
        return payload


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
        view = memoryview(blob) if type(blob) is bytes else memoryview(blob).cast("B")
        if sum(sizes) != view.nbytes:
            raise ValueError("channel payload sizes do not match its data")
        head = sizes[0]
        # a small header is cheaper to decode as bytes (it is copied, the buffers are not)
        header = blob[:head] if type(blob) is bytes and head <= 4096 else view[:head]
        buffers, offset = [], head
        for n in sizes[1:]:
            buffers.append(view[offset:offset + n])
            offset += n
        return codec.decode(header, buffers)
    if kind == 2:
        header, buffers = payload[1], payload[2]
        return codec.decode(header, [b if is_device_buffer(b) else memoryview(b) for b in buffers])
    if kind == DECODED:
        return payload[1]
    raise ValueError(f"unknown channel payload layout {kind!r}")
