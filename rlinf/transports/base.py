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
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Received", "Link", "Listener", "Transport"]


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
