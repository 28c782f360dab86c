"""Versions, the staleness bound and admission (pacing) of a channel. No I/O.

Asynchronous RL: producers generate with the policy version they hold and tag each item
with it (``put(..., version=v)``); the trainer tells the channel its current version
(``advance``). Two mechanisms bound how old a trained item can be:

* **Staleness bound** (``max_staleness=k``, the safety net): an item whose version is
  older than ``current - k`` when it would be handed out is dropped and counted.
* **Pacing** (``max_staleness=k`` and ``batch_size=B``): a producer asks for admission
  before it starts a rollout (``async with ch.admit(v)``). The trainer consumes ``B``
  items per version from version 0, in put order, so it reaches version ``w`` only after
  ``w * B`` items were put. Admissions are granted while the items admitted so far stay
  below ``(m + k + 1) * B``, where ``m`` is the current version or, if lower, the oldest
  version of a rollout admitted and not put yet. Then a rollout made with version ``v``
  is consumed at version ``v + k`` at the latest: until it is put, fewer than ``(v + k +
  1) * B`` other items can exist, and every item admitted after its put queues behind
  it. (With only the current version in the limit, a slow rollout could be overtaken by
  faster ones admitted later, and arrive too old.) The grant tells the producer the
  current version: one that waited while the trainer moved on refreshes its weights to
  it before generating, and its rollout counts as made with it. An admission ends with
  the put made in its block (the item counts for good) or at the block's exit without a
  put (its place is freed).

:class:`Pacing` holds that state; the channel core (:mod:`rlinf.channel._core`) calls it
and sends what it returns. Everything here is arithmetic on plain values, unit-tested
without processes.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable

__all__ = ["Pacing", "Staleness", "admission_limit", "check_pacing", "HISTOGRAM_BUCKETS"]

#: Buckets of the per-consumer staleness histogram: 0, 1, ... versions behind; the last
#: one counts everything at least that far behind.
HISTOGRAM_BUCKETS = 16


def check_pacing(max_staleness: Any, batch_size: Any) -> tuple[int | None, int | None]:
    """Validate ``create_channel``'s ``max_staleness`` and ``batch_size``.

    Raises:
        TypeError: not None or an int. ValueError: ``max_staleness`` < 0, ``batch_size``
            < 1, or ``batch_size`` without ``max_staleness`` (pacing needs a bound).
    """
    for name, value, low in (("max_staleness", max_staleness, 0), ("batch_size", batch_size, 1)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be None or an int, got {type(value).__name__}")
        if not low <= value < 1 << 62:
            raise ValueError(f"{name} must be an int >= {low}, got {value}")
    if batch_size is not None and max_staleness is None:
        raise ValueError("batch_size (pacing) needs max_staleness: the bound that pacing keeps")
    return max_staleness, batch_size


def admission_limit(oldest: int, max_staleness: int, batch_size: int) -> int:
    """How many admissions may have been granted, at most, for one more to be granted
    while ``oldest`` is the trainer's current version or, if lower, the oldest version of
    a rollout in progress (admitted, not put): fewer than ``limit`` items can be put
    before that rollout's, so it is consumed at version ``limit // batch_size - 1 =
    oldest + max_staleness`` at the latest."""
    return (oldest + max_staleness + 1) * batch_size


class Staleness:
    """What one consumer got, by how many versions behind the current one it was when
    handed out: count, sum (for the mean), max and a histogram."""

    __slots__ = ("count", "total", "max", "histogram")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.max = 0
        self.histogram = [0] * HISTOGRAM_BUCKETS

    def add(self, behind: int) -> None:
        behind = max(behind, 0)      # an item newer than the trainer (it advanced late)
        self.count += 1
        self.total += behind
        if behind > self.max:
            self.max = behind
        self.histogram[min(behind, HISTOGRAM_BUCKETS - 1)] += 1

    def row(self) -> tuple[float | None, int | None, tuple[int, ...]]:
        """(mean, max, histogram without its trailing zeros); None before any item."""
        if not self.count:
            return None, None, ()
        hist = list(self.histogram)
        while hist and not hist[-1]:
            hist.pop()
        return self.total / self.count, self.max, tuple(hist)


class Pacing:
    """Current version, staleness bound and admissions of one channel.

    Args:
        max_staleness: drop items older than ``current - max_staleness`` (None: keep all).
        batch_size: items the trainer consumes per version; with it, admissions pace
            producers (None: ``admit`` grants at once).
        reply: ``reply(handle, rid, value)`` answers a handle's call (an admission).
    """

    def __init__(self, max_staleness: int | None, batch_size: int | None,
                 reply: Callable[[Any, int, Any], None]) -> None:
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.reply = reply
        self.current = 0
        self.admitted = 0                 # granted so far, less those that ended without a put
        self.open: dict[tuple[Any, int], int] = {}        # (handle, rid) -> version: granted, not ended
        self.waiting: collections.deque[tuple[Any, int, int]] = collections.deque()   # (handle, rid, version)
        self.closed = False
        self.versioned = False            # a versioned item was put: staleness is recorded
        self.stale_dropped = 0
        self.stale_by_key: dict[Hashable, int] = collections.defaultdict(int)

    @property
    def floor(self) -> int | None:
        """Items of a version below this are stale (None: no bound)."""
        return None if self.max_staleness is None else self.current - self.max_staleness

    def advance(self, version: int) -> int:
        """Set the current version (a lower one leaves it). Returns the current version.
        Admissions that now fit are granted."""
        if version > self.current:
            self.current = version
            self.grant()
        return self.current

    def handed(self, h: Any, items: list) -> None:
        """``items`` were handed to consumer ``h``: record how far behind they were."""
        current = self.current
        for item in items:
            if item.version is not None:
                if h.staleness is None:
                    h.staleness = Staleness()
                h.staleness.add(current - item.version)

    def dropped(self, key: Hashable) -> None:
        """A stale item of ``key`` was dropped."""
        self.stale_dropped += 1
        self.stale_by_key[key] += 1

    # -- admissions ------------------------------------------------------------------------
    def admit(self, h: Any, rid: int, version: int) -> None:
        """``h`` asks for admission ``rid`` for a rollout made with ``version``: granted
        now (answered with the current version) or queued; refused (answered None)
        once the channel is closed."""
        if self.closed:
            self.reply(h, rid, None)
            return
        self.waiting.append((h, rid, int(version)))
        self.grant()

    def close(self) -> None:
        """The channel closed: admissions still waiting are answered None (refused)."""
        self.closed = True
        while self.waiting:
            h, rid, _version = self.waiting.popleft()
            self.reply(h, rid, None)

    def grant(self) -> None:
        """Grant waiting admissions, oldest first, while they fit. A granted rollout
        counts as made with the current version if it asked with an older one (its
        producer refreshes its weights to the version the grant tells it)."""
        waiting = self.waiting
        while waiting:
            if self.batch_size is not None:
                oldest = min(self.current, *self.open.values()) if self.open else self.current
                if self.admitted >= admission_limit(oldest, self.max_staleness, self.batch_size):
                    return
            h, rid, version = waiting.popleft()
            self.admitted += 1
            self.open[(h, rid)] = max(version, self.current)
            self.reply(h, rid, self.current)

    def put(self, h: Any, version: Any, rid: int) -> int | None:
        """``h`` put an item of ``version`` (None: not versioned), made under its
        admission ``rid`` (0: none), which ends: the item counts for good. Returns the
        version.

        Raises:
            TypeError: a version that is not an int.
        """
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int):
                raise TypeError(f"bad version {version!r}")
            self.versioned = True
        if rid and self.open.pop((h, rid), None) is not None and self.waiting:
            self.grant()              # the oldest rollout out may be this one
        return version

    def release(self, h: Any, rid: int) -> None:
        """Admission ``rid`` of ``h`` ends: without a put it frees its place (one still
        waiting is withdrawn); after its put, nothing changes."""
        if self.open.pop((h, rid), None) is not None:
            self.admitted -= 1
            self.grant()
            return
        for i, (other, other_rid, _v) in enumerate(self.waiting):
            if other is h and other_rid == rid:
                del self.waiting[i]
                return

    def forget(self, h: Any) -> None:
        """``h`` left or died: its admissions end without puts; its waiting ones go."""
        mine = [key for key in self.open if key[0] is h]
        for key in mine:
            del self.open[key]
        self.admitted -= len(mine)
        self.waiting = collections.deque(w for w in self.waiting if w[0] is not h)
        if mine:
            self.grant()

    def stats(self) -> dict[str, Any]:
        """Channel-wide figures for :class:`~rlinf.channel.stats.ChannelStats`."""
        return {"version": self.current, "max_staleness": self.max_staleness, "batch_size": self.batch_size,
                "stale_dropped": self.stale_dropped, "admitted": self.admitted,
                "admissions_open": len(self.open), "admissions_waiting": len(self.waiting)}
