"""Delivery: sequence numbers, acknowledgements and resends for one pair of incarnations.

Every frame set a communicator sends to a peer carries its place in the sender's *log*
to that peer (``epoch``, ``seq``: see :mod:`rlinf.core.wire`), and the receiver's
acknowledgement of the peer's own log (``ack_epoch``, ``ack``), so acknowledgements
ride on the traffic that flows anyway.

Sender (:class:`SendLog`, one per :class:`~rlinf.core._outbox.Outbox`): each message
gets the next number when its frame set is handed to a link; the frame set (its header
body and payload, no copy) is kept until the receiver acknowledged it, and is sent
again, with the same numbers and frame boundaries, after a link was dialled anew, when
the receiver reports a gap, or when no acknowledgement came for :data:`RTO` seconds
(doubling up to :data:`RTO_MAX`). A log outlives its session when the peer was only
declared lost: the same incarnation, once back, resumes it (nothing skipped, nothing
delivered twice). Its ``epoch``, random, tells a receiver that a log started anew.

Receiver (:class:`Inflow`, one per sender incarnation, kept by the peer sessions):
frame sets are delivered in ``seq`` order whichever link brought them (ZeroMQ, the
stream, the bulk stream); one that arrives early is parked until the ones before it
came; one already delivered is dropped (and acknowledged again). What arrived is
acknowledged on the next frame set to the sender, or on its own after
:data:`ACK_DELAY` (at once for large frame sets, whose send completes only then). A gap
that lasts :data:`GAP_DELAY` asks the sender to resend.

Buffer lifetimes: a kept frame set references its payload (copies for small messages;
the caller's buffers for a large one, whose send completes only once it is acknowledged
and the transport released them); a parked one references its received frames.
"""

from __future__ import annotations

import collections
import secrets
from typing import Any

import msgpack

__all__ = ["ACK_DELAY", "GAP_DELAY", "RTO", "RTO_MAX", "TICK", "Kept", "SendLog", "Inflow", "new_epoch"]

#: Seconds an acknowledgement may wait for a frame set to ride on.
ACK_DELAY = 0.005
#: Seconds a gap (a frame set arrived ahead of one before it) may last before the
#: receiver asks for a resend: frame sets on two links (ZeroMQ and bulk) may cross.
GAP_DELAY = 0.05
#: Seconds without any acknowledgement before the unacknowledged frame sets are resent.
RTO = 1.0
RTO_MAX = 8.0
#: Seconds between two checks of the resend timers.
TICK = 0.25


def new_epoch() -> int:
    """A random, non-zero log epoch (0 means "no log" on the wire)."""
    return secrets.randbits(32) or 1


def packed_epoch(epoch: int) -> bytes:
    return msgpack.packb(epoch)


class Kept:
    """One frame set sent and not yet acknowledged: messages ``seq`` to ``end - 1``.

    ``body`` is its header without the delivery fields; ``entries`` the entries it was
    packed from, kept only when some cannot be sent again after a failure (large
    messages, buffers in slots: see ``Outbox.fail``), else None (a sender far ahead of
    the acknowledgements would otherwise keep a Python list per message alive, and the
    garbage collector walks them all); ``payload`` its payload frames
    (None once a bulk stream delivered it: it is never sent again), ``msg`` the large
    message it carries, whose send completes once it is acknowledged and released;
    ``credit``, what of it counts against the receiver's window (see :mod:`rlinf.core._credit`).
    """

    __slots__ = ("seq", "end", "entries", "body", "payload", "msg", "credit")

    def __init__(self, seq: int, end: int, entries: list, body: bytes, payload: list | None, msg: Any = None,
                 credit: tuple[int, int] | None = None) -> None:
        self.seq = seq
        self.end = end
        self.entries = entries
        self.body = body
        self.payload = payload
        self.msg = msg
        self.credit = credit      # (messages, bytes) of it that count against the peer's window


class SendLog:
    """The sender's side of one pair: numbering and the frame sets kept for a resend."""

    __slots__ = ("epoch", "packed", "next", "kept", "acked", "seen", "idle", "rto", "resend_from")

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = epoch or new_epoch()
        self.packed = packed_epoch(self.epoch)
        self.next = 0
        self.kept: collections.deque[Kept] = collections.deque()
        self.acked = 0            # every message below this arrived
        self.seen = 0             # ``acked`` at the last tick (see :meth:`due`)
        self.idle = 0.0           # seconds of ticks without progress while frame sets are kept
        self.rto = RTO
        self.resend_from: int | None = None   # a resend in progress: the next seq to send again

    def __repr__(self) -> str:
        return f"<SendLog {self.epoch:08x} next={self.next} acked={self.acked} kept={len(self.kept)}>"

    def keep(self, seq: int, count: int, entries: list | None, body: bytes, payload: list | None,
             msg: Any = None, credit: tuple[int, int] | None = None) -> Kept:
        kept = Kept(seq, seq + count, entries, body, payload, msg, credit)
        self.next = kept.end
        self.kept.append(kept)
        return kept

    def ack(self, upto: int) -> list[Kept]:
        """Messages below ``upto`` arrived: the frame sets that leaves unneeded."""
        if upto <= self.acked:
            return []
        self.acked = min(upto, self.next)
        done = []
        kept = self.kept
        while kept and kept[0].end <= upto:
            done.append(kept.popleft())
        if self.resend_from is not None and self.resend_from < self.acked:
            self.resend_from = self.acked if kept else None
        return done

    def due(self) -> bool:
        """One tick passed (:data:`TICK`): True when the kept frame sets must be sent
        again (no acknowledgement for the resend timeout, which then doubles)."""
        if not self.kept:
            self.idle, self.rto = 0.0, RTO
            return False
        if self.acked != self.seen:
            self.seen, self.idle, self.rto = self.acked, 0.0, RTO
            return False
        self.idle += TICK
        if self.idle < self.rto:
            return False
        self.idle, self.rto = 0.0, min(self.rto * 2, RTO_MAX)
        return True


class Inflow:
    """The receiver's side of one pair: what arrived from one sender incarnation.

    ``expected`` is the next message number to deliver (all below arrived), in the
    sender's log ``epoch`` (0 until its first frame set). ``parked`` holds frame sets
    that came early, by ``seq``. ``owed``: an acknowledgement is due.

    Flow control (see :mod:`rlinf.core._credit`): ``held`` and ``held_bytes`` count the
    sender's user messages waiting in our mailbox (the mailbox keeps them, through
    ``Message.credit``); ``reported`` and ``reported_bytes`` what the last frame set to
    the sender said; ``step``/``step_bytes``: how much taken since then is worth a
    frame set of its own (``notify()`` sends it).
    """

    __slots__ = ("address", "incarnation", "identity", "epoch", "packed", "expected", "parked", "owed",
                 "timer", "gap_timer", "acked_sent", "held", "held_bytes", "reported", "reported_bytes",
                 "step", "step_bytes", "notify")

    def __init__(self, address: str, incarnation: str, identity: bytes) -> None:
        self.address = address
        self.incarnation = incarnation
        self.identity = identity
        self.epoch = 0
        self.packed = b"\x00"
        self.expected = 0
        self.parked: dict[int, tuple] = {}
        self.owed = False
        self.timer = None          # the pending acknowledgement's timer
        self.gap_timer = None      # the pending request for a resend
        self.acked_sent = -1       # the last acknowledgement sent
        self.held = self.held_bytes = 0
        self.reported = self.reported_bytes = 0
        self.step = self.step_bytes = 1 << 62
        self.notify: Any = None    # () -> None: tell the sender what it may send now

    def taken(self) -> None:
        """Our application took messages: tell the sender when that frees enough."""
        if (self.reported - self.held >= self.step or self.reported_bytes - self.held_bytes >= self.step_bytes) \
                and self.notify is not None:
            self.notify()

    def __repr__(self) -> str:
        return f"<Inflow {self.address} {self.epoch:08x} expected={self.expected} parked={len(self.parked)}>"

    def adopt(self, epoch: int) -> bool:
        """The sender's log is ``epoch``: True when that starts a new log although the
        old one had begun (messages of the old one may be missing)."""
        started = self.expected > 0 or bool(self.parked)
        self.epoch, self.packed = epoch, packed_epoch(epoch)
        self.expected = 0
        self.parked.clear()
        return started

    def cancel_timers(self) -> None:
        for timer in (self.timer, self.gap_timer):
            if timer is not None:
                timer.cancel()
        self.timer = self.gap_timer = None
