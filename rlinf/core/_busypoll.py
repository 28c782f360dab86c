"""Busy polling: a receive that finds nothing keeps the loop polling a moment before
the process goes to sleep.

Waking a process that sleeps in ``epoll_wait`` is slow where its CPU has gone idle:
on a virtual machine a halted vCPU takes 100-200 us to run again, and the sender's
``write`` pays part of that too. A reply or the next item of a pipeline often arrives
within a few hundred microseconds; if the receiving loop is still polling then, the
message is picked up at once and the sender's write wakes nobody.

The window adapts, like KVM's halt polling: a wait that outlasted the window but ended
within the maximum grows it (the next such wait is caught), and a wait longer than the
maximum halves it, so a process whose messages come seldom stops polling after a few
receives. Between loop passes the poller yields its CPU (``sched_yield``): a runnable
process on the same CPU goes first. One receive per loop polls at a time; the others
just wait.

``RLINF_BUSY_POLL`` (``Settings.busy_poll_us``) sets the maximum window in microseconds
(default 1000; ``0`` turns polling off); the communicator passes it to :class:`BusyPoll`.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from ..config import DEFAULTS

__all__ = ["BusyPoll", "DEFAULT_US"]

#: The default maximum window, microseconds (``RLINF_BUSY_POLL``'s).
DEFAULT_US = DEFAULTS.busy_poll_us
#: A window that has shrunk below this turns off, and one that grows from off starts here.
_FLOOR = 20e-6

_clock = time.perf_counter
_yield_cpu = getattr(os, "sched_yield", lambda: None)


class BusyPoll:
    """The busy-poll policy of one event loop (loop thread only).

    Args:
        max_us: the longest a receive polls before it sleeps, microseconds; 0: never.

    Attributes:
        window: the current window, seconds (0: this loop does not poll now).
        caught: waits that ended while polling (a sleep and a wake-up saved).
        slept: waits that polled, found nothing and went to sleep.
        polled: seconds spent polling in all (CPU time spent, or yielded to others).
    """

    __slots__ = ("max", "window", "caught", "slept", "polled", "_polling")

    def __init__(self, max_us: float = DEFAULT_US) -> None:
        if max_us < 0:
            raise ValueError(f"busy-poll window must be >= 0 us, got {max_us}")
        self.max = max_us / 1e6
        self.window = self.max          # optimistic: shrinks after waits it cannot catch
        self.caught = self.slept = 0
        self.polled = 0.0
        self._polling = False

    def __repr__(self) -> str:
        return f"<BusyPoll window={self.window * 1e6:.0f}us max={self.max * 1e6:.0f}us>"

    def report(self) -> dict:
        """Plain values for the stats a worker reports (``rlinf top``)."""
        return {"window_us": round(self.window * 1e6), "max_us": round(self.max * 1e6),
                "caught": self.caught, "slept": self.slept, "polled_s": round(self.polled, 6)}

    async def wait(self, future: asyncio.Future) -> Any:
        """Await ``future``: poll the loop for up to the window, then sleep until it is
        done. The same as ``await future`` otherwise: its result or exception, and a
        cancelled caller cancels ``future``."""
        if self._polling or not self.max:
            return await future
        start = _clock()
        if self.window:
            self._polling = True
            now = start
            try:
                deadline = start + self.window
                while not future.done() and now < deadline:
                    _yield_cpu()
                    await asyncio.sleep(0)
                    now = _clock()
            except asyncio.CancelledError:
                future.cancel()
                raise
            finally:
                self._polling = False
                self.polled += now - start
            if future.done():
                self.caught += 1
                return future.result()          # caught while polling
            self.slept += 1
        result = await future
        self._missed(_clock() - start)
        return result

    def _missed(self, waited: float) -> None:
        """Adapt the window to a wait that polling did not catch."""
        if waited <= self.max:
            self.window = min(self.max, max(2 * self.window, _FLOOR, 1.5 * waited))
        else:
            self.window = self.window / 2 if self.window / 2 >= _FLOOR else 0.0
