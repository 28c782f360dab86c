"""Versions, the staleness bound and admission (pacing) of a channel. No I/O.

Asynchronous RL: producers generate with the policy version they hold and tag each item
with it (``put(..., version=v)``); the trainer tells the channel its current version
(``advance``). Two mechanisms bound how old a trained item can be:

* **Staleness bound** (``max_staleness=k``, the safety net): an item whose version is
  older than ``current - k`` when it would be handed out is dropped and counted.
* **Pacing** (``max_staleness=k`` and ``batch_size=B``): a producer asks for admission
  before it starts a rollout (``async with ch.admit(v)``, or ``admit(v, n=G)`` for a
  group of ``G`` items). The trainer consumes ``B`` items per version, in put order, so
  if ``b`` admitted items had been handed out when version ``m`` began, the one handed
  out ``(k + 1) * B`` later is the last it gets at version ``m + k``. Places are granted
  while the places taken (granted, less those given back unused and the admitted items
  dropped as stale) stay within ``b + (k + 1) * B``, with ``b`` counted when the current
  version began or, if earlier, when the oldest admission still open was granted. Then a
  rollout made with version ``v`` is consumed at version ``v + k`` at the latest: until
  it is put, at most ``b + (k + 1) * B`` places can be taken, and every item admitted
  after its put queues behind it. (With only the current version in the limit, a slow
  rollout could be overtaken by faster ones admitted later, and arrive too old.)
  Counting what was handed out, not versions times ``B``, keeps the limit right when
  items are dropped, when the trainer takes more or fewer than ``B`` items per version,
  and when it resumes at a later version. The grant tells the producer the current
  version: one that waited while the trainer moved on refreshes its weights to it before
  generating, and its rollout counts as made with it. An admission ends once each of its
  places was put (the items count for good) or at the block's exit (its places not put
  are freed).

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


def admission_limit(base: int, max_staleness: int, batch_size: int) -> int:
    """How many places may be taken, at most, while ``base`` admitted items had been
    handed out when the version that a rollout is made with began: that rollout is then
    at most the ``limit``-th admitted item handed out, which a trainer consuming
    ``batch_size`` items per version gets ``max_staleness`` versions later at the latest."""
    return base + (max_staleness + 1) * batch_size


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
        # places granted so far, less those given back unused and admitted items dropped
        self.admitted = 0
        self.handed_out = 0               # admitted items handed out (each once)
        self.base = 0                     # handed_out when the current version began
        # (handle, rid) -> [version made with, base at the grant, places not put yet]
        self.open: dict[tuple[Any, int], list[int]] = {}
        self.waiting: collections.deque[tuple[Any, int, int, int]] = collections.deque()   # (handle, rid, version, n)
        self.closed = False
        self.versioned = False            # a versioned item was put: staleness is recorded
        self.stale_dropped = 0
        self.stale_by_key: dict[Hashable, int] = collections.defaultdict(int)

    @property
    def floor(self) -> int | None:
        """Items of a version below this are stale (None: no bound)."""
        return None if self.max_staleness is None else self.current - self.max_staleness

    @property
    def span(self) -> int | None:
        """Places one version's window holds, ``(k + 1) * B`` (None: no pacing)."""
        return None if self.batch_size is None else (self.max_staleness + 1) * self.batch_size

    def advance(self, version: int) -> int:
        """Set the current version (a lower one leaves it). Returns the current version.
        Admissions that now fit are granted."""
        if version > self.current:
            self.current = version
            self.base = self.handed_out
            self.grant()
        return self.current

    def handed(self, h: Any, items: list) -> None:
        """``items`` were handed to consumer ``h``: record how far behind they were, and
        count the admitted ones. An item handed out again (given back by a consumer that
        left) counts once, where it was first handed out."""
        current = self.current
        for item in items:
            if item.handed:
                continue
            item.handed = True
            if item.paced:
                self.handed_out += 1
            if item.version is not None:
                if h.staleness is None:
                    h.staleness = Staleness()
                h.staleness.add(current - item.version)

    def dropped(self, item: Any) -> None:
        """A stale ``item`` was dropped: counted; an admitted one gives its place back
        (it will never be consumed, so it must not hold the trainer's next items back)."""
        self.stale_dropped += 1
        self.stale_by_key[item.key] += 1
        if item.paced and not item.handed:
            self.admitted -= 1
            self.grant()

    # -- admissions ------------------------------------------------------------------------
    def admit(self, h: Any, rid: int, version: int, n: int = 1) -> None:
        """``h`` asks for admission ``rid`` of ``n`` items made with ``version``: granted
        now (answered with the current version) or queued; refused (answered None)
        once the channel is closed."""
        if self.closed:
            self.reply(h, rid, None)
            return
        n = max(1, int(n))
        if self.span is not None:
            n = min(n, self.span)         # (the client refuses more: it could never fit)
        self.waiting.append((h, rid, int(version), n))
        self.grant()

    def close(self) -> None:
        """The channel closed: admissions still waiting are answered None (refused)."""
        self.closed = True
        while self.waiting:
            h, rid, _version, _n = self.waiting.popleft()
            self.reply(h, rid, None)

    def limit(self) -> int:
        """Places that may be taken, at most: ``(k + 1) * B`` beyond the admitted items
        handed out when the current version began or, if earlier, when the oldest
        admission still open was granted (see the module docs)."""
        base = min(self.base, *(entry[1] for entry in self.open.values())) if self.open else self.base
        return admission_limit(base, self.max_staleness, self.batch_size)

    def grant(self) -> None:
        """Grant waiting admissions, oldest first, while they fit; those of a handle
        taken for lost wait until it is back. A granted rollout counts as made with the
        current version if it asked with an older one (its producer refreshes its
        weights to the version the grant tells it)."""
        waiting = self.waiting
        lost = []
        while waiting:
            h, rid, version, n = waiting[0]
            if getattr(h, "lost", False):
                lost.append(waiting.popleft())
                continue
            if self.batch_size is not None and self.admitted + n > self.limit():
                break
            waiting.popleft()
            self.admitted += n
            self.open[(h, rid)] = [max(version, self.current), self.base, n]
            self.reply(h, rid, self.current)
        waiting.extendleft(reversed(lost))

    def put(self, h: Any, version: Any, rid: int) -> tuple[int | None, bool]:
        """``h`` put an item of ``version`` (None: not versioned), made under its
        admission ``rid`` (0: none), which ends once all its places are put: the item
        counts for good. Returns the version, and whether the item took an admission's
        place.

        Raises:
            TypeError: a version that is not an int.
        """
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int):
                raise TypeError(f"bad version {version!r}")
            self.versioned = True
        entry = self.open.get((h, rid)) if rid else None
        if entry is None:
            return version, False
        entry[2] -= 1
        if entry[2] <= 0:
            del self.open[(h, rid)]
            if self.waiting:
                self.grant()              # the oldest admission out may be this one
        return version, True

    def release(self, h: Any, rid: int) -> None:
        """Admission ``rid`` of ``h`` ends: its places not put are freed (one still
        waiting is withdrawn); after all its puts, nothing changes."""
        entry = self.open.pop((h, rid), None)
        if entry is not None:
            self.admitted -= entry[2]
            self.grant()
            return
        for i, (other, other_rid, _v, _n) in enumerate(self.waiting):
            if other is h and other_rid == rid:
                del self.waiting[i]
                return

    def forget(self, h: Any) -> None:
        """``h`` left or died: its admissions end without more puts; its waiting ones go."""
        mine = [key for key in self.open if key[0] is h]
        for key in mine:
            self.admitted -= self.open.pop(key)[2]
        self.waiting = collections.deque(w for w in self.waiting if w[0] is not h)
        if mine:
            self.grant()

    def stats(self) -> dict[str, Any]:
        """Channel-wide figures for :class:`~rlinf.channel.stats.ChannelStats`."""
        return {"version": self.current, "max_staleness": self.max_staleness, "batch_size": self.batch_size,
                "stale_dropped": self.stale_dropped, "admitted": self.admitted,
                "admissions_open": len(self.open), "admissions_waiting": len(self.waiting)}
