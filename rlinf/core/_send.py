"""The send path: a message from ``send`` to its peer session's outbox.

:class:`SendPath` encodes a message once, chooses how its buffers travel (copied inline,
as ZeroMQ frames, over the bulk stream, in a shared-memory slot, pulled by the
receiver, or in a CUDA IPC slot: :mod:`rlinf.core.routing` decides, the sessions of
those transports do the work) and queues it, in call order, on the
:class:`~rlinf.core._peer.PeerSession` of its destination. Notices the shared-memory,
pull and CUDA IPC sessions owe a peer ride ahead of the next message to it.

Callers (the facade, ``comm.internal``) have checked that the communicator is open and
that this is its loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable

from ..codec import Codec, is_device_buffer
from ..transports.shm import PullSession, ShmSession
from . import routing, wire
from ._gpu_paths import GpuPaths
from ._mailbox import Mailbox, Message
from ._outbox import SMALL_MESSAGE, OutMessage, Outbox
from ._peer import PeerSession, PeerSessions

__all__ = ["SendPath"]


class SendPath:
    """How this communicator's messages reach their peer sessions (loop thread only).

    Args:
        address, incarnation: the communicator's.
        codec: encodes messages. sessions: the peer sessions. mailbox: takes messages
            to ourselves. gpu: the GPU paths. config: the routing config.
        check_open: raises unless the communicator is open (a notice may still go out
            while it closes, to a peer it already has a session with).
    """

    def __init__(self, address: str, incarnation: str, codec: Codec, sessions: PeerSessions, mailbox: Mailbox,
                 gpu: GpuPaths, config: routing.RoutingConfig, check_open: Callable[[], None]) -> None:
        self._address = address
        self._incarnation = incarnation
        self._codec = codec
        self._sessions = sessions
        self._valid = sessions.valid
        self._mailbox = mailbox
        self._gpu = gpu
        self._config = config
        self._check_open = check_open
        # set by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shm: ShmSession | None = None
        self._pull: PullSession | None = None

    def start(self, loop: asyncio.AbstractEventLoop, shm: ShmSession | None, pull: PullSession | None) -> None:
        self._loop, self._shm, self._pull = loop, shm, pull

    def session(self, dst: str) -> PeerSession:
        """``dst``'s session, opened on first use. Raises its error if it failed."""
        session = self._sessions.get(dst)
        if session is None:
            return self._sessions.open(dst)
        if session.error is not None:
            raise session.error
        return session

    # -- one message -------------------------------------------------------------------------
    def enqueue(self, obj: Any, dst: str, tag: Any, kind: int, *, need_future: bool) -> asyncio.Future | None:
        """Encode and queue one message; returns a future unless it completed at once.
        A user message (an int tag) waits for the receiver's credit (see
        :mod:`rlinf.core._credit`): its future completes once it is sent.

        This is the hot path of every send: keep it flat.
        """
        if dst not in self._valid:
            self._sessions.check_address(dst)
        codec_header, buffers = self._codec.encode(obj)
        gpu = None
        for b in buffers:
            if type(b) is not memoryview and is_device_buffer(b):
                gpu = True
                break
        if dst == self._address:
            return self._to_self(tag, codec_header, buffers, need_future)
        session = self._sessions.get(dst)
        if session is None:
            session = self._sessions.open(dst)
        elif session.error is not None:
            raise session.error
        outbox = session.outbox
        if gpu:
            buffers, gpu = self._gpu.prepare(buffers, dst)
        held = False      # the large slots we owe dst go back with this message, ahead of it
        ahead = None
        if self._shm is not None and self._shm.owed:
            ahead = self._shm.ahead(dst)
            if ahead:
                self._queue_notice(outbox, self._shm.take(dst), hold=True)
                held = True
        cuda = self._gpu.session
        if cuda is not None and cuda.owed:
            notice = cuda.take(dst)
            if notice is not None:
                self._queue_notice(outbox, notice, hold=True, tag="cuda")
                held = True
        future = self._queue(session, kind, tag, codec_header, buffers, need_future, gpu)
        if held:
            outbox.flush()
        elif ahead is False:   # small slots: right after it (after its flush), off a reply's path
            self._loop.call_soon(self._shm.flush_to, dst)
        return future

    def behind(self, dst: str) -> bool:
        """Whether ``dst`` holds a window of our shared-memory or CUDA IPC slots."""
        if self._shm is not None and self._shm.behind(dst):
            return True
        cuda = self._gpu.session
        return cuda is not None and cuda.behind(dst)

    async def room(self, dst: str) -> None:
        """Backpressure: wait while ``dst`` holds a window of our slots. Raises the
        peer's error if it went away meanwhile (it may never have read what we sent)."""
        if self._shm is not None and self._shm.behind(dst):
            await self._shm.room(dst)
            session = self._sessions.get(dst)
            if session is not None and session.error is not None:
                raise session.error
        cuda = self._gpu.session
        if cuda is not None and cuda.behind(dst):
            await cuda.room(dst)

    def _queue(self, session: PeerSession, kind: int, tag: Any, codec_header: bytes, buffers: list,
               need_future: bool, gpu: list | None = None) -> asyncio.Future | None:
        """Route and queue one encoded message on ``session`` (the rest of the hot path);
        ``gpu``: the descriptor of its GPU buffers, already in a CUDA IPC slot."""
        outbox = session.outbox
        nbytes = 0
        for b in buffers:
            nbytes += b.nbytes if type(b) is memoryview else memoryview(b).nbytes
        gated = type(tag) is int and kind == wire.USER
        if nbytes >= self._config.shm_threshold and nbytes and self._shm is not None \
                and outbox.info is not None and self._sessions.shm_route(session):
            if gated and not need_future and not outbox.credit.open_to(nbytes + len(codec_header), tag):
                need_future = True       # it waits for credit: the sender awaits that
            sizes = [memoryview(b).nbytes for b in buffers]
            relayed = self._shm.relay.plan(buffers, sizes, outbox.address)
            if relayed is None and gpu is None and kind == wire.USER and self._pull is not None \
                    and nbytes >= self._pull.threshold and self._pull.agreed(outbox.address, outbox.info.incarnation):
                return self._queue_pull(outbox, tag, codec_header, buffers, sizes, nbytes, gated)
            if relayed is not None:   # views of another process's slot: forwarded by reference
                sizes = [0 if i in relayed[0] else n for i, n in enumerate(sizes)]
            export = self._shm.export(buffers, sizes, {outbox.address: 1}) if any(sizes) else (None, sizes, None)
            if export is not None:
                return self._queue_slot(outbox, kind, tag, codec_header, export, nbytes, need_future, relayed,
                                        gpu, gated)
            if relayed is not None:
                self._shm.relay.cancel(outbox.address, relayed[1])
        if nbytes < SMALL_MESSAGE:
            # copy now (the caller may reuse its buffers; a whole bytes object it cannot change);
            # coalesced into one frame later
            frames, counts, large = [b if type(b) is memoryview and type(b.obj) is bytes and b.nbytes == len(b.obj)
                                     else bytes(b) for b in buffers], None, False
        elif gpu is None and nbytes >= self._config.bulk_threshold and (
                outbox.bulk is not None or outbox.info is None and self._sessions.has_bulk):
            # another node, by the bulk stream: one frame per buffer, read into place there
            # (the peer not known yet: if it turns out to have no bulk stream to us, the
            # outbox sends it through ZeroMQ once it is, see Outbox.attach)
            frames, counts, nbytes = wire.bulk_frames(buffers)
            entry = wire.plain_entry(kind, tag, codec_header, counts)
            future = self._loop.create_future()
            outbox.put(OutMessage(entry, frames, nbytes + len(codec_header), future, True,
                                  transport=routing.BULK), self._loop, gated=gated)
            return future
        else:
            frames, counts, nbytes = wire.split_frames(buffers)
            large = True
        entry = wire.plain_entry(kind, tag, codec_header, counts)
        nbytes += len(codec_header)
        transport, discard = "zmq", None
        if gpu is not None:      # its GPU buffers wait in a CUDA IPC slot: the entry says where
            entry = wire.gpu_entry(kind, tag, codec_header, counts, gpu)
            nbytes += sum(place[2] for place in gpu[5])
            transport, discard = routing.CUDA_IPC, functools.partial(self._gpu.discard, gpu)
        if not large and not need_future and outbox.ready:
            msg = OutMessage(entry, frames, nbytes, None, False, transport=transport, discard=discard)
            if outbox.put(msg, self._loop, gated=gated):
                return None
            msg.future = self._loop.create_future()     # it waits for credit after all (a GPU
            msg.started = time.perf_counter()           # message's size grew with its slot)
            return msg.future
        future = self._loop.create_future()
        if outbox.put(OutMessage(entry, frames, nbytes, future, large, transport=transport, discard=discard),
                      self._loop, gated=gated) and not large and outbox.ready and not future.done():
            future.set_result(None)
        return future

    def _queue_pull(self, outbox: Outbox, tag: Any, codec_header: bytes, buffers: list, sizes: list[int],
                    nbytes: int, gated: bool = False) -> asyncio.Future:
        """Queue a message whose receiver pulls its buffers from our memory (it agreed to;
        see ``rlinf/transports/shm/_pull.py``); the future completes once it has read them."""
        pull = self._pull
        layout, item, future, sent = pull.offer(outbox.address, outbox.info.incarnation, buffers, sizes)
        entry = wire.pull_entry(tag, codec_header, layout, item)
        discard = lambda: pull.drop(item[0], outbox.error)   # noqa: E731
        try:
            outbox.put(OutMessage(entry, [], nbytes + len(codec_header), sent, False, transport=routing.PULL,
                                  discard=discard), self._loop, gated=gated)
        except BaseException as exc:   # the outbox failed meanwhile: no hold is left behind
            pull.drop(item[0], exc)
            future.exception()
            raise
        return future

    def _queue_slot(self, outbox: Outbox, kind: int, tag: Any, codec_header: bytes, export: tuple,
                    nbytes: int, need_future: bool, relayed: tuple | None = None,
                    gpu: list | None = None, gated: bool = False) -> asyncio.Future | None:
        """Queue a message whose buffers sit in shared memory: a slot of ours (``export``:
        ``(slot or None, layout, copying)``) and/or, when ``relayed`` (``(places,
        relays)``), other processes' slots forwarded by reference (descriptors on the wire);
        ``gpu``: its GPU buffers' CUDA IPC descriptor."""
        slot, layout, copying = export
        session, dst = self._shm, outbox.address
        if relayed is None:
            entry = wire.slot_entry(kind, tag, codec_header, layout, slot.to_wire(), gpu=gpu)
            discard = lambda: session.discard(slot, copying, dst)   # noqa: E731
        else:
            places, relays = relayed
            layout = list(layout)
            for i, place in places.items():
                layout[i] = place
            entry = wire.slot_entry(kind, tag, codec_header, layout, slot and slot.to_wire(), relays, gpu)

            def discard() -> None:
                session.relay.cancel(dst, relays)
                if slot is not None:
                    session.discard(slot, copying, dst)
        if gpu is not None:
            discard = self._with_gpu_discard(discard, gpu)
        future = None
        if copying is not None or need_future:
            future = self._loop.create_future()
        if outbox.put(OutMessage(entry, [], nbytes + len(codec_header), future, False, transport=routing.SHM,
                                 copying=copying, discard=discard), self._loop, gated=gated) \
                and copying is None and future is not None and not future.done():
            future.set_result(None)     # copied: the caller's buffers are free again
        return future

    def _with_gpu_discard(self, discard: Callable[[], None], gpu: list) -> Callable[[], None]:
        paths = self._gpu

        def both() -> None:
            discard()
            paths.discard(gpu)
        return both

    def _to_self(self, tag: Any, codec_header: bytes, buffers: list, need_future: bool) -> asyncio.Future | None:
        copies = [bytearray(memoryview(b).cast("B")) if type(b) is memoryview or not is_device_buffer(b)
                  else b.clone() if hasattr(b, "clone") else b.copy() for b in buffers]
        self._mailbox.deliver(Message(self._address, self._incarnation, tag, codec_header, copies))
        if not need_future:
            return None
        future = self._loop.create_future()
        future.set_result(None)
        return future

    # -- one message to several peers --------------------------------------------------------
    async def multicast(self, obj: Any, dsts: list[str], tag: str) -> None:
        """Send ``obj`` to every address of ``dsts``, encoded once.

        Same-node destinations that take shared memory share ONE slot (copied once, with
        a reader count; each maps it copy-on-write, so a reader's writes stay its own);
        the others get the usual path, sharing the encoded buffers. Returns when the
        buffers of ``obj`` may be reused.

        Raises:
            PeerLostError: a destination is gone (nothing was sent to anyone then).
        """
        for dst in dsts:
            self._sessions.check_address(dst)
        codec_header, buffers = self._codec.encode(obj)
        sessions = {dst: self.session(dst) for dst in dict.fromkeys(dsts) if dst != self._address}
        if any(type(b) is not memoryview and is_device_buffer(b) for b in buffers):
            # GPU buffers: one send each (a CUDA IPC slot has one reader; staged ones copy)
            await asyncio.gather(*[self.enqueue(obj, dst, tag, wire.USER, need_future=True) for dst in dsts])
            return
        sizes = [memoryview(b).nbytes for b in buffers]
        nbytes = sum(sizes)
        readers: dict[str, int] = {}
        if nbytes and nbytes >= self._config.shm_threshold and self._shm is not None:
            for dst in dsts:
                session = sessions.get(dst)
                if session is not None and session.info is not None and self._sessions.shm_route(session):
                    readers[dst] = readers.get(dst, 0) + 1
        if self._shm is not None and self._shm.owed:
            self._shm.flush()
        export = self._shm.export(buffers, sizes, readers, private=sum(readers.values()) > 1) if readers else None
        futures = []
        for dst in dsts:
            if dst == self._address:
                futures.append(self._to_self(tag, codec_header, buffers, True))
            elif export is not None and dst in readers:
                futures.append(self._queue_slot(sessions[dst].outbox, wire.USER, tag, codec_header, export, nbytes,
                                                True))
            else:
                futures.append(self._queue(sessions[dst], wire.USER, tag, codec_header, buffers, True))
        await asyncio.gather(*futures)

    # -- SYSTEM messages ---------------------------------------------------------------------
    def notice(self, dst: str, obj: Any, tag: str = "shm") -> None:
        """Send a SYSTEM notice (``"shm"``: releases, mappings; ``"pull"``; ``"cuda"``:
        CUDA IPC releases) now: also while closing, so what we owe a sender goes out
        ahead of our goodbye."""
        session = self._sessions.get(dst)
        if session is None:
            self._check_open()
            session = self._sessions.open(dst)
        if session.error is not None:
            raise session.error
        self._queue_notice(session.outbox, obj, hold=False, tag=tag)
        session.outbox.flush()       # notices are already batched by the sessions: send now

    def _queue_notice(self, outbox: Outbox, obj: Any, *, hold: bool, tag: str = "shm") -> None:
        """Queue a notice (a small SYSTEM message without buffers) to ``outbox``; with
        ``hold``, it waits for the next flush (it goes out with the message queued next)."""
        codec_header, _ = self._codec.encode(obj)
        entry = wire.system_entry(tag, codec_header)
        outbox.put(OutMessage(entry, [], len(codec_header), None, False), self._loop, hold=hold)

    def say_bye(self) -> list[str]:
        """Queue a SYSTEM "bye" behind the data on every open link: it tells each peer,
        in order with our last messages, that we left (the manager's "left" event travels
        another socket and may overtake them). Returns the peers told."""
        told = []
        for session in self._sessions:
            outbox = session.outbox
            if outbox.link is not None and outbox.error is None:
                outbox.put(OutMessage(wire.system_entry("bye"), [], 0, None, False), self._loop)
                told.append(session.address)
        return told
