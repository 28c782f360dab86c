"""Matching received messages to ``recv`` calls, without losing one on cancellation.

Messages wait in one FIFO per ``(source, tag)``; a global arrival number orders
``recv_any`` across sources. A ``recv`` that finds nothing parks a future; delivery
hands the message straight to the oldest matching waiter. If that waiter is cancelled
after the hand-over but before its task resumed (a timeout racing a delivery), the
message goes to the next waiter for it or back to the *front* of its queue, so
cancellation never loses or reorders a message.

A tag nobody will receive again can be retired (a collective call that has finished):
its queued messages are dropped, and so are those that still arrive.

Losing a peer fails its parked waiters with ``PeerLostError``; messages it sent before
dying stay readable. When a peer comes back as a new incarnation, messages still queued
from the old one are dropped (they are stale).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from ..util.bounded import Recent
from ._busypoll import BusyPoll
from ..errors import ClosedError, PeerLostError

__all__ = ["Mailbox", "Message", "RETIRED_TAGS"]


@dataclass(slots=True)
class Message:
    """A received, not yet decoded message. ``buffers`` are owned by the receiver.

    ``shm``: some buffers are views of a sender's shared-memory slot (held until they
    are garbage-collected). ``error``: the message arrived but cannot be rebuilt (e.g. a
    bad shared-memory descriptor); receiving it raises this error. ``ready``: for GPU
    buffers from CUDA IPC, orders the decoding thread's current stream after their copy.
    ``pulling``: buffers being read from the sender's memory (a future, done once they
    hold the data; see ``rlinf/transports/shm/_pull.py``). ``credit``: the sender's
    ``Inflow`` when the message counts against its window while it waits here (see
    ``rlinf/core/_credit.py``): the mailbox counts it there while it is queued.
    """

    src: str
    incarnation: str
    tag: Any
    codec_header: bytes
    buffers: list[Any]
    seq: int = 0
    nbytes: int = 0
    shm: bool = False
    error: BaseException | None = None
    ready: Callable[[], None] | None = None
    pulling: asyncio.Future | None = None
    credit: Any = None


class _Waiter:
    __slots__ = ("future", "src", "tag")

    def __init__(self, future: asyncio.Future, src: str | None, tag: Any) -> None:
        self.future = future
        self.src = src
        self.tag = tag


#: How many retired tags (:meth:`Mailbox.retire`) a mailbox remembers.
RETIRED_TAGS = 4096
#: How many departed peers a mailbox remembers (their receives fail at once; a receive
#: from one forgotten waits, as for a peer not joined yet).
LOST_KEPT = 4096


class Mailbox:
    """Per-``(src, tag)`` queues and waiters of one communicator (loop thread only).

    Args:
        busy_poll: how a receive that finds nothing waits (:class:`rlinf.core._busypoll.BusyPoll`:
            polling the loop a moment before it sleeps); None: it sleeps at once.
    """

    def __init__(self, busy_poll: BusyPoll | None = None) -> None:
        self._busy_poll = busy_poll
        self._queues: dict[tuple[str, Any], collections.deque[Message]] = {}
        self._sources_by_tag: dict[Any, set[str]] = collections.defaultdict(set)
        self._waiters: dict[tuple[str, Any], collections.deque[_Waiter]] = {}
        self._any_waiters: dict[Any, collections.deque[_Waiter]] = {}
        self._lost = Recent()      # address -> why it is gone (the newest LOST_KEPT)
        self._closed: BaseException | None = None
        self._arrivals = itertools.count()
        self._retired = Recent()   # tags nobody will receive again
        self._handed: list[tuple[_Waiter, list]] = []   # boxes handed over, maybe not taken yet
        self.queued = 0

    def __len__(self) -> int:
        return self.queued

    # -- delivery ----------------------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        if msg.tag in self._retired:
            return      # dropped: its buffers (a shared-memory slot, say) go back now
        msg.seq = next(self._arrivals)
        key = (msg.src, msg.tag)
        waiters = self._waiters.get(key)
        if waiters and self._hand_over(waiters, msg):
            return
        waiters = self._any_waiters.get(msg.tag)
        if waiters and self._hand_over(waiters, msg):
            return
        queue = self._queues.get(key)       # the hot path: queued at the back, inline
        if queue is None:
            queue = self._queues[key] = collections.deque()
            self._sources_by_tag[msg.tag].add(msg.src)
        queue.append(msg)
        self.queued += 1
        if msg.credit is not None:
            msg.credit.hold(msg.nbytes)

    def _hand_over(self, waiters: collections.deque[_Waiter] | None, msg: Message) -> bool:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.future.done():
                box = [msg]                        # see wait()
                waiter.future.set_result(box)
                handed = self._handed
                if len(handed) >= 32:              # keep the boxes not taken yet (see put_back)
                    handed[:] = [(w, b) for w, b in handed if b and not w.future.cancelled()]
                handed.append((waiter, box))
                return True
        return False

    def _push_front(self, msg: Message) -> None:
        """Queue ``msg`` ahead of the others from its source and tag (a put-back)."""
        key = (msg.src, msg.tag)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = collections.deque()
            self._sources_by_tag[msg.tag].add(msg.src)
        queue.appendleft(msg)
        self.queued += 1
        if msg.credit is not None:
            msg.credit.hold(msg.nbytes)

    @staticmethod
    def _taken(msg: Message) -> None:
        """``msg`` left the queue (received, or dropped): its sender's window gains room."""
        msg.credit.release(msg.nbytes)

    def _pop(self, key: tuple[str, Any]) -> Message:
        queue = self._queues[key]
        msg = queue.popleft()
        self.queued -= 1
        if msg.credit is not None:
            self._taken(msg)
        if not queue:
            del self._queues[key]
            sources = self._sources_by_tag[key[1]]
            sources.discard(key[0])
            if not sources:
                del self._sources_by_tag[key[1]]
        return msg

    def put_back(self, msg: Message) -> None:
        """Return a message taken by a receive that was then cancelled: it is next again.

        A later receive may already have been handed a newer message of the same source
        and tag in the same loop turn (and not have taken it yet): it gets ``msg``
        instead, and the newer one is put back, so that no receive overtakes another.
        """
        if self._closed is not None:
            return
        boxes = [box for waiter, box in self._handed
                 if box and not waiter.future.cancelled() and box[0].src == msg.src and box[0].tag == msg.tag]
        if boxes:
            ordered = sorted([box[0] for box in boxes] + [msg], key=lambda m: m.seq)
            for box, older in zip(boxes, ordered):
                box[0] = older
            msg = ordered[-1]
        if not (self._hand_over(self._waiters.get((msg.src, msg.tag)), msg)
                or self._hand_over(self._any_waiters.get(msg.tag), msg)):
            self._push_front(msg)

    def retire(self, tag: Any) -> None:
        """Nobody will receive ``tag`` again (a collective call that has finished): drop
        its queued messages and, from now on, those that arrive. The last
        :data:`RETIRED_TAGS` retired tags are remembered."""
        for src in self._sources_by_tag.pop(tag, ()):
            dropped = self._queues.pop((src, tag))
            self.queued -= len(dropped)
            for msg in dropped:
                if msg.credit is not None:
                    self._taken(msg)
        self._retired.add(tag, RETIRED_TAGS)

    # -- receiving ---------------------------------------------------------------------
    def get_nowait(self, src: str | None, tag: Any) -> Message | None:
        """The next matching message, or None. Raises if none can ever come."""
        if src is not None:
            key = (src, tag)
            if key in self._queues:
                return self._pop(key)
            if src in self._lost:
                raise PeerLostError(str(self._lost[src]), peer=src) from self._lost[src].__cause__
        else:
            sources = self._sources_by_tag.get(tag)
            if sources:
                oldest = min(sources, key=lambda s: self._queues[(s, tag)][0].seq)
                return self._pop((oldest, tag))
        if self._closed is not None:
            raise self._closed
        return None

    async def get(self, src: str | None, tag: Any) -> Message:
        """Wait for the next matching message. Cancellation-safe (see module docstring)."""
        msg = self.get_nowait(src, tag)
        if msg is not None:
            return msg
        return await self.wait(src, tag)

    def wait(self, src: str | None, tag: Any) -> Coroutine[Any, Any, Message]:
        """Wait for the next matching message to be delivered, when :meth:`get_nowait`
        just returned None (nothing matching is queued). Cancellation-safe. (Its place in
        line is taken when called: await the result at once.)

        The message is handed over in a one-item list that this empties: the loop keeps
        the finished future (and so its result) alive until the receiving task yields,
        and a message held that long would keep its shared-memory slot from going back
        to the sender after the caller dropped everything decoded from it.
        """
        return self.wait_parked(self.park(src, tag))

    def park(self, src: str | None, tag: Any) -> _Waiter:
        """Take this receive's place in line now (what :meth:`wait` does first), to wait
        later with :meth:`wait_parked`; a place never waited on is given up with :meth:`abandon`."""
        waiter = _Waiter(asyncio.get_running_loop().create_future(), src, tag)
        table = self._waiters if src is not None else self._any_waiters
        table.setdefault((src, tag) if src is not None else tag, collections.deque()).append(waiter)
        return waiter

    def abandon(self, waiter: _Waiter) -> None:
        """Give up a place taken by :meth:`park` and never waited on: a message already
        handed to it is next again."""
        if not self._reclaim(waiter.future):
            waiter.future.cancel()
        self._unpark(waiter)

    def _reclaim(self, future: asyncio.Future) -> bool:
        """Put back the message handed to a waiter that will not take it; False if none was."""
        if future.done() and not future.cancelled() and future.exception() is None and future.result():
            self.put_back(future.result().pop())
            return True
        return False

    def _unpark(self, waiter: _Waiter) -> None:
        table = self._waiters if waiter.src is not None else self._any_waiters
        key = (waiter.src, waiter.tag) if waiter.src is not None else waiter.tag
        waiters = table.get(key)
        if waiters is not None:
            try:
                waiters.remove(waiter)
            except ValueError:
                pass
            if not waiters:
                del table[key]

    async def wait_parked(self, waiter: _Waiter) -> Message:
        """:meth:`wait`, from a place taken by :meth:`park`."""
        future = waiter.future
        try:
            if self._busy_poll is not None:
                return (await self._busy_poll.wait(future)).pop()
            return (await future).pop()
        except asyncio.CancelledError:
            # handed over, then cancelled: the next waiter for it gets it, else it is
            # queued first (queued behind, a later message would overtake it)
            self._reclaim(future)
            raise
        finally:
            # A waiter that got its message was popped by the hand-over; one that failed
            # or was cancelled may still be queued.
            if not future.done() or future.cancelled() or future.exception() is not None:
                self._unpark(waiter)

    # -- membership --------------------------------------------------------------------
    def peer_lost(self, address: str, error: PeerLostError) -> None:
        """Fail waiters on ``address``; later ``recv(address)`` raises once its queue drains."""
        self._lost.add(address, LOST_KEPT, error)
        for waiter in self._take_waiters(address):
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _take_waiters(self, address: str) -> list[_Waiter]:
        taken = []
        for key in [k for k in self._waiters if k[0] == address]:
            taken.extend(self._waiters.pop(key))
        return taken

    def peer_joined(self, address: str, incarnation: str) -> None:
        """A (new incarnation of) ``address`` joined: forget its loss, drop stale messages."""
        self._lost.pop(address, None)
        for key in [k for k in self._queues if k[0] == address]:
            queue = self._queues[key]
            fresh = collections.deque(m for m in queue if m.incarnation == incarnation)
            self.queued -= len(queue) - len(fresh)
            for msg in queue:
                if msg.incarnation != incarnation and msg.credit is not None:
                    self._taken(msg)
            if fresh:
                self._queues[key] = fresh
            else:
                del self._queues[key]
                sources = self._sources_by_tag[key[1]]
                sources.discard(address)
                if not sources:
                    del self._sources_by_tag[key[1]]

    def is_lost(self, address: str) -> PeerLostError | None:
        return self._lost.get(address)

    def close(self, error: ClosedError) -> None:
        """Fail every waiter with ``error``; later calls raise it. Queued messages are dropped."""
        self._closed = error
        for table in (self._waiters, self._any_waiters):
            for waiters in table.values():
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_exception(error)
            table.clear()
        self._queues.clear()
        self._sources_by_tag.clear()
        self.queued = 0
