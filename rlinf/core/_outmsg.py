"""A message on its way out: what the outbox queues for one peer, and its sizes.

Buffer lifetimes: see :mod:`rlinf.core._outbox` (a small message's buffers are copies
made when it is queued; a large message references the caller's buffers until the
transport released them).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from . import wire
from ._credit import BULK_BYTES
from ..errors import ClosedError

__all__ = ["BATCH_BYTES", "BATCH_COUNT", "IN_FLIGHT", "OutMessage", "SMALL_MESSAGE", "copy_failed", "to_zmq",
           "wire_bytes"]

#: Messages below this many payload bytes are copied and coalesced; from it on, they
#: count in the bulk lane of the receiver's window (see :mod:`rlinf.core._credit`).
SMALL_MESSAGE = BULK_BYTES
#: Bytes of one coalesced frame set. Below glibc's mmap threshold (128 KiB): larger
#: headers and blobs are fresh mappings each time, written at ~0.7 GB/s (page faults)
#: on the sender and again allocated by ZeroMQ on the receiver; measured, 1 KiB
#: messages cost the sender ~15 µs each in 1 MiB frame sets and ~12 µs in 64 KiB ones.
BATCH_BYTES = 64 << 10
BATCH_COUNT = 4096
#: Seconds after a send during which the link counts as busy: a message that follows
#: sooner is queued for the next flush (coalesced with the rest of its burst) instead
#: of going out alone. Far below any round trip (>= ~50 µs even on raw sockets), so
#: request/reply traffic is always sent at once.
IN_FLIGHT = 20e-6


def to_zmq(msg: OutMessage) -> None:
    """Turn a message queued for the bulk stream into a large ZeroMQ message."""
    msg.frames, msg.entry[wire.LAYOUT], _ = wire.split_frames(msg.frames)
    msg.transport = "zmq"


def copy_failed(msg: OutMessage) -> None:
    """``msg``'s copy into shared memory failed or was cancelled: its send fails, its
    slot goes back."""
    copying = msg.copying
    exc = ClosedError("copy into shared memory was cancelled") if copying.cancelled() else copying.exception()
    if msg.future is not None and not msg.future.done():
        msg.future.set_exception(exc)
    if msg.discard is not None:
        msg.discard()


def wire_bytes(msg: OutMessage) -> int:
    """What a small message adds to a coalesced frame set: its codec header and, unless
    its buffers travel in shared memory (only their descriptor does), its payload."""
    if msg.transport == "zmq":
        return len(msg.entry[wire.CODEC_HEADER]) + msg.nbytes
    return len(msg.entry[wire.CODEC_HEADER]) + sum(len(f) for f in msg.frames)   # e.g. a GPU message's host part


class OutMessage:
    """One queued message. ``future`` is None for fire-and-forget small sends.

    ``entry`` is ``[kind, tag, codec_header, layout]`` (+ a slot; see :mod:`rlinf.core.wire`);
    a small message's ``layout`` may be None: the flush derives it from ``frames``.
    ``copying`` (a future) holds the message until its shared-memory copy is done;
    ``discard()`` is called if the message is dropped unsent.
    """

    __slots__ = ("entry", "frames", "nbytes", "future", "large", "started", "transport", "copying", "discard",
                 "pending", "acked", "counted")

    def __init__(self, entry: list, frames: list, nbytes: int, future: asyncio.Future | None, large: bool,
                 *, transport: str = "zmq", copying: asyncio.Future | None = None,
                 discard: Callable[[], None] | None = None) -> None:
        self.entry = entry
        self.frames = frames
        self.nbytes = nbytes
        self.future = future
        self.large = large
        self.transport = transport
        self.copying = copying
        self.discard = discard
        self.pending = 0          # a large message: its sendings the transport has not released yet
        self.acked = False        # a large message: the receiver acknowledged it
        self.counted = False      # it counts against the receiver's window (see rlinf.core._credit)
        # fire-and-forget small sends complete at once: no latency to measure
        self.started = time.perf_counter() if future is not None else 0.0

    @property
    def tag(self) -> int | str:
        """The message's tag."""
        return self.entry[wire.TAG]
