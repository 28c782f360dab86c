"""``blocking_*``: a communicator's operation run on its loop from another thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine

from ..errors import ClosedError, CommTimeoutError
from ..info import check_timeout

__all__ = ["run_threadsafe", "wait_for"]

#: Seconds a blocking_* call waits beyond its timeout for a busy loop to run it.
LOOP_GRACE = 1.0


def run_threadsafe(coro: Coroutine, timeout: float | None, loop: asyncio.AbstractEventLoop | None,
                   loop_thread: int | None, check_open: Callable[[], None], address: str, *,
                   default: float | None = None) -> Any:
    """Run ``coro`` on ``loop`` (the communicator's, run by ``loop_thread``) from another
    thread. ``timeout`` (the operation's own; None: ``default``, the communicator's
    ``RLINF_TIMEOUT``) also bounds the wait for a loop too busy to start it (plus
    :data:`LOOP_GRACE`).

    Raises:
        RuntimeError: called on the loop's own thread (it would deadlock).
        ClosedError: the communicator or its loop is not running.
        CommTimeoutError: the loop did not run it in time.
    """
    try:
        timeout = check_timeout(timeout, default)
        check_open()
        if loop.is_closed() or not loop.is_running():
            raise ClosedError(f"communicator {address}: its event loop is not running")
    except BaseException:
        coro.close()
        raise
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop or threading.get_ident() == loop_thread:
        coro.close()
        raise RuntimeError("blocking_* would deadlock on the communicator's own loop; use 'await'")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(None if timeout is None else timeout + LOOP_GRACE)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise CommTimeoutError(f"{address}: the event loop did not run the operation within "
                               f"{timeout} s (it is busy)") from None
    except BaseException:   # interrupted (KeyboardInterrupt): the operation must not go on alone
        future.cancel()
        raise


async def wait_for(future: asyncio.Future, timeout: float | None, what: str) -> Any:
    """Await ``future`` for at most ``timeout`` seconds (None: forever).

    Raises:
        CommTimeoutError: saying ``what`` did not complete in time (the future is cancelled).
    """
    if timeout is None:
        return await future
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        raise CommTimeoutError(f"{what} did not complete within {timeout} s") from None
