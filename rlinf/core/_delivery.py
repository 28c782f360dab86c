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
came; one already delivered is dropped (and acknowledged again). One exception keeps
small messages from waiting for bulk ones (DESIGN.md §4: ordering is per sender,
receiver and tag): while a large message is on its way on the bulk stream, the sender
goes on sending user messages with other tags, each frame set saying which message it
may *skip* (``wire``: ``skip``); such a frame set is delivered as soon as everything
before it but that message arrived, and the receiver acknowledges it apart
(``wire``: ``ahead``; the acknowledgement itself covers an unbroken prefix), so the
sender frees its credit and never sends it again. What arrived is
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

from ._credit import BULK_BYTES

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
    ``credit``, what of it counts against the receiver's window (messages, small-lane and
    bulk-lane bytes; see :mod:`rlinf.core._credit`); ``skip``, the bulk message it may
    overtake (``n + 1``; 0: none).
    """

    __slots__ = ("seq", "end", "entries", "body", "payload", "msg", "credit", "skip")

    def __init__(self, seq: int, end: int, entries: list, body: bytes, payload: list | None, msg: Any = None,
                 credit: tuple[int, int, int] | None = None, skip: int = 0) -> None:
        self.seq = seq
        self.end = end
        self.entries = entries
        self.body = body
        self.payload = payload
        self.msg = msg
        self.credit = credit      # (messages, bytes, bulk bytes) of it that count against the peer's window
        self.skip = skip


class SendLog:
    """The sender's side of one pair: numbering and the frame sets kept for a resend."""

    __slots__ = ("epoch", "packed", "next", "kept", "acked", "ahead", "seen", "idle", "rto", "resend_from")

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = epoch or new_epoch()
        self.packed = packed_epoch(self.epoch)
        self.next = 0
        self.kept: collections.deque[Kept] = collections.deque()
        self.acked = 0            # every message below this arrived
        self.ahead = 0            # and those from ``acked + 1`` to ``ahead - 1`` (0: none; see Inflow)
        self.seen = (0, 0)        # ``acked`` and ``ahead`` at the last tick (see :meth:`due`)
        self.idle = 0.0           # seconds of ticks without progress while frame sets are kept
        self.rto = RTO
        self.resend_from: int | None = None   # a resend in progress: the next seq to send again

    def __repr__(self) -> str:
        return f"<SendLog {self.epoch:08x} next={self.next} acked={self.acked} kept={len(self.kept)}>"

    def keep(self, seq: int, count: int, entries: list | None, body: bytes, payload: list | None,
             msg: Any = None, credit: tuple[int, int, int] | None = None, skip: int = 0) -> Kept:
        kept = Kept(seq, seq + count, entries, body, payload, msg, credit, skip)
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
        if self.ahead <= self.acked:
            self.ahead = 0
        return done

    def ack_ahead(self, upto: int, ahead: int) -> list[Kept]:
        """Messages ``upto + 1`` to ``ahead - 1`` arrived too (ahead of message ``upto``):
        the frame sets that tells of for the first time. They stay kept until the
        acknowledgement passes them, but are never sent again."""
        if upto != self.acked or ahead <= max(self.ahead, upto + 1):
            return []
        done = []
        for kept in reversed(self.kept):      # the newest first: what was told before is older
            if kept.end > ahead:
                continue
            if kept.end <= self.ahead or kept.seq <= upto:
                break
            done.append(kept)
        self.ahead = ahead
        return done

    def arrived(self, kept: Kept) -> bool:
        """Whether ``kept`` is known to have arrived (it is not sent again)."""
        return kept.end <= self.acked or self.acked < kept.seq and kept.end <= self.ahead

    def due(self) -> bool:
        """One tick passed (:data:`TICK`): True when the kept frame sets must be sent
        again (no acknowledgement for the resend timeout, which then doubles)."""
        if not self.kept:
            self.idle, self.rto = 0.0, RTO
            return False
        if (self.acked, self.ahead) != self.seen:
            self.seen, self.idle, self.rto = (self.acked, self.ahead), 0.0, RTO
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
    that came early, by ``seq`` (``(entries, frames, packed, skip)``; ``skippers`` counts
    those with a ``skip``); messages ``expected + 1`` to ``ahead - 1`` were delivered
    ahead of message ``expected``, a bulk message on its way (``ahead`` 0: none).
    ``owed``: an acknowledgement is due.

    Flow control (see :mod:`rlinf.core._credit`): ``held``, ``held_bytes`` and
    ``held_bulk`` count the sender's user messages waiting in our mailbox and their
    bytes by lane (the mailbox keeps them, through ``Message.credit``); ``reported``
    and ``reported_bytes`` what the last frame set to the sender said; ``step``/
    ``step_bytes``: how much taken since then is worth a frame set of its own
    (``notify()`` sends it).
    """

    __slots__ = ("address", "incarnation", "identity", "epoch", "packed", "expected", "parked", "ahead",
                 "skippers", "owed", "timer", "gap_timer", "acked_sent", "held", "held_bytes", "held_bulk",
                 "reported", "reported_bytes", "step", "step_bytes", "notify")

    def __init__(self, address: str, incarnation: str, identity: bytes) -> None:
        self.address = address
        self.incarnation = incarnation
        self.identity = identity
        self.epoch = 0
        self.packed = b"\x00"
        self.expected = 0
        self.parked: dict[int, tuple] = {}
        self.ahead = 0
        self.skippers = 0
        self.owed = False
        self.timer = None          # the pending acknowledgement's timer
        self.gap_timer = None      # the pending request for a resend
        self.acked_sent = -1       # the last acknowledgement sent
        self.held = self.held_bytes = self.held_bulk = 0
        self.reported = self.reported_bytes = 0
        self.step = self.step_bytes = 1 << 62
        self.notify: Any = None    # () -> None: tell the sender what it may send now

    # -- flow control ---------------------------------------------------------------------------
    def hold(self, nbytes: int) -> None:
        """A user message of ``nbytes`` from the sender waits in our mailbox."""
        self.held += 1
        if nbytes >= BULK_BYTES:      # (lane_cost, inline: once per message received)
            self.held_bulk += nbytes
        else:
            self.held_bytes += nbytes

    def release(self, nbytes: int) -> None:
        """A message :meth:`hold` counted left the mailbox (taken or dropped): tell the
        sender when that frees enough."""
        self.held -= 1
        if nbytes >= BULK_BYTES:
            self.held_bulk -= nbytes
        else:
            self.held_bytes -= nbytes
        if (self.reported - self.held >= self.step or self.reported_bytes - self.held_bytes - self.held_bulk
                >= self.step_bytes) and self.notify is not None:
            self.notify()

    @property
    def stale(self) -> bool:
        """Whether the sender was last told we hold more than we do."""
        return self.reported > self.held or self.reported_bytes > self.held_bytes + self.held_bulk

    def fields(self) -> tuple[bytes, int, int, int, int, int]:
        """The acknowledgement and flow-control fields of a frame set to the sender now
        (``ack_epoch``, ``ack``, ``ahead``, ``held``, ``held_bytes``, ``held_bulk``),
        noted as told."""
        self.reported, self.reported_bytes = self.held, self.held_bytes + self.held_bulk
        return self.packed, self.expected, self.ahead, self.held, self.held_bytes, self.held_bulk

    # -- ordering -------------------------------------------------------------------------------
    # A frame set delivered ahead skipped exactly the bulk message ``expected`` (everything
    # else before it had arrived), so what was delivered ahead is always one run of
    # messages, ``expected + 1`` to ``ahead - 1``.
    def seen(self, seq: int) -> bool:
        """Whether the frame set ``seq`` was delivered already."""
        return seq < self.expected or self.expected < seq < self.ahead

    def clear_before(self, seq: int, skip: int) -> bool:
        """Whether everything before ``seq`` was delivered but message ``skip - 1``
        (the bulk message a frame set with ``skip`` may overtake)."""
        return skip - 1 == self.expected and seq == (self.ahead or self.expected + 1)

    def delivered(self, seq: int, count: int) -> None:
        """Frame set ``seq`` of ``count`` messages was delivered."""
        if seq != self.expected:       # ahead of the bulk message (see clear_before)
            self.ahead = seq + count
        elif self.ahead:
            self.expected, self.ahead = max(self.ahead, seq + count), 0
        else:
            self.expected = seq + count

    def park(self, seq: int, early: tuple) -> None:
        """Keep frame set ``seq`` (``(entries, frames, packed, skip)``) until it may go."""
        if seq not in self.parked:
            self.parked[seq] = early
            self.skippers += early[3] != 0

    def unpark(self) -> tuple[int, tuple] | None:
        """The parked frame set that may be delivered now, taken out (None: none)."""
        parked = self.parked
        seq = self.expected
        early = parked.get(seq)
        if early is None and self.skippers:
            seq = self.ahead or seq + 1
            early = parked.get(seq)
            if early is not None and early[3] - 1 != self.expected:
                early = None
        if early is None:
            return None
        del parked[seq]
        self.skippers -= early[3] != 0
        return seq, early

    def __repr__(self) -> str:
        return f"<Inflow {self.address} {self.epoch:08x} expected={self.expected} parked={len(self.parked)}>"

    def adopt(self, epoch: int) -> bool:
        """The sender's log is ``epoch``: True when that starts a new log although the
        old one had begun (messages of the old one may be missing)."""
        started = self.expected > 0 or self.ahead > 0 or bool(self.parked)
        self.epoch, self.packed = epoch, packed_epoch(epoch)
        self.expected = self.ahead = self.skippers = 0
        self.parked.clear()
        return started

    def cancel_timers(self) -> None:
        for timer in (self.timer, self.gap_timer):
            if timer is not None:
                timer.cancel()
        self.timer = self.gap_timer = None
