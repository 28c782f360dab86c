"""The sending side of one peer: ordering, coalescing, chunking and backpressure.

Every message to a peer enters its :class:`Outbox` at call time, which fixes the order.
A message that finds the queue empty and the link idle (nothing sent to this peer in
the last :data:`IN_FLIGHT` seconds) is sent at once: a request or a reply pays no
extra loop turn. Messages that follow a send more closely are queued, and a flush
scheduled for the next loop iteration packs consecutive small ones (< 1 MiB each, up
to 64 KiB or 4096 of them) into one frame set — one ZeroMQ send instead of many — so
a burst, such as many sends in one loop iteration, is coalesced. Each large message
goes on its own, its buffers cut into frames of at most 16 MiB and sent zero-copy.

Buffer lifetimes: a small message's buffers are copied when it is queued (a whole bytes
object, which nobody can change, is referenced instead), so its send completes at
once; a large message's buffers are referenced until the transport
releases them, and its send completes only then. A message whose buffers went into a
shared-memory slot travels as a small one (only its descriptor is on the wire); when
its copy into the slot runs in an executor (``copying``), the outbox holds it, and every
message behind it, until the copy is done, so the order stays the call order. A large
message to another node may go over the peer's bulk TCP stream (``bulk``, see
``rlinf/transports/tcp_bulk.py``): its buffers are referenced until the receiver
acknowledged it; messages with other tags overtake it meanwhile (see
:mod:`rlinf.core._overtake`). If the bulk stream fails, that message and later ones go
through ZeroMQ instead. When the link pushes back (high-water mark), flushing pauses
until the socket is writable, and new sends wait (backpressure: nothing is dropped).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Awaitable, Callable, Coroutine

from . import wire
from ._credit import BULK_BYTES, DEFAULT_WINDOW, Credit, Window, lane_cost
from ._delivery import Inflow, Kept, SendLog
from ._overtake import Overtaking
from ._outmsg import BATCH_BYTES, BATCH_COUNT, IN_FLIGHT, SMALL_MESSAGE, OutMessage, copy_failed, to_zmq, wire_bytes
from ..errors import AuthenticationError, ClosedError, PeerLostError, TransportUnavailableError, WouldBlock
from ..info import WorkerInfo
from .routing import BULK
from .stats import Counters

__all__ = ["IN_FLIGHT", "OutMessage", "Outbox", "SMALL_MESSAGE"]

log = logging.getLogger("rlinf.core.communicator")


class Outbox:
    """Queue and link of one destination (loop thread only).

    Args:
        address: the destination's address.
        header: the sender's header packer (one per communicator: its buffer is large),
            or ``(src, incarnation)`` to make one.
        counters: the communicator's traffic counters.
        clock: seconds, for the :data:`IN_FLIGHT` window (tests pass a fake one).
        window: the receiver's credit window until its WorkerInfo tells it (see
            :mod:`rlinf.core._credit`).
    """

    #: the communicator's trace recorder (``rlinf.core._trace``), set by its sessions; None: off
    trace: Any = None

    def __init__(self, address: str, header: wire.HeaderPacker | tuple[str, str], counters: Counters, *,
                 clock: Callable[[], float] = time.perf_counter, window: Window = DEFAULT_WINDOW) -> None:
        self.address = address
        self.info: WorkerInfo | None = None
        self.link = None
        self.queue: collections.deque[OutMessage] = collections.deque()
        self.error: BaseException | None = None
        self._header = header if isinstance(header, wire.HeaderPacker) else wire.HeaderPacker(*header)
        self._counters = counters
        self._scheduled = False
        self._blocked = False
        self._held = False        # the head's shared-memory copy is still running
        #: the bulk message on its way and what waits for it (see rlinf.core._overtake)
        self._way = Overtaking()
        self._batched = 0
        self._clock = clock
        #: ``bulk() -> awaitable link`` to the peer's bulk listener (large payloads to
        #: another node), set by the communicator when routing picks it; None: ZeroMQ.
        self.bulk: Callable[[], Awaitable[Any]] | None = None
        self._bulk_link = None
        #: numbering and what is kept until acknowledged (see rlinf.core._delivery)
        self.log = SendLog()
        #: what we received from the peer: its acknowledgement rides on our frame sets
        self.inflow: Inflow | None = None
        #: flow control: the receiver's window for our user messages
        self.credit = Credit(window)
        #: ``redial(exc)``: the link broke while the peer may live (set by the sessions);
        #: None: the outbox fails instead
        self.redial: Callable[[BaseException], None] | None = None
        self._settled: list[asyncio.Future] = []   # drains waiting for every frame set to be acknowledged
        self._sent_at = -IN_FLIGHT  # clock() at the last send to the link
        self._tasks: set[asyncio.Task] = set()   # releases, bulk sends and writability awaited

    def __repr__(self) -> str:
        state = "lost" if self.error else ("connected" if self.link else "resolving")
        return f"<Outbox {self.address} {state} queued={len(self.queue)}>"

    @property
    def ready(self) -> bool:
        """True when a small send can complete at once (connected, not pushed back)."""
        return self.link is not None and not self._blocked and self.error is None

    def put(self, msg: OutMessage, loop: asyncio.AbstractEventLoop, *, hold: bool = False,
            gated: bool = False) -> bool:
        """Queue ``msg`` and send it now or at the next loop iteration; False when it
        waits for credit instead (``gated``: a user message, see :mod:`rlinf.core._credit`;
        it then has a future, completed once it is sent).

        It goes out at once when it is alone and the link is idle (see the module
        docstring); otherwise a flush is scheduled for the next iteration, or runs now
        when the pending batch is full. With ``hold`` it is never sent alone: the
        caller queues another message behind it and flushes both as one frame set.
        """
        if self.error is not None:
            raise self.error
        if gated:
            if not self.credit.try_take(msg.nbytes, msg.tag):
                self.credit.wait(msg)
                return False
            msg.counted = True
        if self.trace is not None:     # (here: a message admitted after waiting for credit comes back)
            self.trace.sent(self, msg)
        queue = self.queue
        queue.append(msg)
        if not self._scheduled:
            if len(queue) == 1 and not hold and self._clock() - self._sent_at >= IN_FLIGHT:
                self._batched = 0
                self._send_alone(msg)
                return True
            self._scheduled = True
            loop.call_soon(self._tick)
        if msg.large:
            self._batched = BATCH_BYTES
        else:
            self._batched += wire_bytes(msg) + 64
        if self._batched >= BATCH_BYTES or len(queue) >= BATCH_COUNT:
            self.flush()
        return True

    def _admit(self) -> None:
        """Room was freed: queue the messages waiting for credit that fit now."""
        if self.error is not None:
            return
        loop = asyncio.get_running_loop()
        for msg in self.credit.admit():
            msg.counted = True
            self.put(msg, loop)

    def _dropped(self, msg: OutMessage) -> None:
        """``msg`` is dropped unsent: what it took of the window frees room for those
        waiting (at the next loop turn: this may run inside a flush)."""
        if self.credit.drop(msg) and self.credit.waiting:
            asyncio.get_running_loop().call_soon(self._admit)

    def withdraw(self, future: asyncio.Future) -> bool:
        """Take the message of ``future`` back out of the queue, unsent (its ``discard``
        runs). Only before the link is attached (nothing has gone out then); whether it
        was taken back."""
        if self.link is not None:
            return False
        for queue in (self.queue, self.credit.waiting):
            for msg in queue:
                if msg.future is future:
                    queue.remove(msg)
                    self._dropped(msg)
                    if msg.discard is not None:
                        msg.discard()
                    return True
        return False

    def _tick(self) -> None:
        """The scheduled flush: sends what the current iteration queued."""
        self._scheduled = False
        if self.queue:
            self.flush()

    def attach(self, link, info: WorkerInfo) -> None:
        """Use ``link`` from now on and send what waited for it: first, again, every
        frame set not acknowledged yet (a previous link may have lost it)."""
        self.link, self.info = link, info
        if self.bulk is None:
            self._unbulk()     # queued while the route was not known: no bulk stream to it
        kept = self.log.kept
        if kept:
            self.log.resend_from = kept[0].seq
        self.flush()
        if self.inflow is not None:
            self.send_ack()    # (also the count of what we hold: one on a link that broke may be lost)
        if self.credit.waiting:
            self._admit()      # the window may have changed with the peer's WorkerInfo

    def flush(self) -> None:
        """Send queued messages in order, as far as the link accepts them without blocking
        (after what is being sent again, see :meth:`resend`)."""
        self._batched = 0
        link, queue = self.link, self.queue
        if link is None or self._blocked or self.error is not None:
            return
        if self.log.resend_from is not None and not self._resend(link):
            return
        if self._held:
            return
        while queue:
            head = queue[0]
            if head.future is not None and head.future.cancelled():   # timed out while queued
                queue.popleft()
                self._dropped(head)
                if head.discard is not None:
                    head.discard()
                continue
            if head.copying is not None:
                if not head.copying.done():
                    self._hold(head.copying)
                    return
                if head.copying.cancelled() or head.copying.exception() is not None:
                    queue.popleft()      # the copy failed: this message cannot go
                    self._dropped(head)
                    copy_failed(head)
                    continue
            if self._way.active and not self._way.overtakes(head):
                self._way.wait(queue.popleft())
                continue
            if head.transport == BULK:
                self._send_bulk(head)
                continue      # what may overtake it goes on
            if head.large:
                batch = [head]
            else:
                batch, size = [], 0
                for msg in queue:
                    if msg.large or size >= BATCH_BYTES or len(batch) >= BATCH_COUNT or (
                            msg.copying is not None and not msg.copying.done()) or (
                            self._way.active and not self._way.overtakes(msg)):
                        break
                    if msg.future is None or not msg.future.cancelled():
                        batch.append(msg)
                        size += wire_bytes(msg)
            if head.large:
                sent, tracker = self._send_set(link, [head.entry], False, head.frames, head,
                                               (1, *lane_cost(head.nbytes)) if head.counted else None)
            else:   # coalesced: one packed frame for every buffer of the batch
                entries, pieces = [], []
                counted = counted_bytes = counted_bulk = 0
                for msg in batch:
                    entry = msg.entry
                    if entry[wire.LAYOUT] is None:     # (a GPU message keeps its CUDA IPC item)
                        entries.append(wire.with_layout(entry, [len(f) for f in msg.frames]))
                    else:
                        entries.append(entry)
                    pieces.extend(msg.frames)
                    if msg.counted:
                        counted += 1
                        if msg.nbytes >= BULK_BYTES:    # (in shared memory: its descriptor is small)
                            counted_bulk += msg.nbytes
                        else:
                            counted_bytes += msg.nbytes
                sent, tracker = self._send_set(link, entries, True, [b"".join(pieces)] if pieces else [], None,
                                               (counted, counted_bytes, counted_bulk) if counted else None)
            if not sent:
                return
            sent = inline = inline_bytes = 0
            while sent < len(batch):
                msg = queue.popleft()
                if msg is batch[sent]:
                    sent += 1
                    if msg.transport == "zmq":     # (counted together: the hot path)
                        inline += 1
                        inline_bytes += msg.nbytes
                    else:
                        self._count(msg)
                    if not msg.large and msg.future is not None:
                        self._complete(msg)
                else:     # cancelled while queued
                    self._dropped(msg)
                    if msg.discard is not None:
                        msg.discard()
            if inline:
                self._counters.sent(self.address, inline_bytes, link.kind, msgs=inline)
            if head.large:
                self._spawn(self._await_release(link, tracker, head))

    def _send_set(self, link, entries: list, packed: bool, payload: list, msg: OutMessage | None = None,
                  credit: tuple[int, int, int] | None = None) -> tuple[bool, Any]:
        """Number, send and keep one frame set of ``entries`` (``msg``: the large message
        it carries, whose frames are tracked; ``credit``: what of it is counted in flight)."""
        log, inflow, header, skip = self.log, self.inflow, self._header, self._way.skip
        body = header.body(entries, packed)
        seq = log.next
        if inflow is None:
            sealed = header.seal(body, log.packed, seq, skip, b"\x00", 0)
        else:
            sealed = header.seal(body, log.packed, seq, skip, *inflow.fields())
        sent, tracker = self._transmit(link, [sealed, *payload], msg is not None)
        if sent:
            if inflow is not None:
                inflow.owed = False
            special = msg is not None
            if not special:
                for entry in entries:
                    if len(entry) > 4:
                        special = True
                        break
            log.keep(seq, len(entries), entries if special else None, body, payload, msg, credit, skip)
            if msg is not None:
                msg.pending += 1
        return sent, tracker

    def _resend(self, link) -> bool:
        """Send again the kept frame sets from ``log.resend_from`` on, in order; False
        when the link pushed back or broke first (it goes on from there later)."""
        log, header = self.log, self._header
        start = log.resend_from
        fields = self._ack_fields()
        for kept in list(log.kept):
            if kept.end <= start or kept.payload is None or log.arrived(kept):
                continue
            msg = kept.msg
            sealed = header.seal(kept.body, log.packed, kept.seq, kept.skip, *fields)
            sent, tracker = self._transmit(link, [sealed, *kept.payload], msg is not None)
            if not sent:
                if log.resend_from is not None:
                    log.resend_from = kept.seq
                return False
            self._counters.resent(self.address)
            if msg is not None:
                msg.pending += 1
                self._spawn(self._await_release(link, tracker, msg))
        log.resend_from = None
        return True

    def resend(self) -> None:
        """Send every kept frame set again (the receiver reported a gap, or nothing was
        acknowledged for the resend timeout); what is queued waits behind them."""
        kept = self.log.kept
        if kept and self.error is None:
            self.log.resend_from = kept[0].seq
            self.flush()

    def _ack_fields(self) -> tuple:
        """The acknowledgement and flow-control fields of a frame set sent now."""
        inflow = self.inflow
        return (b"\x00", 0, 0, 0, 0, 0) if inflow is None else inflow.fields()

    def acked(self, epoch: int, upto: int, ahead: int = 0, held: int = 0, held_bytes: int = 0,
              held_bulk: int = 0) -> None:
        """The peer acknowledged every message of our log ``epoch`` below ``upto`` (a
        negative ``upto``, ``-(n + 1)``: below ``n``, and asks for a resend from there)
        and, ``ahead`` not 0, those from ``upto + 1`` to ``ahead - 1``; it holds ``held``
        of our user messages (``held_bytes`` and ``held_bulk``: small and bulk lane) not
        yet received."""
        log = self.log
        if epoch != log.epoch:
            return     # about a log of ours that is gone
        credit = self.credit
        nack = upto < 0
        if nack:
            upto = -upto - 1
        credit.report(upto, held, held_bytes, held_bulk)
        if ahead:
            for kept in log.ack_ahead(upto, ahead):
                self._arrived(kept)
        if upto <= log.acked and not nack:
            if credit.waiting:
                self._admit()
            if self._settled and self._idle():
                self._settle()
            return     # nothing new acknowledged
        for kept in log.ack(upto):
            self._arrived(kept)
        if nack:
            self.resend()
        if credit.waiting and self.error is None:
            self._admit()
        if self._settled and self._idle():
            self._settle()

    def _arrived(self, kept: Kept) -> None:
        """The peer has the frame set ``kept``: its credit is free, its large message's
        send completes (once the transport released it)."""
        if kept.credit:
            self.credit.give_back(*kept.credit)
            kept.credit = None
        msg = kept.msg
        if msg is not None:
            kept.msg = None
            msg.acked = True
            if msg.pending == 0:
                msg.frames = []
                self._complete(msg)

    def _idle(self) -> bool:
        """Nothing sent waits for an acknowledgement, nothing for credit or a bulk message."""
        return not self.log.kept and not self.credit.waiting and not self._way.busy

    def _settle(self) -> None:
        for waiter in self._settled:
            if not waiter.done():
                waiter.set_result(None)
        self._settled.clear()

    def settled(self) -> asyncio.Future | None:
        """A future done once every frame set sent is acknowledged and no message waits
        for credit (None: already)."""
        if self.error is not None:
            return None
        self.credit.purge()       # (sends cancelled while waiting for credit do not count)
        if self._idle():
            return None
        waiter = asyncio.get_running_loop().create_future()
        self._settled.append(waiter)
        return waiter

    def send_ack(self, nack: bool = False) -> None:
        """Acknowledge, in a frame set of its own, what we received from the peer (with
        ``nack``, also ask for a resend of what is missing). Without a link now, the
        acknowledgement rides on the next frame set or goes once one is attached."""
        link, inflow = self.link, self.inflow
        if link is None or inflow is None or self._blocked or self.error is not None:
            return
        ack_epoch, ack, *rest = self._ack_fields()
        if nack:
            ack = -(ack + 1)
        log = self.log
        sealed = self._header.seal(self._header.body([]), log.packed, log.next, 0, ack_epoch, ack, *rest)
        if self._transmit(link, [sealed], False)[0]:
            inflow.owed = False
            inflow.acked_sent = inflow.expected

    def _send_bulk(self, msg: OutMessage) -> None:
        """Hand the head to the bulk stream. Until the receiver has it (its
        acknowledgement), only what may overtake it goes (see :mod:`rlinf.core._overtake`):
        while the stream is dialled, ahead of it; once it has its number, naming it, and
        the receiver delivers that ahead of it."""
        self.queue.popleft()     # with the transport now: a failing peer no longer fails it here
        self._way.numbered_later(msg.tag)
        self._spawn(self._bulk_send(msg))

    def _count(self, msg: OutMessage) -> None:
        """Count ``msg`` as sent, on the path its payload took (see ``CommStats``)."""
        path = msg.transport
        if path == "zmq":
            link = self.link
            self._counters.sent(self.address, msg.nbytes, path if link is None else link.kind)
        elif path == BULK:
            self._counters.sent(self.address, msg.nbytes, path)
        else:     # shared memory, pulled or CUDA IPC: only a descriptor crossed the socket
            sent = wire_bytes(msg)
            self._counters.sent(self.address, sent, path, msg.nbytes - sent)

    async def _bulk_send(self, msg: OutMessage) -> None:
        """The bulk send of the head. A stream that cannot be opened is not an error:
        this message and the later ones go through ZeroMQ. One that breaks while sending
        sends this message again through ZeroMQ (the peer drops it if it had it), and
        the later ones go through ZeroMQ."""
        kept = None
        try:
            if self._bulk_link is None:
                try:
                    self._bulk_link = await self.bulk()
                except (ClosedError, PeerLostError, AuthenticationError, TransportUnavailableError) as exc:
                    if self.error is None:
                        log.warning("rlinf: no bulk TCP to %s (%s); large payloads go through ZeroMQ",
                                    self.address, exc)
                        self._drop_bulk()
                        self._way.done(self.queue)     # what waited for it goes behind it again
                        to_zmq(msg)
                        self.queue.appendleft(msg)
                    elif msg.future is not None and not msg.future.done():
                        msg.future.set_exception(self.error)
                    return
            if self.error is not None:     # failed while the stream was dialled: never numbered
                self._fail_sent(msg)
                return
            log_, header = self.log, self._header
            body = header.body([msg.entry])
            seq = log_.next
            kept = log_.keep(seq, 1, [msg.entry], body, None, None,     # never sent again as it is
                             (1, *lane_cost(msg.nbytes)) if msg.counted else None)
            sealed = header.seal(body, log_.packed, seq, 0, *self._ack_fields())
            self._way.started(seq, msg.tag)
            if self.queue:
                asyncio.get_running_loop().call_soon(self.flush)    # what may overtake it
            await self._bulk_link.send(sealed, msg.frames)
        except (ClosedError, PeerLostError) as exc:
            if self.error is None:
                log.warning("rlinf: bulk TCP to %s broke (%s); large payloads go through ZeroMQ", self.address, exc)
                self._drop_bulk()
            if kept is not None and self.log.acked > kept.seq:   # it arrived before the stream broke
                self._count(msg)
                msg.frames = []
                self._complete(msg)
            elif kept is not None and self.error is None:   # again, through ZeroMQ
                kept.msg = msg
                to_zmq(msg)
                kept.entries = [msg.entry]
                kept.body = self._header.body(kept.entries)
                kept.payload = msg.frames
                if self.log.resend_from is None or self.log.resend_from > kept.seq:
                    self.log.resend_from = kept.seq
            elif msg.future is not None and not msg.future.done():
                msg.future.set_exception(self.error or exc)
        except asyncio.CancelledError:    # the communicator closed under it
            self._fail_sent(msg)
            raise
        else:     # the receiver has it: the bulk link acknowledged it
            self._sent_at = self._clock()
            self._count(msg)
            msg.frames = []
            self._complete(msg)
        finally:
            self._way.done(self.queue)
            if self.error is None:
                self.flush()
            if self._settled and self._idle():
                self._settle()

    def _drop_bulk(self) -> None:
        """No bulk stream from now on: what is queued for it goes through ZeroMQ."""
        self.bulk = None
        if self._bulk_link is not None:
            self._bulk_link.close()
            self._bulk_link = None
        self._unbulk()

    def _unbulk(self) -> None:
        """What is queued for the bulk stream goes through ZeroMQ."""
        for queue in (self.queue, self._way.behind, self.credit.waiting):
            for msg in queue:
                if msg.transport == BULK:
                    to_zmq(msg)

    def _send_alone(self, msg: OutMessage) -> None:
        """Send ``msg``, the only queued message, now: :meth:`flush` for one small
        message that waits for nothing (the wire format of a one-message batch)."""
        link = self.link
        way = self._way
        if (msg.large or msg.copying is not None or link is None or self._blocked or self._held
                or self.log.resend_from is not None or way.active and not way.overtakes(msg)):
            self.flush()
            return
        entry, pieces = msg.entry, msg.frames
        if entry[wire.LAYOUT] is None:
            entry = wire.with_layout(entry, [len(f) for f in pieces])
        payload = [pieces[0] if len(pieces) == 1 else b"".join(pieces)] if pieces else []
        if self._send_set(link, [entry], True, payload, None,
                          (1, *lane_cost(msg.nbytes)) if msg.counted else None)[0]:
            self.queue.popleft()
            self._count(msg)
            if msg.future is not None:
                self._complete(msg)

    def _transmit(self, link, frames: list, track: bool) -> tuple[bool, Any]:
        """Hand ``frames`` to ``link``: ``(True, tracker)``; ``(False, None)`` when the link
        pushed back (flushing resumes once it is writable) or broke (the queue fails)."""
        try:
            tracker = link.try_send(frames, track=track)
            self._sent_at = self._clock()
            return True, tracker
        except WouldBlock:
            self._blocked = True
            self._spawn(self._wait_writable())
        except (ClosedError, PeerLostError) as exc:
            self._broken(link, exc)
        return False, None

    def _broken(self, link, exc: BaseException) -> None:
        """``link`` broke: dial again while the peer may live (what was sent and not
        acknowledged goes again on the new link), else fail."""
        if self.redial is None or self.error is not None or link is not self.link:
            if link is self.link:
                self.fail(exc)
            return
        self.link = None
        self._blocked = False
        link.close(None)
        self.redial(exc)

    def _hold(self, copying: asyncio.Future) -> None:
        """Resume flushing once ``copying`` (the head's copy into shared memory) is done."""
        self._held = True

        def resume(_: asyncio.Future) -> None:
            self._held = False
            self.flush()

        copying.add_done_callback(resume)
    def _complete(self, msg: OutMessage) -> None:
        if msg.future is not None:
            if not msg.future.done():
                msg.future.set_result(None)
            self._counters.latency(self.address, time.perf_counter() - msg.started)

    def _spawn(self, coro: Coroutine) -> None:
        """Run ``coro`` as a task of this outbox (kept until done; see :meth:`cancel_tasks`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def tasks(self) -> frozenset[asyncio.Task]:
        """The tasks of this outbox still running."""
        return frozenset(self._tasks)

    def cancel_tasks(self) -> None:
        """Cancel what is still awaited: once the communicator closed and its transports
        let go of every buffer (a send still waiting then fails)."""
        for task in list(self._tasks):
            task.cancel()

    def _fail_sent(self, msg: OutMessage) -> None:
        if msg.future is not None and not msg.future.done():
            msg.future.set_exception(self.error or ClosedError(f"the link to {self.address} is closed"))

    async def _await_release(self, link, tracker, msg: OutMessage) -> None:
        """One sending of large ``msg`` released by the transport (sent, or dropped with
        a closed link: then it is sent again on the next one, or failed with the outbox);
        the send completes once every sending is released and the peer acknowledged it."""
        try:
            await link.released(tracker)
        except asyncio.CancelledError:
            self._fail_sent(msg)
            raise
        msg.pending -= 1
        if msg.acked and msg.pending == 0:
            msg.frames = []
            self._complete(msg)

    async def _wait_writable(self) -> None:
        link = self.link
        try:
            await link.wait_writable()
        except (ClosedError, PeerLostError) as exc:
            self._blocked = False
            self._broken(link, exc)
            return
        if link is not self.link:
            return
        self._blocked = False
        self.flush()
        if self.inflow is not None and self.inflow.owed:
            self.send_ack()

    def fail(self, exc: BaseException) -> None:
        """Fail every queued send with ``exc`` and refuse new ones.

        Sent messages not yet acknowledged stay in the log, for the same incarnation of
        the peer if it comes back (see :mod:`rlinf.core._delivery`), except those whose
        buffers are not ours to keep (large ones, whose send fails now, and those in
        shared memory or CUDA IPC slots, and those on a bulk stream): they become *void*
        entries, which tell the receiver that these messages are lost (one that had
        arrived is dropped there as a duplicate)."""
        self.error = exc
        self._way.done(self.queue)
        waiting = self.credit.waiting
        while self.queue or waiting:
            msg = self.queue.popleft() if self.queue else waiting.popleft()
            if msg.future is not None and not msg.future.done():
                msg.future.set_exception(exc)
            if msg.discard is not None:
                msg.discard()
        for kept in self.log.kept:
            if kept.msg is not None or kept.payload is None or kept.entries is not None:
                self._void(kept, exc)
        self.log.resend_from = None
        if self.link is not None:
            self.link.close(exc if isinstance(exc, PeerLostError) else None)
            self.link = None
        self._drop_bulk()
        self._settle()

    def _void(self, kept: Kept, exc: BaseException) -> None:
        msg = kept.msg
        if msg is not None and msg.future is not None and not msg.future.done():
            msg.future.set_exception(exc)
        kept.msg = None
        kept.entries = [wire.void_entry(e) for e in kept.entries]
        kept.body = self._header.body(kept.entries)
        kept.payload = []

    def close(self, linger_ms: int, exc: BaseException) -> Awaitable | None:
        """Graceful close: flushed frames still go out for up to ``linger_ms``. Returns
        what to await for that when the link's own loop writes them (a stream link),
        else None (ZeroMQ's I/O thread does, until the context terminates)."""
        flushed = None
        if self.link is not None:
            flushed = self.link.close_gracefully(linger_ms)
            self.link = None
        self.fail(exc)
        return flushed
