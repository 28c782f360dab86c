"""Membership: the roster, and what follows when a peer joins, leaves or is lost.

The control client hands every :class:`~rlinf.info.MembershipEvent` to
:meth:`Membership.on_event` (and a peer's in-order goodbye on the data link arrives as
:meth:`Membership.peer_gone`). A join updates the roster and lets a restarted peer's
messages through again; a departure fails what waits on that incarnation
(:meth:`Membership.peer_gone`, idempotent): its receives, its session
(:meth:`rlinf.core._peer.PeerSessions.peer_gone`) and the subsystems' hooks.
"""

from __future__ import annotations

import asyncio
from typing import Callable, NamedTuple

from ..errors import PeerLostError
from ..info import MembershipEvent, WorkerInfo
from ..util.bounded import Recent
from ._mailbox import Mailbox
from . import _peer
from ._peer import PeerSessions

__all__ = ["Departure", "Membership"]

#: How long a "left" peer that sent us data may take to deliver its in-order "bye".
_BYE_GRACE = 2.0
#: When that grace ends after a stall, the bye (and the data before it) may still wait
#: unread in the socket: uvloop runs due timers before it polls I/O. The peer is declared
#: gone only this much later, after one more poll.
_AFTER_ONE_POLL = 0.01


class Departure(NamedTuple):
    """How an incarnation went: ``kind`` ``"left"`` or ``"lost"``, and ``info``, what the
    roster knew of it (None when it never knew it), so that whoever learns of the
    departure later can still judge its process (its pid and machine)."""

    kind: str
    info: WorkerInfo | None


class Membership:
    """The peers of one communicator (loop thread only).

    Args:
        address: the communicator's. roster: its peers by address (written here).
        dead: ``(address, incarnation)`` of peers known gone, to their :class:`Departure`
            (written here).
        mailbox: its mailbox. sessions: its peer sessions.
        closed: whether the communicator is closed (departures are moot then).
    """

    def __init__(self, address: str, roster: dict[str, WorkerInfo], dead: Recent, mailbox: Mailbox,
                 sessions: PeerSessions, closed: Callable[[], bool]) -> None:
        self._address = address
        self._roster = roster
        self._dead = dead
        self._mailbox = mailbox
        self._sessions = sessions
        self._closed = closed
        self._hooks: list[Callable[[str, str], None]] = []
        self._subscribers: list[asyncio.Queue] = []
        self._timers: set[asyncio.TimerHandle] = set()    # goodbyes still awaited
        # set by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resume: Callable[[str, str], None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop, resume: Callable[[str, str], None] | None = None) -> None:
        """``resume(address, incarnation)``: a peer taken for lost is back (the receive
        path delivers what it held from it)."""
        self._loop, self._resume = loop, resume

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        self._hooks.append(hook)

    def subscribe(self) -> asyncio.Queue:
        """A queue of the events from now on (None once the communicator closed)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.remove(queue)

    def departed(self, address: str, incarnation: str) -> Departure | None:
        """How ``address``'s ``incarnation`` went, while it is remembered gone."""
        return self._dead.get((address, incarnation))

    def pid_of(self, address: str) -> int | None:
        info = self._roster.get(address)
        return info.pid if info is not None else None

    def on_event(self, event: MembershipEvent, bye_sent: bool = False) -> None:
        if event.address == self._address:
            return
        self._sessions.changed(event.address)
        if event.kind == "joined" and event.info is not None:
            old = self._roster.get(event.address)
            self._roster[event.address] = event.info
            back = self._dead.pop((event.address, event.incarnation), False) is not False
            self._mailbox.peer_joined(event.address, event.incarnation)
            self._sessions.joined(event.address, old, event.info)
            if back and self._resume is not None:
                self._resume(event.address, event.incarnation)
        else:
            info = self._roster.get(event.address)
            if info is not None and event.incarnation and info.incarnation != event.incarnation:
                return   # an older incarnation went away; the current one is fine
            self._roster.pop(event.address, None)
            # "failed": its code raised, but it closed as one that left does (goodbye sent)
            kind = "left" if event.kind == "failed" else event.kind
            if kind == "left" and bye_sent:
                # Its last messages may still be in flight on the data socket; its "bye"
                # follows them. Fall back to the event if the bye never comes.
                self._later(_BYE_GRACE, self._later, _AFTER_ONE_POLL,
                            self.peer_gone, event.address, event.incarnation, "left", info)
            else:
                self.peer_gone(event.address, event.incarnation, kind, info)
        for queue in self._subscribers:
            queue.put_nowait(event)

    def _later(self, delay: float, callback: Callable, *args) -> None:
        """``callback(*args)`` in ``delay`` seconds, unless the communicator closes first."""
        def run() -> None:
            self._timers.discard(timer)
            callback(*args)

        timer = self._loop.call_later(delay, run)
        self._timers.add(timer)

    def said_bye(self, address: str, incarnation: str) -> None:
        """``address``'s in-order goodbye arrived on the data link: it left, and every
        message it sent before is already delivered."""
        self.peer_gone(address, incarnation, "left")

    def peer_gone(self, address: str, incarnation: str, kind: str, info: WorkerInfo | None = None) -> None:
        """``address``'s ``incarnation`` is gone: fail what waits on it (idempotent).
        ``info``: the roster's entry for it, if the roster dropped it already."""
        key = (address, incarnation)
        if key in self._dead or self._closed():
            return
        current = self._roster.get(address)
        if info is None and current is not None and current.incarnation == incarnation:
            info = current
        # "lost": what it still sends is held (it may come back)
        self._dead.add(key, _peer.DEAD_KEPT, Departure(kind, info))
        self._sessions.forget_inflow(f"{address}|{incarnation}".encode(), left=kind == "left")
        if current is not None and current.incarnation != incarnation:
            self._sessions.peer_gone(address, incarnation, kind, info, None)
            return   # a newer incarnation already joined
        error = PeerLostError(f"{address} left" if kind == "left" else
                              f"{address} was lost: messages on their way to or from it may be missing "
                              "(if it comes back, what it had not acknowledged is sent again)", peer=address)
        self._mailbox.peer_lost(address, error)
        self._sessions.peer_gone(address, incarnation, kind, info, error)
        for hook in self._hooks:
            hook(address, incarnation)

    def close(self) -> None:
        """The communicator closed: event iterators end, goodbyes are no longer awaited."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for queue in self._subscribers:
            queue.put_nowait(None)
