"""Flow control: each receiver grants each sender a window of user messages.

A receiver's window (``RLINF_WINDOW_MSGS`` messages and ``RLINF_WINDOW_BYTES`` bytes,
:class:`Window`; it publishes it in its ``WorkerInfo.meta["window"]``) bounds what one
sender's user messages may occupy in its memory before its application receives them.

* The receiver counts, per sender incarnation, the user messages from it that wait in its
  mailbox (``Inflow.held``/``held_bytes``/``held_bulk``: the mailbox adds a message it
  queues and subtracts it when a receive takes it, or it is dropped). Every frame set it
  sends that sender carries those counts as of its acknowledgement (``wire``: ``held``,
  ``held_bytes``, ``held_bulk``); when its application took a quarter of a window since
  the last frame set, one goes on its own (``Inflow.taken``), and the resend tick
  repeats it while the counts it told are out of date.
* The sender (:class:`Credit`, one per outbox) counts what it sent and is not yet
  acknowledged (*in flight*). Bytes count in two *lanes*: messages of
  :data:`BULK_BYTES` or more in the bulk lane, smaller ones in the small lane, each
  with the window's bytes; messages count together. A user message may go while
  ``in flight + held`` is below the window in messages and in its lane's bytes: the
  one that fills it may overrun it, so a message larger than the window goes too, and
  the receiver holds at most two windows of bytes (one per lane) plus one message per
  lane of each sender. With two lanes a small message never waits for a bulk
  transfer to be received (issue 24, H1: a 64 B ping beside back-to-back 40 MiB
  messages). Otherwise it waits behind the others that wait (those of its lane, and
  those with its tag), until an acknowledgement or a report of taken messages frees
  room; ``send`` waits with it (its ``timeout`` applies; a message that times out
  while waiting was never sent).

Counted are user messages: an int tag, sent through the public API. rlinf's own traffic
(str tags: collectives, channels; SYSTEM entries: acknowledgements, releases, goodbyes)
never waits for credit and is not counted, so no subsystem can deadlock on a window a
user filled.

The counts of the two sides are each side's own (no agreement on byte counts is
needed): the receiver's report is a snapshot, the sender's in-flight count covers what
the snapshot cannot know yet.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterator, NamedTuple

from ..config import DEFAULTS

__all__ = ["BULK_BYTES", "DEFAULT_WINDOW", "Credit", "Window", "lane_cost"]

#: A user message of this many payload bytes or more counts in the bulk lane.
BULK_BYTES = 1 << 20
#: Waiting messages an admission looks past a blocked one for some that may overtake it.
_LOOKAHEAD = 64


def lane_cost(nbytes: int) -> tuple[int, int]:
    """What a message of ``nbytes`` costs each lane: ``(small bytes, bulk bytes)``."""
    return (0, nbytes) if nbytes >= BULK_BYTES else (nbytes, 0)


class Window(NamedTuple):
    """A receiver's window per sender: ``msgs`` user messages and ``nbytes`` bytes."""

    msgs: int
    nbytes: int

    @classmethod
    def from_meta(cls, meta: dict, default: Window) -> Window:
        """The window a peer published (``meta["window"]``), else ``default``."""
        value = meta.get("window")
        if (isinstance(value, (list, tuple)) and len(value) == 2
                and all(type(v) is int and v > 0 for v in value)):
            return cls(*value)
        return default


#: The window of a receiver whose WorkerInfo does not say (the defaults of Settings).
DEFAULT_WINDOW = Window(DEFAULTS.window_msgs, DEFAULTS.window_bytes)


class Credit:
    """The sender's side of one pair (loop thread only): what is in flight, what the
    receiver last said it holds, and the messages waiting for room.

    Waiting messages (``OutMessage``: ``nbytes``, ``tag``, ``future``, ``discard``) keep
    the order of their tag: one may overtake another only when their tags differ (a
    small message passes a bulk one waiting for room in the bulk lane).

    Buffer lifetimes: a waiting message keeps its frames (for a small message, copies or
    whole bytes objects, which nobody can change; the caller's buffers for a large one,
    whose send has not completed) until it is sent, times out or fails.
    """

    __slots__ = ("window", "in_flight", "in_flight_bytes", "in_flight_bulk", "held", "held_bytes", "held_bulk",
                 "waiting", "waits", "waited", "_since", "_ack")

    def __init__(self, window: Window) -> None:
        self.window = window
        self.in_flight = self.in_flight_bytes = self.in_flight_bulk = 0
        self.held = self.held_bytes = self.held_bulk = 0      # the receiver's last report
        self._ack = 0                             # the acknowledgement it came with
        self.waiting: collections.deque = collections.deque()
        self.waits = 0                            # messages that had to wait
        self.waited = 0.0                         # seconds they waited, in all
        self._since = 0.0                         # when the oldest of those waiting started

    def __repr__(self) -> str:
        return (f"<Credit in_flight={self.in_flight}/{self.in_flight_bytes}B+{self.in_flight_bulk}B "
                f"held={self.held}/{self.held_bytes}B+{self.held_bulk}B waiting={len(self.waiting)} of {self.window}>")

    @property
    def used(self) -> tuple[int, int]:
        """Messages and bytes (both lanes) of the window in use: in flight or held."""
        return (self.in_flight + self.held,
                self.in_flight_bytes + self.held_bytes + self.in_flight_bulk + self.held_bulk)

    def room(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` may go now, ignoring those waiting: while the
        window is not full in messages and in the message's lane. The message that fills
        it may overrun it, so one larger than the window goes too."""
        window = self.window
        if self.in_flight + self.held >= window.msgs:
            return False
        if nbytes >= BULK_BYTES:
            return self.in_flight_bulk + self.held_bulk < window.nbytes
        return self.in_flight_bytes + self.held_bytes < window.nbytes

    def open_to(self, nbytes: int, tag: Any) -> bool:
        """Whether a user message of ``nbytes`` with ``tag`` would go now, not wait:
        there is room, and no message with its tag waits (it may pass a few waiting
        with other tags)."""
        waiting = self.purge()
        if waiting and (waiting > _LOOKAHEAD or any(msg.tag == tag for msg in self.waiting)):
            return False
        return self.room(nbytes)

    def try_take(self, nbytes: int, tag: Any) -> bool:
        """:meth:`open_to` and, if so, :meth:`take`: whether the message goes now (the
        hot path of a send: one call)."""
        if self.waiting:
            if not self.open_to(nbytes, tag):
                return False
        elif not self.room(nbytes):
            return False
        self.take(nbytes)
        return True

    def purge(self) -> int:
        """Drop the waiting messages at the head whose send was cancelled (timed out);
        the number still waiting."""
        waiting = self.waiting
        while waiting:
            msg = waiting[0]
            if msg.future is None or not msg.future.cancelled():
                break
            waiting.popleft()
            if msg.discard is not None:
                msg.discard()
        return len(waiting)

    def take(self, nbytes: int) -> None:
        """A message of ``nbytes`` goes (it is in flight until acknowledged)."""
        self.in_flight += 1
        if nbytes >= BULK_BYTES:
            self.in_flight_bulk += nbytes
        else:
            self.in_flight_bytes += nbytes

    def give_back(self, msgs: int, nbytes: int, bulk: int = 0) -> None:
        """``msgs`` messages of ``nbytes`` (small lane) and ``bulk`` (bulk lane) bytes are
        no longer in flight (acknowledged, or dropped unsent)."""
        self.in_flight -= msgs
        self.in_flight_bytes -= nbytes
        self.in_flight_bulk -= bulk

    def drop(self, msg: Any) -> bool:
        """``msg`` (an ``OutMessage``) is dropped unsent: if counted, no longer in flight
        (then True: room was freed, those waiting may go)."""
        if msg.counted:
            msg.counted = False
            self.give_back(1, *lane_cost(msg.nbytes))
            return True
        return False

    def report(self, ack: int, held: int, held_bytes: int, held_bulk: int = 0) -> None:
        """The receiver holds ``held`` messages of ``held_bytes`` (small lane) and
        ``held_bulk`` (bulk lane) bytes from us, as of its acknowledgement ``ack``. A
        report older than the last one taken (a frame set that crossed a later one on
        another link, e.g. sealed when a long bulk transfer started) is ignored: its
        count would miss what arrived since. For one acknowledgement the counts only
        fall (the application takes), so of two reports the lower holds."""
        if ack > self._ack:
            self._ack, self.held, self.held_bytes, self.held_bulk = ack, held, held_bytes, held_bulk
        elif ack == self._ack:
            self.held, self.held_bytes = min(self.held, held), min(self.held_bytes, held_bytes)
            self.held_bulk = min(self.held_bulk, held_bulk)

    def wait(self, msg: Any) -> None:
        """Queue ``msg`` until there is room (behind those already waiting)."""
        if not self.waiting:
            self._since = time.perf_counter()
        self.waiting.append(msg)
        self.waits += 1

    def admit(self) -> Iterator[Any]:
        """The waiting messages that may go now, each counted in flight as it is taken
        (those whose send was cancelled meanwhile are dropped, with their ``discard``):
        in order, except that one whose lane is full holds back only its own lane and
        its tag, for the next :data:`_LOOKAHEAD` waiting behind it."""
        waiting = self.waiting
        blocked: set = set()      # tags of messages left waiting
        i = 0
        while i < len(waiting):
            msg = waiting[i]
            if msg.future is not None and msg.future.cancelled():     # timed out while waiting
                del waiting[i]
                if msg.discard is not None:
                    msg.discard()
                continue
            if msg.tag in blocked or not self.room(msg.nbytes):
                blocked.add(msg.tag)
                i += 1
                if i > _LOOKAHEAD or not (self.room(0) or self.room(BULK_BYTES)):
                    return
                continue
            del waiting[i]
            now = time.perf_counter()
            self.waited += now - self._since
            self._since = now
            self.take(msg.nbytes)
            yield msg

    def resume(self, kept: Any) -> None:
        """A log resumed from a dropped session: what it keeps is in flight here now."""
        for k in kept:
            if k.credit:
                msgs, nbytes, bulk = k.credit
                self.in_flight += msgs
                self.in_flight_bytes += nbytes
                self.in_flight_bulk += bulk
