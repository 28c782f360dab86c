"""``channel.stats()``: a frozen snapshot of one channel, readable when printed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ChannelStats", "ConsumerStats", "KeyStats"]


@dataclass(frozen=True, slots=True)
class KeyStats:
    """One sub-queue: items waiting in the channel (not yet handed to a consumer).

    Attributes:
        key: the sub-queue's key (``None`` is the default sub-queue).
        length: items waiting, including items already assigned to a consumer.
        weight: their total weight.
        stale_dropped: items of this key dropped as older than ``max_staleness``
            (while the key is known: see ``ChannelStats.keys``).
    """

    key: Any
    length: int
    weight: float
    stale_dropped: int = 0


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    """One consumer as the channel server sees it.

    Attributes:
        name: the consumer's name (its worker address; ``address#n`` for a second
            handle in the same worker).
        node_id: the consumer's node.
        pending_count, pending_weight: items assigned to it and not finished: waiting in
            the channel for it, on their way to it (prefetched included), or handed out
            and not finished yet (finished = its next ``get``, or ``task_done`` with acks).
        unacked: items it holds under ``ack=True`` that were not ``task_done`` yet.
        consumed_count, consumed_weight: items it finished.
        speed: measured processing speed (weight per second, an EWMA), None until measured.
        busy_fraction: share of the last 10 s (or of its life, if shorter) it spent
            processing items, in [0, 1].
        free_device_memory: bytes free on its GPU as last reported, or None.
        waiting: True while it has a ``get`` outstanding (or prefetch credit).
        staleness_mean, staleness_max: how many versions behind the channel's current
            version the versioned items handed to it were (when handed out), on average
            and at most; None before it got one.
        staleness_histogram: items handed to it by versions behind: index ``i`` counts
            those ``i`` versions behind (the last of 16 buckets: 15 or more); trailing
            zeros are left out.
    """

    name: str
    node_id: str
    pending_count: int
    pending_weight: float
    unacked: int
    consumed_count: int
    consumed_weight: float
    speed: float | None
    busy_fraction: float
    free_device_memory: int | None
    waiting: bool
    staleness_mean: float | None = None
    staleness_max: int | None = None
    staleness_histogram: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """A snapshot of a channel (``await channel.stats()``).

    Attributes:
        name, policy, maxsize: the channel's configuration (maxsize 0: unbounded).
        closed: ``close()`` was called (no more puts).
        length, weight: items waiting in the channel (all keys), and their total weight.
        keys: per sub-queue length and weight (sub-queues that hold items, or did
            lately: the state of keys under which nothing is queued, in flight or awaited
            is dropped from time to time).
        consumers: every live consumer, in the order they joined.
        producers: handles that have put at least one item and are still attached.
        put_count, get_count: items accepted / handed to consumers since the start (an
            item handed out, put back and handed out again counts twice in
            ``get_count``, ``get_rate`` and ``bytes_out``; ``requeued`` counts the returns).
        requeued: items put back in the queue (consumer died or detached, cancelled get,
            stolen by work stealing).
        rejected: puts refused because the channel was closed.
        policy_errors: calls of the load-balancing policy that raised or returned a bad
            value (the item then went to the shared queue); only the first is logged.
        put_rate, get_rate: items per second over the last 5 s.
        bytes_in, bytes_out: payload bytes accepted / handed out.
        uptime: seconds since the channel started.
        version: the current policy version (``advance``; 0 until the first).
        max_staleness, batch_size: the staleness bound and pacing configuration (None:
            off).
        stale_dropped: items dropped as older than ``version - max_staleness``.
        admitted: places taken by admissions (``admit(v, n=G)`` takes ``G``): granted,
            less the places freed unused at a block's exit and the admitted items
            dropped as stale; with pacing at most ``(max_staleness + 1) * batch_size``
            beyond the admitted items handed out when the current version began.
        admissions_open: admissions granted whose block has not put all its places
            or exited yet.
        admissions_waiting: producers waiting in ``admit``.
    """

    name: str
    policy: str
    maxsize: int
    closed: bool
    length: int
    weight: float
    keys: tuple[KeyStats, ...]
    consumers: tuple[ConsumerStats, ...]
    producers: int
    put_count: int
    get_count: int
    requeued: int
    rejected: int
    policy_errors: int
    put_rate: float
    get_rate: float
    bytes_in: int
    bytes_out: int
    uptime: float
    version: int = 0
    max_staleness: int | None = None
    batch_size: int | None = None
    stale_dropped: int = 0
    admitted: int = 0
    admissions_open: int = 0
    admissions_waiting: int = 0

    def consumer(self, name: str) -> ConsumerStats:
        """The consumer called ``name``.

        Raises:
            KeyError: no live consumer has that name.
        """
        for c in self.consumers:
            if c.name == name:
                return c
        raise KeyError(name)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChannelStats:
        """Build from plain values: the server's reply (keys and consumers as positional
        rows) or :meth:`to_dict`'s output (as dicts)."""
        keys = tuple(_row(KeyStats, k) for k in d["keys"])
        consumers = tuple(_row(ConsumerStats, c) for c in d["consumers"])
        fields = {k: v for k, v in d.items() if k not in ("keys", "consumers")}
        return cls(keys=keys, consumers=consumers, **fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain values with named fields (keys and consumers as dicts); what a channel
        server reports with its heartbeats and ``rlinf top --once --json`` prints."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["keys"] = [dataclasses.asdict(k) for k in self.keys]
        out["consumers"] = [dataclasses.asdict(c) for c in self.consumers]
        return out

    def __str__(self) -> str:
        state = "closed" if self.closed else "open"
        size = f"maxsize={self.maxsize}" if self.maxsize else "unbounded"
        lines = [
            f"Channel {self.name!r} ({state}, policy={self.policy}, {size}, up {self.uptime:.1f} s)",
            f"  queued {self.length} items, weight {self.weight:.6g}; producers {self.producers}; "
            f"put {self.put_count} ({self.put_rate:.1f}/s), got {self.get_count} ({self.get_rate:.1f}/s); "
            f"requeued {self.requeued}, rejected {self.rejected}"
            f"{f', policy errors {self.policy_errors}' if self.policy_errors else ''}; "
            f"bytes in {_bytes(self.bytes_in)}, out {_bytes(self.bytes_out)}",
        ]
        if self.max_staleness is not None or self.version or self.stale_dropped:
            paced = f", batch_size={self.batch_size}" if self.batch_size is not None else ""
            lines.append(f"  version {self.version} (max_staleness={self.max_staleness}{paced}); "
                         f"stale dropped {self.stale_dropped}; admitted {self.admitted} "
                         f"({self.admissions_open} open, {self.admissions_waiting} waiting)")
        for k in self.keys:
            stale = f"  stale dropped {k.stale_dropped}" if k.stale_dropped else ""
            lines.append(f"  key {k.key!r:<16} {k.length:>7} items  weight {k.weight:.6g}{stale}")
        if self.consumers:
            lines.append(f"  {'consumer':<22}{'pending':>9}{'p.weight':>10}{'unacked':>8}{'done':>8}"
                         f"{'d.weight':>10}{'speed':>9}{'busy':>6}  mem free")
        for c in self.consumers:
            speed = f"{c.speed:.3g}" if c.speed is not None else "-"
            mem = _bytes(c.free_device_memory) if c.free_device_memory is not None else "-"
            wait = " (waiting)" if c.waiting else ""
            stale = (f"  staleness mean {c.staleness_mean:.2f} max {c.staleness_max} "
                     f"by versions behind {list(c.staleness_histogram)}" if c.staleness_max is not None else "")
            lines.append(f"  {c.name:<22}{c.pending_count:>9}{c.pending_weight:>10.4g}{c.unacked:>8}"
                         f"{c.consumed_count:>8}{c.consumed_weight:>10.4g}{speed:>9}"
                         f"{c.busy_fraction:>6.0%}  {mem}{wait}{stale}")
        return "\n".join(lines)


def _row(cls: type, row: Any) -> Any:
    return cls(**row) if isinstance(row, dict) else cls(*row)


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
