"""The bulk message on its way to one peer, and what may overtake it.

While a large message to another node travels on the peer's bulk TCP stream (seconds on
a slow link), the outbox goes on sending what may overtake it (DESIGN.md §4: ordering is
per sender, receiver and tag): messages with other tags. The first message with its tag,
and every message behind that one with the same tag, waits here (``behind``), in order,
until the bulk message arrived; so does everything behind a goodbye, which follows every
message. Frame sets sent meanwhile name the message they may overtake (``skip``), and
the receiver delivers them ahead of it (see :mod:`rlinf.core._delivery`).

Buffer lifetimes: a message waiting here keeps its frames as it did in the queue.
"""

from __future__ import annotations

import collections
from typing import Any

from . import wire
from ._outmsg import OutMessage
from .routing import BULK

__all__ = ["Overtaking"]

#: SYSTEM messages that never overtake a bulk message: the goodbye, which follows every
#: message, and the void entry, which stands for one.
_IN_PLACE = frozenset({"bye", wire.VOID})


def _in_place(msg: OutMessage) -> bool:
    return msg.entry[wire.KIND] != wire.USER and msg.tag in _IN_PLACE


class Overtaking:
    """One outbox's bulk message on its way (loop thread only).

    ``numbering``: a bulk message waits for its number (its stream is being dialled);
    what may overtake it goes meanwhile, ahead of it (it has no number yet: nothing to
    skip). ``skip``: ``seq + 1`` of the bulk message on its way (0: none). ``tag``: the
    bulk message's. ``behind``: the messages that wait for it, in order.
    """

    __slots__ = ("numbering", "skip", "tag", "behind", "_tags", "_wall")

    def __init__(self) -> None:
        self.numbering = False
        self.skip = 0
        self.tag: Any = None
        self.behind: collections.deque[OutMessage] = collections.deque()
        self._tags: set = set()
        self._wall = False       # a goodbye waits: nothing passes it

    @property
    def active(self) -> bool:
        """Whether a bulk message is being numbered or on its way (only what
        :meth:`overtakes` it may go)."""
        return self.numbering or bool(self.skip)

    def numbered_later(self, tag: Any) -> None:
        """A bulk message with ``tag`` waits for its stream to be dialled."""
        self.numbering, self.tag = True, tag

    @property
    def busy(self) -> bool:
        """Whether a bulk message is being numbered or on its way, or messages wait for it."""
        return self.numbering or bool(self.skip) or bool(self.behind)

    def started(self, seq: int, tag: Any) -> None:
        """The bulk message got number ``seq`` and is on its way."""
        self.skip, self.tag, self.numbering = seq + 1, tag, False

    def overtakes(self, msg: OutMessage) -> bool:
        """Whether ``msg`` may go now: not for the bulk stream itself, a tag that is
        neither the bulk message's nor one of those waiting, and no goodbye before it."""
        return (not self._wall and msg.transport != BULK and msg.tag != self.tag
                and msg.tag not in self._tags and not _in_place(msg))

    def wait(self, msg: OutMessage) -> None:
        """``msg`` waits for the bulk message (messages behind it may pass it)."""
        self.behind.append(msg)
        self._tags.add(msg.tag)
        self._wall = self._wall or _in_place(msg)

    def done(self, queue: collections.deque[OutMessage]) -> None:
        """The bulk message is no longer on its way: what waited for it goes back to the
        front of ``queue``, in order."""
        self.numbering, self.skip, self.tag, self._wall = False, 0, None, False
        if self.behind:
            queue.extendleft(reversed(self.behind))
            self.behind.clear()
            self._tags.clear()
