"""The plain-value snapshot of a channel core (``stats()``), and its rate counters. No I/O.

Kept apart from :mod:`rlinf.channel._core` (the state machine) because it only reads it.
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["RATE_WINDOW", "count_rate", "snapshot"]

#: Seconds over which ``put_rate`` / ``get_rate`` are averaged.
RATE_WINDOW = 5


def count_rate(rates: collections.deque, second: int, column: int, n: int) -> None:
    """Count ``n`` puts (``column`` 0) or gets (1) in ``second``; ``rates`` holds
    ``[second, puts, gets]`` rows of the last :data:`RATE_WINDOW` seconds."""
    if not rates or rates[-1][0] != second:
        rates.append([second, 0, 0])
        while rates[0][0] <= second - RATE_WINDOW:
            rates.popleft()
    rates[-1][column + 1] += n


def snapshot(core: Any) -> dict[str, Any]:
    """A plain-value snapshot of ``core`` (a :class:`~rlinf.channel._core.ChannelCore`;
    see :class:`~rlinf.channel.stats.ChannelStats`)."""
    now = core.clock()
    uptime = now - core.started
    recent = [r for r in core._rates if r[0] > int(now) - RATE_WINDOW]
    span = min(float(RATE_WINDOW), max(uptime, 1.0))
    consumers, seen = [], set()
    for members in core.consumers.values():
        for h in members:
            if h in seen:
                continue
            seen.add(h)
            staleness = h.staleness.row() if h.staleness is not None else (None, None, ())
            consumers.append([h.name, h.node_id, h.pending_count, h.pending_weight,
                              sum(1 for it in h.working.values() if it.ack), h.consumed_count,
                              h.consumed_weight, h.meter.value, h.busy_fraction, h.free_memory,
                              h.waiting, *staleness])
    pacing = core.pacing
    stale = pacing.stale_by_key
    return {
        "name": core.name, "policy": core.policy.name, "maxsize": core.maxsize, "closed": core.closed,
        "length": core.queued, "weight": core.queued_weight,
        "keys": [[k, n, core.key_weight[k], stale.get(k, 0)] for k, n in core.key_len.items()],
        "consumers": consumers,
        "producers": sum(1 for h in core.handles.values() if h.puts),
        "put_count": core.put_count, "get_count": core.get_count,
        "requeued": core.requeued, "rejected": core.rejected, "policy_errors": core.guard.errors,
        "put_rate": sum(r[1] for r in recent) / span, "get_rate": sum(r[2] for r in recent) / span,
        "bytes_in": core.bytes_in, "bytes_out": core.bytes_out, "uptime": uptime,
        **pacing.stats(),
    }
