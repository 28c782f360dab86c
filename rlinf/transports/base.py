"""The transport contract: how a plug-in moves one frame set between two processes.

A transport offers three things:

* ``available()`` — can it run in this process (packages, devices)? Never raises.
* ``listen()`` — bind the receiving side; returns a :class:`Listener` with the endpoints
  peers connect to, delivering every incoming frame set whole, in order per link, to a
  callback (or to ``recv()``).
* ``connect(endpoint, identity=...)`` — a :class:`Link` to one peer's listener;
  ``connect_now`` is the same without an await, for the transports that connect in the
  background (ZeroMQ): the session layer gives a peer its first link with it, so that a
  message can be queued on the link in the call that opened the session.

A :class:`Link` is what the session layer drives: :meth:`Link.try_send` (never waits;
raises :class:`WouldBlock` when full), :meth:`Link.wait_writable`,
:meth:`Link.released` (for frame sets sent zero-copy), :meth:`Link.close_gracefully`
and :meth:`Link.close`; :meth:`Link.send` composes them. Each method states its
buffer-lifetime rule; each concrete transport states, in its module docstring, how it
keeps it. Received frames stay valid while referenced.

Errors: transports raise only rlinf errors. A native error (``zmq.ZMQError``,
``OSError``, a failed seal) is translated once, where it happens, into
:class:`~rlinf.errors.PeerLostError` (the connection broke),
:class:`~rlinf.errors.ClosedError` (we closed it) or
:class:`~rlinf.errors.TransportUnavailableError` (cannot listen here), with ``raise ...
from exc``. :class:`WouldBlock` is :class:`rlinf.errors.WouldBlock`, the one rlinf
raises everywhere.

Transports move bytes: they know headers only as opaque first frames. The buffer
descriptors some of them put on the wire, and the size limits they check, are in
:mod:`.descriptors`; the message format that embeds them (:mod:`rlinf.core.wire`) sits
above and is never imported here.

The communicator never knows which transport it is using: :mod:`rlinf.core.routing`
decides, per buffer. Every link the communicator uses passes the conformance suite in
``tests/transports/``.

Shared memory and CUDA IPC are not links: a message's buffers go into a slot and only a
descriptor travels on a link. The session layer drives them through their session
objects (:class:`rlinf.transports.shm.ShmSession` and
:class:`~rlinf.transports.shm.PullSession`, :class:`rlinf.transports.cuda.CudaIpcSession`),
whose modules state their contracts and buffer lifetimes; :class:`~rlinf.transports.shm.ShmTransport`
packages the same pieces as a link for the conformance suite. What such a session keeps
about one peer is one object, a :class:`PeerState` it hands out (``session.peer(...)``):
the core's per-peer session holds it, and the core closes it once, when that peer is
gone (the transports never learn of departures on their own).
"""

from __future__ import annotations

import abc
import asyncio
import collections
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, Sequence

from ..errors import ClosedError, TransportUnavailableError, WouldBlock

__all__ = ["Received", "Link", "Listener", "Transport", "Inbox", "Tracker", "WouldBlock", "PeerState"]


#: What :meth:`Link.try_send` returns for a tracked frame set: opaque, only to be
#: passed to the same link's :meth:`Link.released`.
Tracker = Any


class PeerState(Protocol):
    """What a transport's session keeps about one peer (shared memory: by address;
    pulls: by incarnation), handed out by the session's ``peer(...)``, made on first use.

    The core's :class:`~rlinf.core._peer.PeerSession` for that peer holds it; the core
    closes it once that peer incarnation left or was lost. Closing it releases all the
    transport keeps for the peer (slots it held, mappings of its memory, sends it had
    yet to read); a later ``peer(...)`` for the same key starts afresh.
    """

    address: str
    closed: bool

    def close(self, *, process_gone: bool = False) -> None:
        """The peer is gone (``process_gone``: its process is known gone from this
        machine, so what it had mapped may be unlinked at once). Idempotent."""


@dataclass(slots=True)
class Received:
    """One incoming frame set.

    Attributes:
        peer: the sending link's identity (bytes, as the sender's link presented it).
        header: the first frame (bytes).
        frames: the payload frames, as writable buffer-protocol objects owned by the
            receiver; they stay valid as long as a reference to them is held.
    """

    peer: bytes
    header: bytes
    frames: list[Any]


class Inbox:
    """Where a listener puts the frame sets it received (on the loop thread): to the
    handler when one is set, else queued for :meth:`recv` (tests, tools).

    Args:
        loop: the loop :meth:`deliver` and :meth:`recv` run on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handler: Callable[[Received], None] | None = None
        self._loop = loop
        self._queue: collections.deque[Received] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._closed = False

    def deliver(self, received: Received) -> None:
        if self.handler is not None:
            self.handler(received)
            return
        self._queue.append(received)
        self._wake()

    async def recv(self) -> Received:
        """Next frame set.

        Raises:
            ClosedError: closed, and nothing is left to read.
        """
        while not self._queue:
            if self._closed:
                raise ClosedError("listener is closed")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def close(self) -> None:
        """Wake a pending :meth:`recv`; what is queued can still be read."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Link(abc.ABC):
    """A one-way connection to one peer's :class:`Listener`: the contract the session
    layer (:class:`rlinf.core._outbox.Outbox`) drives.

    Sending is split into a primitive that never waits and two waits, so one task can
    queue, coalesce and order messages for a peer without a thread or a task per send:

    * :meth:`try_send` hands one frame set over now, or raises :class:`WouldBlock`;
    * :meth:`wait_writable` waits until it may take the next one;
    * :meth:`released` waits until the link no longer reads the buffers of a tracked
      frame set.

    :meth:`send` composes the three. Frame sets handed to one link arrive whole and in
    the order they were handed over, or not at all. Every method raises only rlinf
    errors: :class:`WouldBlock` (the link is full), :class:`~rlinf.errors.ClosedError`
    (we closed it) and :class:`~rlinf.errors.PeerLostError` (the connection broke; the
    native error is its ``__cause__``). All methods run on the loop thread.

    ``kind`` names the path a link's bytes take, as ``comm.stats().transports`` counts them.
    """

    kind = "link"

    @abc.abstractmethod
    def try_send(self, frames: Sequence[Any], *, track: bool = False) -> Tracker | None:
        """Hand one frame set (``frames[0]`` is the header, bytes; the rest are
        bytes-like buffers) to the link without waiting.

        Buffer lifetime: with ``track`` false the link is done with ``frames`` when
        this returns (it copied or wrote them) and returns None. With ``track`` true it
        may keep referencing them (zero-copy) and return a tracker: the caller keeps
        every buffer alive and unchanged until :meth:`released` returned for it. A
        tracked send may also return None when nothing stays referenced.

        Raises:
            WouldBlock: the link cannot take it now (a full buffer, a frame set still in
                flight); nothing was handed over. Wait with :meth:`wait_writable`.
            ClosedError: the link was closed by us.
            PeerLostError: the connection broke.
        """

    @abc.abstractmethod
    async def wait_writable(self) -> None:
        """Return once :meth:`try_send` may take a frame set again (it may still raise
        :class:`WouldBlock` when another caller took the room first).

        Raises:
            ClosedError: the link was closed by us (also while waiting).
            PeerLostError: the connection broke (also while waiting).
        """

    @abc.abstractmethod
    async def released(self, tracker: Tracker | None) -> None:
        """Return once the link no longer references the buffers of the frame set
        :meth:`try_send` returned ``tracker`` for: from then on the caller may reuse
        or free them. ``None`` returns at once. Cancelling the wait does not cancel
        the send.

        Raises:
            ClosedError / PeerLostError: only links that learn it (bulk TCP, whose
                receiver acknowledges): the frame set did not reach the peer because
                the link was closed or broke meanwhile.
        """

    @abc.abstractmethod
    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> Awaitable[None] | None:
        """Close, still delivering what was handed over, for at most ``linger_ms``.

        New sends and waiters fail with ``exc`` (default :class:`ClosedError`) at
        once. Returns an awaitable when the frames still go out on this loop (await it
        before the loop stops, or they are lost), or None when another thread delivers
        them (ZeroMQ's I/O thread, until its context terminates). Idempotent.
        """

    @abc.abstractmethod
    def close(self, exc: BaseException | None = None) -> None:
        """Close at once, dropping what is not sent yet; waiters and later calls fail
        with ``exc`` (default :class:`ClosedError`). Idempotent."""

    async def send(self, header: bytes, buffers: Sequence[Any]) -> None:
        """Send one frame set, ``header`` then ``buffers`` (bytes-like), waiting for
        room as needed: the contract's primitives composed, for callers that send one
        frame set at a time (tools, tests, the bulk path of the outbox).

        Buffer lifetime: returns when every buffer may be reused or freed by the
        caller. Cancelled before the frame set was handed over, nothing is sent;
        after, it is still delivered whole and the buffers stay in use until the link
        released them.

        Raises:
            ClosedError: the link was closed by us.
            PeerLostError: the connection broke.
        """
        frames = [header, *buffers]
        while True:
            try:
                tracker = self.try_send(frames, track=True)
                break
            except WouldBlock:
                await self.wait_writable()
        await self.released(tracker)


class Listener(abc.ABC):
    """The receiving side of a transport in one process."""

    #: Endpoints by scheme, e.g. ``{"ipc": "ipc:///tmp/rlinf-x/3.sock"}``.
    endpoints: dict[str, str]

    @abc.abstractmethod
    def set_handler(self, handler: Callable[[Received], None]) -> None:
        """Deliver every incoming frame set to ``handler`` (called on the loop thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening and release endpoints (socket files). Idempotent."""


class Transport(abc.ABC):
    """A transport plug-in (see the module docstring)."""

    name: str

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """True when this transport can run in this process. Never raises."""

    @abc.abstractmethod
    async def listen(self) -> Listener:
        """Bind and start receiving."""

    @abc.abstractmethod
    async def connect(self, endpoint: str, *, identity: bytes) -> Link:
        """Open a link to ``endpoint``, presenting ``identity`` to the receiver."""

    def connect_now(self, endpoint: str, *, identity: bytes) -> Link:
        """:meth:`connect` without an await, where the transport connects in the
        background (the link queues until then).

        Raises:
            TransportUnavailableError: this transport needs :meth:`connect`.
            PeerLostError: ``endpoint`` cannot be connected to.
        """
        raise TransportUnavailableError(f"the {self.name} transport connects only with 'await connect()'")
