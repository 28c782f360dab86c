"""The channel protocol's messages: a list of ops packed by msgpack, plus large buffers.

Every message between a handle and the server is ``[blob, buffers]``: ``blob`` is the
msgpack encoding of a list of ops (tuples such as ``("put", key, weight, nbytes,
payload[, version, admission])``), and ``buffers`` holds the arrays of large payloads,
which the communicator sends out of band (zero-copy, or through shared memory on one
node). In the blob a large payload ``(2, header, [arrays])`` is written as ``(2,
header, first, count)``, an index range into ``buffers`` (in ``put`` ops and in the
items of ``items`` and ``ahead`` ops). Small payloads are plain
bytes inside the blob.

msgpack packs the ops in C: this keeps the per-item cost of the channel a few
microseconds. Arrays unpack as tuples, so tuple keys stay hashable.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import ProtocolError

__all__ = ["encode_ops", "decode_ops"]

_packb = msgpack.packb
_unpackb = msgpack.unpackb


def _out(payload: tuple, buffers: list) -> tuple:
    first = len(buffers)
    buffers.extend(payload[2])
    return (2, payload[1], first, len(payload[2]))


def encode_ops(ops: list, large: bool) -> list:
    """The message for ``ops``; ``large``: some op carries a large payload.

    Raises:
        TypeError: an op holds something msgpack cannot pack (a bad key).
    """
    buffers: list = []
    if large:
        fixed = []
        for op in ops:
            kind = op[0]
            if kind == "put" and op[4][0] == 2:
                op = (kind, op[1], op[2], op[3], _out(op[4], buffers), *op[5:])
            elif kind == "items" and any(i[2][0] == 2 for i in op[3]):
                op = (kind, op[1], op[2], _items_out(op[3], buffers))
            elif kind == "ahead" and any(i[2][0] == 2 for i in op[2]):
                op = (kind, op[1], _items_out(op[2], buffers))
            fixed.append(op)
        ops = fixed
    return [_packb(ops, use_bin_type=True), buffers]


def _items_out(items: list, buffers: list) -> list:
    return [(i[0], i[1], _out(i[2], buffers) if i[2][0] == 2 else i[2]) for i in items]


def _items_in(items: tuple, buffers: list) -> list:
    return [(i[0], i[1], _in(i[2], buffers) if i[2][0] == 2 else i[2]) for i in items]


def _in(payload: tuple, buffers: list) -> tuple:
    first, count = payload[2], payload[3]
    if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and first + count <= len(buffers)):
        raise ProtocolError("channel payload refers to buffers the message does not have")
    return (2, payload[1], buffers[first:first + count])


def decode_ops(message: Any) -> list:
    """The ops of a received message (large payloads get their buffers back).

    Raises:
        ProtocolError: the message is malformed.
    """
    try:
        blob, buffers = message
        ops = _unpackb(blob, raw=False, use_list=False, strict_map_key=False)
        if not isinstance(ops, tuple):
            raise ProtocolError("channel message is not a list of ops")
        if not buffers:
            return ops
        fixed = []
        for op in ops:
            kind = op[0]
            if kind == "put" and op[4][0] == 2:
                op = (kind, op[1], op[2], op[3], _in(op[4], buffers), *op[5:])
            elif kind == "items":
                op = (kind, op[1], op[2], _items_in(op[3], buffers))
            elif kind == "ahead":           # items sent ahead (rlinf.channel._ahead)
                op = (kind, op[1], _items_in(op[2], buffers))
            fixed.append(op)
        return fixed
    except ProtocolError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, msgpack.exceptions.UnpackException) as exc:
        raise ProtocolError(f"malformed channel message: {exc!r}") from exc
