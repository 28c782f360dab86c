"""This process's clock against the manager's, for one timeline across processes.

Each request a worker makes to the manager (its registration, its heartbeats) is a
round trip: sent at ``t0`` and answered at ``t1`` by this clock, and stamped ``now`` by
the manager's. Assuming the two legs take equal time (NTP's midpoint rule), the
manager's clock reads ``now`` at our ``(t0 + t1) / 2``, so ``offset = now - (t0 + t1)
/ 2`` and the error is at most half the round trip. The sample with the shortest round
trip is the tightest bound, so it is the one kept. ``rlinf trace merge`` adds each
process's offset to its timestamps (see :mod:`rlinf.tools.trace`).
"""

from __future__ import annotations

__all__ = ["ClockSync"]


class ClockSync:
    """The best estimate so far of the manager's clock minus ours (``time.time()``).

    Samples may come from any thread (the heartbeat thread's): the estimate is one
    tuple, replaced whole.
    """

    def __init__(self) -> None:
        self._best: tuple[float, float] | None = None    # (offset, round trip), seconds

    def sample(self, t0: float, now: float, t1: float) -> None:
        """A round trip sent at ``t0`` and answered at ``t1`` (our clock) that the
        manager stamped ``now`` (its clock); a sample with a negative round trip (our
        clock stepped back meanwhile) is ignored."""
        rtt = t1 - t0
        if rtt < 0:
            return
        best = self._best
        if best is None or rtt <= best[1]:
            self._best = (now - (t0 + t1) / 2, rtt)

    @property
    def offset(self) -> tuple[float, float] | None:
        """``(offset, round_trip)`` in seconds: add ``offset`` to our time to get the
        manager's, within ``round_trip / 2``; None before the first sample."""
        return self._best
