"""Balancing beyond one item at a time: work stealing, and placing items in batches. No I/O.

Functions of the channel core's state (:class:`rlinf.channel._core.ChannelCore`), kept
apart from its queues and accounting:

* :func:`steal`: a consumer with nothing to do takes the last item assigned to the
  consumer expected to finish last, when it would finish it sooner itself.
* :func:`place_shared`: with a *batch* policy (one that implements
  ``LoadBalancePolicy.assign_batch``, such as ``performance_aware``), the items of a
  run of puts wait in the shared queue (served FIFO to whoever asks) until every
  consumer of their key has a measured (or declared: ``comm.channel(name, speed=...)``)
  speed; then what waits there is placed at once,
  heaviest first, so a step is balanced from its first items on: no speed is guessed.
  While a consumer's speed estimate still moves (by more than 10%: it rests on a few
  items), what is placed and not sent yet is placed again (:func:`speed_changed`); an
  item placed again goes only to a consumer that was sent nothing newer, so each
  consumer still gets its items in put order.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from ._state import Handle, insert_by_id

__all__ = ["steal", "speeds", "place_shared", "speed_changed", "REPLACE_CHANGE", "REPLACE_TAIL", "REPLACE_MAX",
           "RATE_DECAY"]


def speeds(handles: list[Handle]) -> list[float]:
    """Measured speeds (else declared ones); the mean of those (else 1.0) for the others."""
    known = [h.meter.value or h.hint for h in handles if h.meter.value or h.hint]
    fallback = sum(known) / len(known) if known else 1.0
    return [h.meter.value or h.hint or fallback for h in handles]


def steal(core: Any, h: Handle, key: Any) -> bool:
    """``h`` has nothing to do: move to it the last item (not yet sent) of the consumer of
    ``key`` expected to finish last, if ``h`` would finish that item sooner. Returns
    whether it did."""
    victims = [v for v in core.consumers.get(key, ()) if v is not h and v.assigned.get(key)]
    if not victims:
        return False
    measured = speeds([h, *victims])
    ends = [v.pending_weight / measured[i + 1] for i, v in enumerate(victims)]
    best = max(range(len(victims)), key=lambda i: ends[i])
    victim = victims[best]
    item = victim.assigned[key][-1]
    if (h.pending_weight + item.weight) / measured[0] >= ends[best]:
        return False   # it would not finish sooner here
    victim.assigned[key].pop()
    victim.add_pending(-1, -item.weight)
    h.assigned.setdefault(key, collections.deque()).append(item)
    h.add_pending(1, item.weight)
    core.requeued += 1
    return True


#: A consumer's speed estimate moved by more than this share since the items waiting for
#: it were placed: they are placed again (early estimates rest on a few items).
REPLACE_CHANGE = 0.1
#: At the end of a backlog (at most this many items placed and not sent), what waits is
#: placed again on every report: with what each consumer has left of its work, so the
#: last items go where they end soonest (items that take longer or shorter than their
#: weight says, on a loaded machine, are made up for while there is still time).
REPLACE_TAIL = 64
#: ... unless more than this many items are placed and not sent (placing again costs the
#: channel process time per item; stealing still repairs the end of a long backlog).
REPLACE_MAX = 4096
#: The batch placement's speed estimate: total weight over total seconds of a consumer's
#: reports, each older report counting this much less. A ratio of sums weighs each item
#: by its size (a rate, not an average of per-item rates) and settles after a few items,
#: where noise in short items would keep an average of samples moving.
RATE_DECAY = 0.95


def place_shared(core: Any, key: Any, again: bool = False) -> None:
    """Place the items of ``key`` waiting in the shared queue with the batch policy, once
    every consumer of ``key`` has a measured speed (until then they stay: consumers
    compete for them, and each one's first items measure it); ``again``: the items
    placed before and not sent yet too, each only among the consumers that were sent
    nothing newer (per-consumer put order is kept). Consumers that got items and wait
    are served."""
    members = core.consumers.get(key)
    if not members or not all(h.rate[1] > 0 or h.hint for h in members):
        return
    items = list(core.shared.pop(key, ()))
    kept = None
    if again and sum(len(h.assigned.get(key, ())) for h in members) <= REPLACE_MAX:
        # what each had (restored below unless placing again ends sooner, by the estimates)
        kept = (_makespan(members, core.clock()), [list(h.assigned.get(key, ())) for h in members]) \
            if not items else None
        for h in members:
            mine = h.assigned.pop(key, ())
            h.add_pending(-len(mine), -sum(it.weight for it in mine))
            items.extend(mine)
        items.sort(key=lambda it: it.id)
    if not items:
        return
    placed = True
    for group, among in _eligible(key, items, members):
        now = core.clock()
        choices = placed and core.guard.select_batch([it.info() for it in group],
                                                     [_ahead(members[i], now) for i in among])
        if not choices:         # (counted and logged once by the guard) they wait shared
            placed = False
            for item in group:
                insert_by_id(core.shared, key, item)
            continue
        for item, i in zip(group, choices):
            h = members[among[i]]
            insert_by_id(h.assigned, key, item)
            h.add_pending(1, item.weight)
    if kept is not None and placed and _makespan(members, core.clock()) >= kept[0] - 1e-9:
        for h, old in zip(members, kept[1]):    # not sooner: the placement stays as it was
            mine = h.assigned.pop(key, ())
            h.add_pending(len(old) - len(mine), sum(it.weight for it in old) - sum(it.weight for it in mine))
            if old:
                h.assigned[key] = collections.deque(old)
    for h in members:           # (placement failed: those that wait compete for the shared queue)
        if placed:
            h.placed_speed = _speed(h)
        core._serve(h, key)


def _makespan(members: list[Handle], now: float) -> float:
    """When the last of ``members`` is expected to be done with what it has (:func:`_ahead`)."""
    ends = [info.pending_weight / info.speed for info in (_ahead(h, now) for h in members) if info.speed]
    return max(ends, default=0.0)


def _eligible(key: Any, items: list, members: list[Handle]) -> list[tuple[list, list[int]]]:
    """``items`` (in id order) in runs that the same members may get, oldest first: an
    item goes only to a member that was sent nothing newer of ``key`` (one that no
    member may get, returned after a consumer left, goes to any)."""
    sent = [h.last_sent.get(key, 0) for h in members]
    everyone = list(range(len(members)))
    runs: list[tuple[list, list[int]]] = []
    for item in items:
        among = [i for i in everyone if sent[i] < item.id] or everyone
        if runs and runs[-1][1] == among:
            runs[-1][0].append(item)
        else:
            runs.append(([item], among))
    return runs


def speed_changed(core: Any, h: Handle, weight: float, seconds: float) -> None:
    """``h`` reported ``weight`` done in ``seconds``: on its first speed, place what waits
    for it; on a speed that moved by more than :data:`REPLACE_CHANGE`, or while at most
    :data:`REPLACE_TAIL` items wait placed, place again what is not sent."""
    if weight <= 0 or seconds <= 0:
        return
    rate = h.rate
    rate[0] = rate[0] * RATE_DECAY + weight
    rate[1] = rate[1] * RATE_DECAY + seconds
    speed, placed = rate[0] / rate[1], h.placed_speed
    moved = not placed or abs(speed - placed) > REPLACE_CHANGE * placed
    for key in list(h.keys):
        if moved or sum(len(m.assigned.get(key, ())) for m in core.consumers.get(key, ())) <= REPLACE_TAIL:
            place_shared(core, key, again=placed is not None)


def _speed(h: Handle) -> float:
    """The batch placement's speed of ``h``: measured (:data:`RATE_DECAY`), else declared."""
    return h.rate[0] / h.rate[1] if h.rate[1] > 0 else h.hint


def _ahead(h: Handle, now: float) -> Any:
    """``h``'s snapshot with its speed as the batch placement estimates it (:data:`RATE_DECAY`)
    and the work it has started counted as what is left of it: pending weight less what
    its speed has done since its last items were sent."""
    info = h.snapshot()
    speed = _speed(h)
    started = sum(it.weight for it in h.inflight.values()) + sum(it.weight for it in h.working.values())
    done = min(started, speed * max(now - h.sent_at, 0.0)) if started else 0.0
    return dataclasses.replace(info, pending_weight=max(info.pending_weight - done, 0.0), speed=speed)
