"""A channel client whose worker was taken for lost: suspended while it may come back,
forgotten when it does not (what the channel core does then;
``core`` below is its :class:`~rlinf.channel._core.ChannelCore`, which imports this).

A suspended handle gets nothing new; what was sent to it stays its own (it may reach its
application once it is back: given to another consumer, it would be delivered twice).
A forgotten one's items go back to the queue, and if it sends again it is told, so that
it fails instead of waiting for answers that never come.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _ahead
from ._state import Handle

__all__ = ["FORGOTTEN_KEPT", "suspend", "resume", "expire", "tell_forgotten"]

log = logging.getLogger("rlinf.channel")

#: Handles forgotten while taken for lost that are remembered (to tell them, if they
#: come back, that they were forgotten and how many of their puts were applied).
FORGOTTEN_KEPT = 4096


def suspend(core: Any, src: str, incarnation: str) -> list[Handle]:
    """``src`` (that incarnation) was taken for lost but may come back: its handles
    get nothing new, and what was assigned to them and not sent goes back; what was
    sent to them (it may reach them, and their application, once they are back) and
    what they work on stays theirs until they are back (their next op) or forgotten
    (:func:`expire`). Returns the handles suspended."""
    suspended = []
    for (s, _), h in list(core.handles.items()):
        if s != src or h.lost or (incarnation and h.incarnation != incarnation):
            continue
        h.lost = True
        h.suspensions += 1
        suspended.append(h)
        back = core.unassign(h, pending=True)
        core.leave_keys(h)
        back.sort(key=lambda it: it.id)
        core._requeue(back)
    return suspended


def resume(core: Any, h: Handle) -> None:
    """``h``, suspended, is back: it competes for items again."""
    h.lost = False
    for key in h.keys:
        members = core.consumers.setdefault(key, [])
        if h not in members:
            members.append(h)
    _ahead.resumed(core, h)      # its items ahead may be recalled again
    for key in list(h.keys):
        if h.wants(key):
            core._serve(h, key)
    core.pacing.grant()          # its admissions waited while it was away


def expire(core: Any, h: Handle) -> None:
    """``h`` stayed suspended too long: forget it (its items go back)."""
    if h.lost and not h.dead:
        core.remove(h, forgotten=True)
        core._grant()


def tell_forgotten(core: Any, src: str, hid: int, kind: str) -> None:
    """Ops came from a handle this channel does not know: it was forgotten while
    taken for lost (or never said hello). Tell it, so that it fails instead of
    waiting for answers that never come; nothing of what it sent is applied."""
    h = core.forgotten.get((src, hid))
    if h is None:
        log.warning("channel %s: op %r from %s for unknown channel handle %d", core.name, kind, src, hid)
        h = Handle(src, hid, "", "", "", 0.0)
        h.puts = -1     # unknown
    core.send(h, ("forgotten", h.puts + h.rejected if h.puts >= 0 else -1))
