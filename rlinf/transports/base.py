"""The transport contract: how a plug-in moves one frame set between two processes.

A transport offers three things:

* ``available()`` — can it run in this process (packages, devices)? Never raises.
* ``listen()`` — bind the receiving side; returns a :class:`Listener` with the endpoints
  peers connect to, delivering every incoming frame set to a callback.
* ``connect(endpoint)`` — a :class:`Link` to one peer's listener; ``send(header,
  buffers)`` returns once the buffers may be reused by the caller.

The communicator never knows which transport it is using: :mod:`rlinf.routing` decides,
per buffer. Each concrete transport states its buffer-lifetime rule in its docstring,
and all of them pass the conformance suite in ``tests/transports/``.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import ClosedError

__all__ = ["Received", "Link", "Listener", "Transport", "Inbox", "WouldBlock"]


class WouldBlock(Exception):
    """A link's ``try_send`` cannot take the frame set now (its buffer is full); wait
    for room with its ``wait_writable``. Never escapes the communicator."""


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
    """A one-way connection to one peer's :class:`Listener`."""

    @abc.abstractmethod
    async def send(self, header: bytes, buffers: Sequence[Any]) -> None:
        """Send one frame set: ``header`` then ``buffers`` (bytes-like).

        Returns when every buffer may be reused (or freed) by the caller.

        Raises:
            ClosedError: the link was closed by us.
            PeerLostError: the connection broke.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close at once; pending sends fail with ``ClosedError``. Idempotent."""


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
