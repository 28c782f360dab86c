"""Sending a consumer its next item just before it needs it. No I/O.

With a batch policy (``performance_aware``), a consumer at ``prefetch=0`` would pay a
round trip per item: it finishes an item, asks, waits for the answer. Items that take
about as long as that round trip (a fast consumer's, a few ms) lose a large share of its
time to it, and prefetching (``prefetch=1``) commits every consumer's next item long
before it is needed, which costs the end of a step its placement.

So the channel sends a consumer its next items (the oldest of those placed for it: one,
or as many as fit in :data:`AHEAD_SPAN` of its work, as each message costs the consumer
the time to read it, within :data:`AHEAD_MAX_ITEMS` and :data:`AHEAD_MAX_BYTES`) on its
own, *ahead*, when it expects the consumer to finish its current work within the time
they take to reach it: ``current end - AHEAD_LEAD``. They arrive as the consumer asks. A
consumer has one such group ahead per key at a time (the next is sent once it took them
all): its items are committed :data:`AHEAD_LEAD` before they are needed, not a whole
item's time as with ``prefetch=1``. The consumer's current end is estimated in the
channel's clock minus the one-way delay to the consumer (an answer sent at ``t`` is
started at ``t + d``; the next one must leave at that end ``- d``): an item sent as an
answer ends at ``t + weight / speed``; one sent ahead, at the previous end plus its own
time; when the consumer reports taking it (at ``t``), at ``t - round trip + weight /
speed``, the round trip measured on answered gets (the time between an answer and the
next get, less the work the consumer reported).

The handle's rule (mirrored by the client, :mod:`rlinf.channel._handle`): items sent
ahead answer, in order, the gets of their key waiting at the consumer when they arrive,
each as many as its ``get_batch`` rule takes of them (:func:`batch_len`; a ``get``, one;
the rest wait in its buffer for its next gets); the channel, receiving a ``get`` while
items are ahead at that consumer, takes it as answered by as many of the oldest of them.
Both hold because items are sent ahead only while no get of that consumer and key
waits in the channel: every get waiting at the consumer when they arrive was sent before
they arrived and is received after they were sent.

Nor are items sent ahead while an answer of that key to that consumer is not reported
taken (:func:`_push` holds them until its ``took``, or its return): the get it answered
may have been given up, and the answer then comes back (``unget``) after what went
ahead meanwhile, which the consumer would take first.

A ``get_batch`` that took every item ahead it had asks for the rest with a *top-up* get:
answered at once with what there is for it after them (:func:`top_up`), maybe nothing,
never left waiting, and never by items sent ahead. Its ``took`` of those leaves with the
answer's, once that is there: given up before, they stay at the consumer and ahead for
the channel (taken by its next gets, recalled, or given back if it detaches; those
recalled while it asked go back then). Other gets of that key at the consumer wait for
that answer before they ask: the channel would take one received meanwhile as answered
by the items the batch took.

Items sent ahead and not taken :data:`RECALL_GRACE` (or the consumer's current work's
time, if longer) after the consumer was expected to be done with its current work, while
another consumer of their key waits (or once one waits, if none did then), are recalled:
the consumer gives back those it has not taken yet (for the others its "took" is on its
way), and they are placed again. A consumer that stops calling ``get`` thus holds no
item that others wait for. This is work stealing (an item recalled may go to a consumer
that got newer ones), so only where stealing is on; without it, an item placed for a
consumer stays its own whether it was sent ahead or not.

Only under batch policies (the items are placed per consumer anyway; with ``fifo``
consumers compete for items only when idle), only for consumers at ``prefetch=0`` (with
``prefetch`` the consumer asks ahead itself), only without ``max_staleness`` (an item
ahead would escape the floor that ``advance`` raises: the consumer would take it stale),
only once the consumer's speed is known, and only an item already placed for it that
comes next in put order: the consumer still gets its items in put order.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from ._state import Handle

__all__ = ["AHEAD_LEAD", "AHEAD_SPAN", "AHEAD_MAX_ITEMS", "AHEAD_MAX_BYTES", "RECALL_GRACE", "GAP_DECAY", "Ahead",
           "sent", "on_get", "batch_len", "on_done", "on_took", "on_unget", "top_up", "resumed", "run_due",
           "next_due", "recall_overdue"]

#: Seconds before the consumer's expected end of its current item that its next item is
#: sent: what the estimate may be off by (timer resolution, scheduling on a busy machine).
AHEAD_LEAD = 0.002
#: Items sent ahead at once cover this many seconds of the consumer's work (at least
#: one item): a consumer whose items take a few ms is sent two or three per message, as
#: each message costs it the time to read it (a fraction of a ms in Python).
AHEAD_SPAN = 0.03
#: At most this many items, and this many payload bytes (past the first item), go ahead
#: at once: items of weight 0 (or cheap by the consumer's speed) would otherwise all go.
AHEAD_MAX_ITEMS = 64
AHEAD_MAX_BYTES = 8 << 20
#: Seconds past a consumer's expected end (at least its current item's time) after which
#: an item sent ahead and not taken is recalled, if another consumer waits for items.
RECALL_GRACE = 0.05
#: Weight of the previous round-trip estimate in the next (exponential average).
GAP_DECAY = 0.8

_seq = itertools.count()


class Ahead:
    """What the channel keeps per consumer for sending ahead (``Handle.ahead``)."""

    __slots__ = ("ids", "end", "work", "gap", "reply_at", "done_seconds", "recall_at", "held")

    def __init__(self) -> None:
        self.ids: dict[Any, list[int]] = {}   # key -> ids sent ahead, not yet taken (at most one)
        self.end = 0.0                        # expected end of its current work (channel clock - one way)
        self.work = 0.0                       # the expected seconds of its current work
        self.gap: float | None = None         # round trip: answer -> next get, less the work reported
        self.reply_at: float | None = None    # when its last get was answered (for the next gap sample)
        self.done_seconds: float | None = None   # the work it reported since
        self.recall_at: dict[Any, float] = {}    # key -> when the item ahead is overdue
        self.held: set = set()                   # keys whose send ahead waits for a "took" (_push)


def _state(h: Handle) -> Ahead:
    state = h.ahead
    if state is None:
        state = h.ahead = Ahead()
    return state


def _speed(h: Handle) -> float:
    return h.rate[0] / h.rate[1] if h.rate[1] > 0 else (h.hint or 0.0)


def _eligible(core: Any, h: Handle, key: Any) -> bool:
    """``h`` may be sent items of ``key`` ahead: a batch policy, ``prefetch=0``, a speed,
    no staleness bound (an item ahead would escape the floor raised by ``advance``)."""
    return (core.batching and key not in h.credit and _speed(h) > 0 and not h.dead and not h.lost
            and core.pacing.max_staleness is None)


def _schedule(core: Any, when: float, kind: str, h: Handle, key: Any) -> None:
    heapq.heappush(core.timers, (when, next(_seq), kind, h, key))


def sent(core: Any, h: Handle, key: Any, items: list, *, answer: bool) -> None:
    """``items`` were just sent to ``h`` (``answer``: to a get of its; else ahead): its
    expected end moves, and its next item is due to go ahead then, less the lead."""
    if not _eligible(core, h, key):
        return
    state = _state(h)
    now = core.clock()
    work = state.work = sum(it.weight for it in items) / _speed(h)
    if answer:
        state.reply_at, state.done_seconds = now, None
        state.end = now + work
    else:
        state.end = max(state.end, now) + work
    if answer:
        _schedule(core, state.end - AHEAD_LEAD, "push", h, key)


def on_get(core: Any, h: Handle, key: Any, max_items: int | None = 1, target: float | None = None) -> bool:
    """``h`` asks for items of ``key`` (a get: at most ``max_items``, None for no limit,
    within ``target``): True if items sent ahead answer it, the oldest, as many as the
    ``get_batch`` rule takes of them (:func:`batch_len`; see the module docs). Else a
    round-trip sample is taken, when its last answer is all it did."""
    state = h.ahead
    if state is None:
        return False
    ids = state.ids.get(key)
    if ids:
        inflight = h.inflight
        n = batch_len([inflight[i].weight if i in inflight else 0.0 for i in ids], max_items, target)
        item = inflight.get(ids[n - 1])
        del ids[:n]
        _no_recall(core, state, key)
        if not ids:
            del state.ids[key]
            if item is not None:
                _started(core, h, item)
        return True
    if state.reply_at is not None and state.done_seconds is not None and not h.inflight and not h.working:
        sample = max(core.clock() - state.reply_at - state.done_seconds, 0.0)
        state.gap = sample if state.gap is None else state.gap * GAP_DECAY + sample * (1 - GAP_DECAY)
        state.reply_at = None
    return False


def batch_len(weights: list[float], max_items: int | None, target: float | None) -> int:
    """How many of items weighing ``weights`` (not empty) one get takes by the
    ``get_batch`` rule: the first always, then while at most ``max_items`` (None or 0:
    no limit) and a total weight <= ``target`` (None: no limit). The channel and the
    client apply it alike to items sent ahead, for the gets that cross them."""
    n, total = 1, weights[0]
    while n < len(weights) and not (max_items and n >= max_items):
        if target is not None and total + weights[n] > target:
            break
        total += weights[n]
        n += 1
    return n


def on_done(h: Handle, seconds: float) -> None:
    """``h`` reported ``seconds`` of work (for the round-trip sample of its next get)."""
    state = h.ahead
    if state is not None and state.reply_at is not None:
        state.done_seconds = (state.done_seconds or 0.0) + seconds


def on_took(core: Any, h: Handle, items: list) -> None:
    """``h`` took ``items`` (still in flight): once it took all it had ahead, the next are
    due (:func:`_started`); once it took an answer that held them (:func:`_push`), too."""
    state = h.ahead
    if state is None or not (state.ids or state.held):
        return
    for item in items:
        ids = state.ids.get(item.key)
        if ids and item.id in ids:
            ids.remove(item.id)
            _no_recall(core, state, item.key)
            if not ids:
                del state.ids[item.key]
                _started(core, h, item)
        elif item.key in state.held:
            _release(core, h, state, item.key)


def _release(core: Any, h: Handle, state: Ahead, key: Any) -> None:
    """An answer of ``key`` that held sending ahead (:func:`_push`) was taken or came back:
    the next items are due at the expected end (``_push`` checks again)."""
    state.held.discard(key)
    if _eligible(core, h, key):
        _schedule(core, max(core.clock(), state.end - AHEAD_LEAD), "push", h, key)


def _started(core: Any, h: Handle, item: Any) -> None:
    """``h`` reported (a get or a "took") starting ``item``, the last it had ahead: it
    started it about a round trip ago; its next items are due at its expected end."""
    if _eligible(core, h, item.key):
        state = h.ahead
        state.end = core.clock() - (state.gap or 0.0) + item.weight / _speed(h)
        _schedule(core, state.end - AHEAD_LEAD, "push", h, item.key)


def on_unget(core: Any, h: Handle, items: list) -> None:
    """``items`` of ``h``'s came back (recalled, given back by an abandoned get, or its
    handle detaches); already out of flight."""
    state = h.ahead
    if state is None or not (state.ids or state.held):
        return
    for item in items:
        key = item.key
        ids = state.ids.get(key)
        if ids and item.id in ids:
            ids.remove(item.id)
            _no_recall(core, state, key)
            if not ids:
                del state.ids[key]
        elif key in state.held:
            _release(core, h, state, key)


def _no_recall(core: Any, state: Ahead, key: Any) -> None:
    """No recall of ``key`` is due at this consumer any more (see ``core.recalls``)."""
    if state.recall_at.pop(key, None) is not None:
        left = core.recalls.get(key, 0) - 1
        if left > 0:
            core.recalls[key] = left
        else:
            core.recalls.pop(key, None)


def top_up(core: Any, h: Handle, rid: int, key: Any, max_items: int | None, target: float | None) -> None:
    """Answer ``h``'s get ``rid`` at once with what is there for it now, maybe nothing:
    it is the rest of a ``get_batch`` that took every item sent ahead that it had (they
    stay ahead until its ``took`` of them, with this answer's), which must not wait."""
    items = core._collect(h, key, max_items or 0, target)
    core.send(h, ("items", rid, key, [(it.id, it.weight, it.payload) for it in items]))
    if items:
        sent(core, h, key, items, answer=True)
        core._grant()


def resumed(core: Any, h: Handle) -> None:
    """``h``, taken for lost, is back: the items it has ahead count among the recalls due
    again (:func:`recall_overdue` dropped it from ``core.recalls`` while it was away), and
    those overdue are recalled now if another consumer waits."""
    state = h.ahead
    if state is None:
        return
    now = core.clock()
    for key in list(state.recall_at):
        core.recalls[key] = sum(1 for m in core.consumers.get(key, ())
                                if m.ahead is not None and key in m.ahead.recall_at)
        recall_overdue(core, key, now)


def next_due(core: Any) -> float | None:
    """When :func:`run_due` has something to do next (channel clock), or None."""
    return core.timers[0][0] if core.timers else None


def run_due(core: Any) -> None:
    """Send ahead and recall what is due by now."""
    timers = core.timers
    now = core.clock()
    while timers and timers[0][0] <= now:
        _when, _seq_no, kind, h, key = heapq.heappop(timers)
        if kind == "push":
            _push(core, h, key, now)
        else:
            recall_overdue(core, key, now)


def _push(core: Any, h: Handle, key: Any, now: float) -> None:
    """Send ``h`` its next item of ``key`` ahead, if it is still at work, asks nothing
    (a waiting get is answered the usual way), has none ahead and the item that comes
    next in put order was placed for it."""
    state = h.ahead
    if state is None or not _eligible(core, h, key) or state.ids.get(key) or h.requests.get(key):
        return
    if not (h.inflight or h.working):
        return                           # idle, and not asking: it does not want items now
    mine, shared = h.assigned.get(key), core.shared.get(key)
    if not mine or (shared and shared[0].id < mine[0].id):
        return                           # its next item is not placed for it (yet)
    if any(it.key == key for it in h.inflight.values()):
        # An answer of this key not reported taken yet: its get may have been given up,
        # and the answer come back (unget) after items sent ahead now, which the consumer
        # would then take first. Held until it reports taking it (or it comes back).
        state.held.add(key)
        return
    speed, items, work, nbytes = _speed(h), [], 0.0, 0
    while not items or (work < AHEAD_SPAN and len(items) < AHEAD_MAX_ITEMS):
        mine, shared = h.assigned.get(key), core.shared.get(key)
        if not mine or (shared and shared[0].id < mine[0].id) or (items and (
                work + mine[0].weight / speed > AHEAD_SPAN or nbytes + mine[0].nbytes > AHEAD_MAX_BYTES)):
            break
        got = core._collect(h, key, 1, None)
        if not got:
            break
        items += got
        work += got[0].weight / speed
        nbytes += got[0].nbytes
    if not items:
        return
    state.ids.setdefault(key, []).extend(it.id for it in items)
    core.send(h, ("ahead", key, [(it.id, it.weight, it.payload) for it in items]))
    deadline = state.end + max(RECALL_GRACE, state.work)
    sent(core, h, key, items, answer=False)
    if key not in state.recall_at:
        core.recalls[key] = core.recalls.get(key, 0) + 1
    state.recall_at[key] = deadline
    _schedule(core, deadline, "recall", h, key)
    core._grant()          # the queue has room again: a producer held by maxsize may put


def recall_overdue(core: Any, key: Any, now: float) -> None:
    """With work stealing: recall the items of ``key`` sent ahead and overdue (their
    consumer still on its previous one past its deadline), if a consumer of ``key`` waits.
    Run when such a deadline passes and when a consumer starts to wait (the deadline may
    have passed while none waited: ``core.recalls`` counts those pending per key)."""
    members = core.consumers.get(key, ())
    if not core.work_stealing or not any(m.wants(key) and not m.dead and not m.lost for m in members):
        return
    pending = 0
    for m in members:
        state = m.ahead
        deadline = state.recall_at.get(key) if state is not None else None
        if deadline is None:
            continue
        if deadline <= now and state.ids.get(key):
            _no_recall(core, state, key)
            core.send(m, ("recall", key, list(state.ids[key])))
        else:
            pending += 1
    if pending:                  # (counted again: a consumer that left kept none)
        core.recalls[key] = pending
    else:
        core.recalls.pop(key, None)
