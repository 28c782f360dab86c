"""Balancing beyond one item at a time: work stealing, and placing items in batches. No I/O.

Functions of the channel core's state (:class:`rlinf.channel._core.ChannelCore`), kept
apart from its queues and accounting:

* :func:`steal`: a consumer with nothing to do takes the last item assigned to the
  consumer expected to finish last, when it would finish it sooner itself.
* :func:`place_shared`: with a *batch* policy (one that implements
  ``LoadBalancePolicy.assign_batch``, such as ``performance_aware``), the items of a
  run of puts wait in the shared queue (served FIFO to whoever asks) until every
  consumer of their key has a measured speed; then what waits there is placed at once,
  heaviest first, so a step is balanced from its first items on: no speed is guessed.
"""

from __future__ import annotations

import collections
from typing import Any

from ._state import Handle, insert_by_id

__all__ = ["steal", "speeds", "place_shared"]


def speeds(handles: list[Handle]) -> list[float]:
    """Measured speeds; the mean of the measured ones (else 1.0) for the others."""
    known = [h.meter.value for h in handles if h.meter.value]
    fallback = sum(known) / len(known) if known else 1.0
    return [h.meter.value or fallback for h in handles]


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


def place_shared(core: Any, key: Any) -> None:
    """Place the items of ``key`` waiting in the shared queue with the batch policy, once
    every consumer of ``key`` has a measured speed (until then they stay: consumers
    compete for them, and each one's first items measure it). Consumers that got items
    and wait for them are served."""
    members = core.consumers.get(key)
    shared = core.shared.get(key)
    if not shared or not members or not all(h.meter.value for h in members):
        return
    items = list(shared)
    choices = core.guard.select_batch([it.info() for it in items], [h.snapshot() for h in members])
    if choices is None:
        return                  # (counted and logged once by the guard) they stay shared
    shared.clear()
    for item, i in zip(items, choices):
        h = members[i]
        insert_by_id(h.assigned, key, item)
        h.add_pending(1, item.weight)
    for h in members:
        core._serve(h, key)
