"""Bounded polling, for state that gives no notification to wait on (the filesystem, a
process table, a pool's counters, the manager's heartbeat-fed snapshot, a channel's
stats fed by its consumers' asynchronous reports). Everything else in the tests
synchronises on messages, events or futures."""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Callable

#: How often a condition is looked at.
_PERIOD = 0.02


async def until(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Return once ``predicate()`` is true (awaited first when it returns an awaitable);
    fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await _value(predicate()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(_PERIOD)


async def _value(result: object) -> object:
    return await result if inspect.isawaitable(result) else result


def reaped(pid: int) -> bool:
    """Whether process ``pid`` no longer exists (exited and reaped, not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
