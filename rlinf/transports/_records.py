"""Sealed records over an event-loop stream (the TCP stream links, :mod:`.tcp_stream`).

With encryption on, the bytes of a stream link (frame tables and frames, exactly as
unsealed: see :mod:`.stream`) go in records::

    u32 n | ciphertext (n <= RECORD) | tag

each sealed with the connection's key of that direction and the next counter nonce
(:class:`._aead.Sealer`), so a record that is changed, dropped, replayed or reordered
fails its tag and the connection is closed. A frame set is sealed as one record, or as
several of at most :data:`RECORD` bytes; the receiver opens each record straight into
the place its plaintext takes in the receive block, and parses frame sets from there as
if they came unsealed.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Callable, Sequence

from ._aead import Sealer

__all__ = ["RECORD", "seal", "Opener"]

#: The most plaintext one record holds.
RECORD = 256 << 10
_LEN = struct.Struct("<I")


def _address(buffer: Any) -> int:
    """The address of a writable buffer (bytearray, writable view)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def seal(sealer: Sealer, pieces: Sequence[Any]) -> bytearray:
    """The records of ``pieces`` (bytes and byte views, joined), sealed in order.

    The result is a new buffer: the caller's pieces may be reused at once.
    """
    plain = b"".join(pieces)
    n, tag = len(plain), sealer.tag_bytes
    out = bytearray(n + -(-n // RECORD) * (_LEN.size + tag))
    base, at = _address(out), 0
    for start in range(0, n, RECORD):
        k = min(RECORD, n - start)
        _LEN.pack_into(out, at, k)
        out[at + 4:at + 4 + k] = plain[start:start + k] if k < n else plain
        sealer.seal_at(base + at + 4, k)        # in place; the tag right after
        at += 4 + k + tag
    return out


class Opener:
    """The receiving end of a sealed stream: raw bytes are read into :meth:`buffer`, and
    :meth:`opened` opens every complete record into the memory ``room`` gives.

    Args:
        sealer: the incoming direction's sealer.
    """

    def __init__(self, sealer: Sealer) -> None:
        self._sealer = sealer
        # one whole record fits, so what is left after opening the complete ones (a part
        # of the next) always leaves room to read more
        raw = bytearray(_LEN.size + RECORD + sealer.tag_bytes)
        self._raw = memoryview(raw)
        self._base = _address(raw)     # (the view's export keeps the bytearray from moving)
        self._start = self._end = 0    # raw bytes not opened yet: raw[start:end]

    def buffer(self) -> memoryview:
        """Where the next raw bytes go (after what is left of the last read, moved to
        the start: one whole record always fits)."""
        if self._start:
            start, end = self._start, self._end
            self._raw[:end - start] = self._raw[start:end]
            self._start, self._end = 0, end - start
        return self._raw[self._end:]

    def arrived(self, nbytes: int) -> None:
        """``nbytes`` raw bytes were read into :meth:`buffer`."""
        self._end += nbytes

    def open_next(self, room: Callable[[int], memoryview]) -> bool:
        """Open the next complete record into ``room(n)`` (a writable view of the
        record's ``n`` plaintext bytes); False when no record is complete.

        Raises:
            ValueError: a record claims more than :data:`RECORD` bytes, or fails its tag
                (:class:`._aead.AuthenticationFailed`).
        """
        at, end = self._start, self._end
        if end - at < _LEN.size:
            return False
        (n,) = _LEN.unpack_from(self._raw, at)
        if not 0 < n <= RECORD:
            raise ValueError(f"a sealed record of {n} bytes")
        size = _LEN.size + n + self._sealer.tag_bytes
        if end - at < size:
            return False
        self._sealer.open_at(self._base + at + _LEN.size, n, _address(room(n)))
        self._start = at + size
        return True
