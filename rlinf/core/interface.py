"""The core's interface for rlinf's own subsystems.

Collectives, channels, resharding and the launcher (and the weight store to come) reach
the core through ``comm.internal``, an object of the :class:`Core` protocol, never
through the Communicator's private members. It is the one door between the messaging
core and what is built on it: what a subsystem may do is listed here, typed, and the
core may change behind it.

Internal traffic uses ``str`` tags: they can never match a user's ``int`` tag, so a
subsystem's messages never reach an application's ``recv``. A subsystem picks tags of
its own namespace (``"rlinf.channel.3"``, a collective call's ``"<group>:<seq>"``).

Everything here runs on the communicator's loop thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol

from ..codec import Codec
from ..info import WorkerInfo
from ._outbox import SMALL_MESSAGE
from ._membership import Departure
from ._trace import Recorder

__all__ = ["Core", "Departure", "HasCore", "SMALL_MESSAGE", "SYSTEM_TAGS"]

#: SYSTEM message tags the core handles itself (shared-memory and CUDA IPC notices,
#: pulls, the in-order goodbye): ``on_system`` refuses them.
SYSTEM_TAGS = frozenset({"shm", "pull", "cuda", "bye", "void"})


class Core(Protocol):
    """What a subsystem may ask of the core (``comm.internal``)."""

    @property
    def address(self) -> str:
        """This worker's ``"group:rank"``."""

    @property
    def incarnation(self) -> str:
        """This process's incarnation of :attr:`address`."""

    @property
    def manager_address(self) -> str:
        """The manager's endpoint."""

    @property
    def token(self) -> str:
        """The cluster token (for processes a subsystem starts, e.g. a channel server)."""

    @property
    def info(self) -> WorkerInfo | None:
        """This worker's registration (None until started)."""

    @property
    def codec(self) -> Codec:
        """The codec messages are encoded with (for payloads a subsystem packs itself)."""

    @property
    def trace(self) -> Recorder | None:
        """The communicator's trace recorder (``RLINF_TRACE``), None when tracing is off:
        a subsystem notes its operations with ``trace.span(lane, name, start, **args)``
        (``start = trace.now()``), checking for None first, so that off costs nothing."""

    def check_open(self) -> None:
        """Raise :class:`~rlinf.ClosedError` unless the communicator is started and open."""

    def timeout_of(self, timeout: Any) -> float | None:
        """The timeout a public operation given ``timeout=`` runs with: ``timeout``
        checked (:func:`rlinf.info.check_timeout`), or, when None, the communicator's
        default (``RLINF_TIMEOUT``, ``Settings.timeout``; None: wait forever).

        Raises:
            TypeError / ValueError: not None or a number of seconds >= 0.
        """

    def start_send(self, obj: Any, dst: str, tag: str) -> asyncio.Future:
        """Queue ``obj`` to ``dst`` now (the order is fixed by this call), as a user
        message with the internal ``tag``. The future completes when the buffers of
        ``obj`` may be reused, or fails (:class:`~rlinf.PeerLostError`, ...).

        Raises:
            PeerLostError: ``dst`` is known to be gone. ClosedError. EncodeError.
        """

    async def multicast(self, obj: Any, dsts: list[str], tag: str) -> None:
        """Send ``obj`` to every address of ``dsts``, encoded once (same-node readers
        share one shared-memory slot). Returns when its buffers may be reused.

        Raises:
            PeerLostError: a destination is gone (nothing was sent to anyone then).
        """

    async def recv(self, src: str, tag: str, timeout: float | None = None) -> Any:
        """The next message from ``src`` with the internal ``tag``, decoded.

        Raises:
            PeerLostError, CommTimeoutError, DecodeError, ClosedError.
        """

    async def recv_any(self, tag: str, timeout: float | None = None) -> tuple[Any, str]:
        """The oldest message with the internal ``tag`` from any source: ``(obj, src)``."""

    def take_queued(self, tag: str, visit: Callable[[Any, str], None]) -> None:
        """Take the messages with ``tag`` already queued, oldest first, and pass each,
        decoded, to ``visit(obj, src)``; an exception from ``visit`` (or a message that
        cannot be decoded) stops there and propagates. Messages whose buffers are still
        being read from their sender's memory are left queued, in order."""

    def retire(self, tag: str) -> None:
        """Nobody receives ``tag`` again: drop its queued messages and later arrivals."""

    def is_lost(self, address: str) -> bool:
        """Whether ``address`` is known to have left or been lost (receives from it fail)."""

    def roster(self) -> list[WorkerInfo]:
        """The peers this communicator knows (its cached roster, without itself)."""

    async def lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        """Ask the manager for ``address`` (with ``wait``, until it registers).

        Raises:
            CommTimeoutError: no answer (or, with ``wait``, no such worker) in ``timeout``.
        """

    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        """Call ``handler(src, obj)`` for each SYSTEM message with ``tag``.

        Raises:
            ValueError: the core uses ``tag`` itself (:data:`SYSTEM_TAGS`).
        """

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        """Call ``hook(address, incarnation)`` whenever a peer leaves or is lost."""

    def departed(self, address: str, incarnation: str) -> Departure | None:
        """How ``address``'s ``incarnation`` went (``kind`` and the roster's last entry
        for it, to judge its process by), while it is remembered gone: in a
        :meth:`on_peer_gone` hook, always."""

    def add_closer(self, closer: Callable[[], Any]) -> None:
        """Run ``closer()`` (sync or async) when the communicator closes, newest first."""

    def add_drainer(self, drainer: Callable[[float], Awaitable[None]]) -> None:
        """Await ``drainer(linger)`` when the communicator starts closing, while it is
        still open: the subsystem sends what it accepted and not yet delivered (a
        channel handle's queued puts) and waits until it has arrived, within ``linger``
        seconds, or raises; ``aclose`` raises that error once everything is closed."""

    def add_stats_provider(self, name: str, provider: Callable[[], dict]) -> None:
        """Report ``provider()`` under ``name`` with the heartbeats' stats.

        Raises:
            ValueError: ``name`` is taken.
        """


class HasCore(Protocol):
    """A communicator, as a subsystem sees it: the door to its :class:`Core`."""

    @property
    def internal(self) -> Core:
        """The core's interface for rlinf's subsystems."""
