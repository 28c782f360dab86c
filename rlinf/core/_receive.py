"""The receive path: frame sets in, decoded objects out.

:class:`ReceivePath` takes each frame set the transports deliver, checks whom it claims
to come from, puts it in its sender's order (see :mod:`rlinf.core._delivery`), has
:class:`~rlinf.core._inbound.FrameReader` rebuild its buffers wherever they travelled,
and delivers user messages to the :class:`~rlinf.core._mailbox.Mailbox` and SYSTEM
messages to their handlers. Receives take messages from the mailbox and decode them:
over the received buffers (views), or over owned copies made first (``shm_views=False``,
:meth:`ReceivePath.finish`: the one place that choice is made).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import msgpack

from ..codec import Codec
from ..codec.into import copy_into
from ..errors import CommTimeoutError, DecodeError, PeerLostError, ProtocolError, RlinfError
from ..transports.base import Received
from ..transports.shm import PullSession, ShmSession
from ..util.bounded import Recent
from . import wire
from ._delivery import Inflow
from ._inbound import FrameReader
from ._mailbox import Mailbox, Message
from ._peer import PeerSessions
from .interface import SYSTEM_TAGS
from .stats import Counters
from .work import Work

__all__ = ["ReceivePath"]

log = logging.getLogger("rlinf.core.communicator")

#: Shared-memory notices owed before a receive that does not yield sends them itself.
_OWED_BURST = 16


class ReceivePath:
    """What arrives for one communicator, and its receives (loop thread only).

    Args:
        address: the communicator's. codec: decodes messages. mailbox: matches them to
            receives. counters: its traffic counters.
        dead: ``(address, incarnation)`` of peers known gone: their late frames are dropped.
        views: decode over views of shared memory (else over owned copies).
        sessions: for the address check of the hot path.
        guard: raises unless the communicator is open and this is its loop thread.
        on_bye: ``on_bye(src, incarnation)``: a peer's in-order goodbye arrived.
    """

    #: the communicator's trace recorder (``rlinf.core._trace``); None: off
    trace: Any = None

    def __init__(self, address: str, codec: Codec, mailbox: Mailbox, counters: Counters, dead: Recent, views: bool,
                 sessions: PeerSessions, guard: Callable[[], None], on_bye: Callable[[str, str], None]) -> None:
        self._address = address
        self._codec = codec
        self._mailbox = mailbox
        self._counters = counters
        self._dead = dead
        #: a message that came through shared memory is decoded over owned copies
        #: (``shm_views=False``): :meth:`finish` must run, not :meth:`decode` alone
        self.copies = not views
        self._sessions = sessions
        self._valid = sessions.valid
        self._guard = guard
        self._on_bye = on_bye
        self._handlers: dict[str, Callable[[str, Any], None]] = {}
        # set by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shm: ShmSession | None = None
        self._pull: PullSession | None = None
        self._inbound: FrameReader | None = None

    def start(self, loop: asyncio.AbstractEventLoop, shm: ShmSession | None, pull: PullSession | None,
              inbound: FrameReader) -> None:
        self._loop, self._shm, self._pull, self._inbound = loop, shm, pull, inbound

    # -- SYSTEM messages ---------------------------------------------------------------------
    def handle(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        """Handle SYSTEM messages with ``tag`` (one of :data:`SYSTEM_TAGS`: the core's own)."""
        self._handlers[tag] = handler

    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        """A subsystem's handler of SYSTEM messages with ``tag`` (not one of the core's)."""
        if tag in SYSTEM_TAGS:
            raise ValueError(f"system tag {tag!r} is used by rlinf itself; pick another")
        self._handlers[tag] = handler

    # -- arrivals ----------------------------------------------------------------------------
    def on_frames(self, received: Received) -> None:
        """Handler of every data listener: a frame set in, in the sender's order (see
        :mod:`rlinf.core._delivery`): delivered now, parked until the ones before it
        came, or dropped as a duplicate. Its acknowledgement of our own log is taken."""
        frames = received.frames
        peer = received.peer
        sessions = self._sessions
        inflow = sessions.inflows.get(peer)
        try:
            (src, incarnation, entries, packed, epoch, seq, skip, ack_epoch, ack, ahead, held, held_bytes,
             held_bulk) = wire.unpack(received.header, frames)
            # (an inflow is the connection identity's, so its fields are the cheaper check)
            if (inflow is None or inflow.address != src or inflow.incarnation != incarnation) and \
                    peer != f"{src}|{incarnation}".encode():
                raise ProtocolError("frame set claims a source other than its connection's")
        except ProtocolError as exc:
            self._counters.dropped()
            log.warning("rlinf %s: dropped a bad frame set: %r", self._address, exc)
            return
        if (src, incarnation) in self._dead:
            if entries and self._dead[(src, incarnation)].kind == "lost":
                # taken for lost, maybe not gone: held, unacknowledged, until it is back
                # (resume) or forgotten. A bulk link acknowledged this frame set already:
                # its sender will not send it again.
                kept = inflow or sessions.new_inflow(peer, src, incarnation)
                if epoch != kept.epoch:
                    kept.adopt(epoch)     # (its receives raise already: it is taken for lost)
                if not kept.seen(seq):
                    kept.park(seq, (entries, frames, packed, skip))
            else:
                self._counters.dropped()
            return
        if ack_epoch:
            session = sessions.get(src)
            if session is not None:
                outbox = session.outbox
                if outbox.info is not None and outbox.info.incarnation == incarnation:
                    outbox.acked(ack_epoch, ack, ahead, held, held_bytes, held_bulk)
        if not entries:
            return
        if inflow is None:
            inflow = sessions.new_inflow(peer, src, incarnation)
        if epoch != inflow.epoch and inflow.adopt(epoch):
            self._restarted(src, incarnation)
        if seq != inflow.expected:
            if inflow.seen(seq):     # sent again, arrived before: acknowledge it again
                self._counters.duplicate()
                sessions.owe_ack(inflow, True)
                return
            if not (skip and inflow.clear_before(seq, skip)):
                if seq not in inflow.parked:
                    inflow.park(seq, (entries, frames, packed, skip))
                    sessions.gap(inflow)
                return
            # overtakes a bulk message still on its way (another tag): delivered ahead
        self._deliver(inflow, entries, frames, packed)
        inflow.delivered(seq, len(entries))
        if inflow.parked:
            self._unpark(inflow)
        if inflow.timer is None or not packed:     # (else the pending timer acknowledges it)
            sessions.owe_ack(inflow, not packed)
        else:
            inflow.owed = True

    def resume(self, address: str, incarnation: str) -> None:
        """``address``'s ``incarnation``, taken for lost, is back: deliver what it sent
        meanwhile (held in order) and acknowledge it."""
        identity = f"{address}|{incarnation}".encode()
        inflow = self._sessions.inflows.get(identity)
        if inflow is not None and inflow.parked and self._unpark(inflow):
            self._sessions.owe_ack(inflow, True)

    def _unpark(self, inflow: Inflow) -> bool:
        """Deliver the parked frame sets of ``inflow`` that may go now, in order; whether
        any did. A gap that remains is watched (see ``PeerSessions.gap``)."""
        delivered = False
        while (early := inflow.unpark()) is not None:
            seq, (entries, frames, packed, _skip) = early
            self._deliver(inflow, entries, frames, packed)
            inflow.delivered(seq, len(entries))
            delivered = True
        if inflow.parked:
            self._sessions.gap(inflow)
        else:
            self._sessions.gap_closed(inflow)
        return delivered

    def _restarted(self, src: str, incarnation: str) -> None:
        """``src`` numbers its messages anew though we had some of the old numbering:
        some may be missing. Its pending receives fail (not its later ones)."""
        error = PeerLostError(f"{src} restarted its message sequence to {self._address}: "
                              "messages from it may be missing", peer=src)
        log.error("rlinf %s: %s", self._address, error)
        self._mailbox.peer_lost(src, error)
        self._mailbox.peer_joined(src, incarnation)

    def _deliver(self, inflow: Inflow, entries: list, frames: list, packed: bool) -> None:
        """The entries of one frame set from ``inflow``'s sender, in order: to the
        mailbox (a user message, int tag, counts against its window there) or their handlers."""
        src, incarnation = inflow.address, inflow.incarnation
        deliver, trace = self._mailbox.deliver, self.trace
        inline = inline_bytes = 0         # user messages that came through the socket, counted once
        for entry, buffers, nbytes, in_shm, error, ready, pulling in self._inbound.entries(
                src, entries, frames, packed, incarnation):
            if entry.kind == wire.USER:
                if in_shm or pulling is not None:     # the payload came through memory
                    self._counters.received(src, len(entry.codec_header), nbytes)
                else:
                    inline += 1
                    inline_bytes += nbytes + len(entry.codec_header)
                if trace is not None:
                    trace.received(src, incarnation, entry, nbytes)
                # (positional: src, incarnation, tag, codec_header, buffers, seq, nbytes, shm, error,
                # ready, pulling, credit)
                deliver(Message(src, incarnation, entry.tag, entry.codec_header, buffers, 0, nbytes, in_shm, error,
                                ready, pulling, inflow if type(entry.tag) is int else None))
            elif pulling is not None:
                log.warning("rlinf %s: dropped system message %r with pulled buffers", self._address, entry.tag)
            elif error is not None:
                log.warning("rlinf %s: dropped system message %r: %s", self._address, entry.tag, error)
            elif entry.tag == "bye":
                self._on_bye(src, incarnation)
            elif entry.tag == wire.VOID:
                self._void(src, incarnation, entry.codec_header)
            else:
                handler = self._handlers.get(entry.tag)
                if handler is None:
                    log.warning("rlinf %s: no handler for system message %r", self._address, entry.tag)
                    continue
                try:
                    if ready is not None:
                        ready()
                    handler(src, self._codec.decode(entry.codec_header, buffers))
                except Exception:   # a subsystem bug must not kill the reader
                    log.exception("rlinf %s: system handler %r failed", self._address, entry.tag)
        if inline:
            self._counters.received(src, inline_bytes, msgs=inline)

    def _void(self, src: str, incarnation: str, codec_header: bytes) -> None:
        """A message ``src`` sent but could not send again (see ``wire.void_entry``):
        the receive it was for raises."""
        try:
            kind, tag = msgpack.unpackb(codec_header)
        except Exception:     # msgpack raises many types for garbage input
            log.warning("rlinf %s: dropped a malformed void entry from %s", self._address, src)
            return
        log.error("rlinf %s: a message from %s (tag %r) was lost on its way", self._address, src, tag)
        if kind == wire.USER:
            error = PeerLostError(f"a message from {src} with tag {tag!r} was lost on its way: its sender "
                                  "could not send it again after losing touch with us", peer=src)
            self._mailbox.deliver(Message(src, incarnation, tag, b"", [], error=error))

    # -- receives ----------------------------------------------------------------------------
    def get_nowait(self, src: str | None, tag: Any) -> Message | None:
        """The next matching message if one is queued (raises if none can ever come)."""
        self._guard()
        if src is not None and src not in self._valid:
            self._sessions.check_address(src)
        msg = self._mailbox.get_nowait(src, tag)
        if msg is not None and self._shm is not None and self._shm.owed >= _OWED_BURST:
            # consuming a backlog without yielding: return the slots now, not at the end
            self._shm.flush()
        return msg

    def park(self, src: str | None, tag: Any, timeout: float | None) -> Awaitable[Message]:
        """Await the next matching message when :meth:`get_nowait` found none (returned
        without a coroutine of its own around the mailbox's wait: one level less to
        resume per received message)."""
        if timeout is None:
            return self._mailbox.wait(src, tag)
        return self._park_timeout(src, tag, timeout)

    async def _park_timeout(self, src: str | None, tag: Any, timeout: float) -> Message:
        try:
            async with asyncio.timeout(timeout):
                return await self._mailbox.wait(src, tag)
        except TimeoutError:
            what = f"from {src}" if src else "from any source"
            raise CommTimeoutError(f"{self._address}: no message {what} with tag {tag!r} within {timeout} s") from None

    async def get(self, src: str | None, tag: Any, timeout: float | None) -> Message:
        msg = self.get_nowait(src, tag)
        return msg if msg is not None else await self.park(src, tag, timeout)

    async def finish(self, msg: Message) -> Any:
        """``msg``, decoded: over its buffers, or over owned copies when it came through
        shared memory and this communicator takes copies (``shm_views=False``)."""
        if msg.shm and self.copies:
            return await self._decode_owned(msg)
        return self.decode(msg)

    def decode(self, msg: Message) -> Any:
        if msg.error is not None:
            raise msg.error
        if msg.ready is not None:       # GPU buffers: the caller's stream follows their copy
            try:
                msg.ready()
            except Exception as exc:   # a device in a bad state
                raise DecodeError(f"message from {msg.src}: its GPU buffers cannot be waited for: {exc!r}") from exc
        return self._codec.decode(msg.codec_header, msg.buffers)

    async def _decode_owned(self, msg: Message) -> Any:
        """Copy-out (``shm_views=False``): decode over owned copies; the slot goes back
        as soon as the copies are made. Large copies run in the executor; a receive
        cancelled meanwhile puts the message back (nothing is lost). A pulled message
        was read into owned memory on arrival: wait for that read to end."""
        if msg.pulling is not None:
            try:
                await asyncio.shield(msg.pulling)
            except asyncio.CancelledError:
                self._mailbox.put_back(msg)
                raise
            msg.pulling, msg.shm = None, False
            return self.decode(msg)
        if self._pull is not None:    # it came through a slot: ask its sender to be pulled from
            self._pull.want(msg.src, msg.incarnation)
        if msg.error is None:
            if msg.nbytes >= self._shm.offload:
                try:
                    owned = await self._loop.run_in_executor(None, self._shm.owned, msg.buffers)
                except asyncio.CancelledError:
                    self._mailbox.put_back(msg)
                    raise
            else:
                owned = self._shm.owned(msg.buffers)
            msg.buffers, msg.shm = owned, False
        return self.decode(msg)

    async def recv_into(self, target: Any, src: str, tag: Any, timeout: float | None) -> Any:
        """Receive into ``target`` (``comm.recv_into``): a message that does not match
        it stays next in line."""
        msg = await self.get(src, tag, timeout)
        obj = await self.finish(msg)
        try:
            copy_into(target, obj)
        except (TypeError, ValueError):
            del obj
            self._mailbox.put_back(msg)
            raise
        return target

    def start_recv(self, src: str, tag: Any, what: str) -> Work[Any]:
        """A receive whose place in line is taken now, as a :class:`Work` (``async_recv``)."""
        try:
            msg = self.get_nowait(src, tag)
        except RlinfError as exc:    # lost or closed: the Work fails with it
            failed = self._loop.create_future()
            failed.set_exception(exc)
            return Work(failed, what)
        waiter = self._mailbox.park(src, tag) if msg is None else None
        started = []
        task = self._loop.create_task(self._finish_recv(msg, waiter, started))

        def cancelled_before_it_ran(t: asyncio.Task) -> None:
            if t.cancelled() and not started:   # the message (or the place) is not lost
                if waiter is not None:
                    self._mailbox.abandon(waiter)
                else:
                    self._mailbox.put_back(msg)

        task.add_done_callback(cancelled_before_it_ran)
        return Work(task, what)

    async def _finish_recv(self, msg: Message | None, waiter: Any, started: list) -> Any:
        started.append(True)
        if msg is None:
            msg = await self._mailbox.wait_parked(waiter)
        return await self.finish(msg)

    def take_queued(self, tag: Any, visit: Callable[[Any, str], None]) -> None:
        """Take the messages with ``tag`` already queued, decoded, to ``visit(obj, src)``
        (see :meth:`rlinf.core.interface.Core.take_queued`). Messages still being read
        from their sender's memory are left queued, in order."""
        mailbox = self._mailbox
        pulled = []
        try:
            while (msg := mailbox.get_nowait(None, tag)) is not None:
                if msg.pulling is not None:
                    pulled.append(msg)
                    continue
                visit(self.decode(msg), msg.src)
        finally:
            for msg in reversed(pulled):
                mailbox.put_back(msg)
