"""``Work``: the awaitable handle every ``async_*`` call returns.

A :class:`Work` wraps an :class:`asyncio.Future` owned by the communicator's loop. It
can be awaited on that loop, polled (``done()``), and waited on from any other thread
(``wait(timeout)``, ``result(timeout)``). Ordering is fixed when the ``async_*`` call is
made, not when the Work is awaited. An exception that nobody retrieves is reported by
asyncio's usual "exception was never retrieved" log when the Work is collected.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Generic, TypeVar

from ..errors import CommTimeoutError

__all__ = ["Work"]

T = TypeVar("T")


class Work(Generic[T]):
    """Handle of an operation started with an ``async_*`` call.

    Args:
        future: the asyncio future that completes with the operation's result.
        description: short text for ``repr`` (e.g. ``"send to rollout:1 tag=0"``).
    """

    __slots__ = ("_future", "_loop", "_description", "_done_event", "__weakref__")

    def __init__(self, future: asyncio.Future, description: str = "") -> None:
        self._future = future
        self._loop = future.get_loop()
        self._description = description
        self._done_event: threading.Event | None = None   # for threads that wait (one per Work)

    def __await__(self):
        return self._future.__await__()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<Work {self._description} {state}>"

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def done(self) -> bool:
        """True once the operation finished (successfully, with an error, or cancelled)."""
        return self._future.done()

    def cancelled(self) -> bool:
        """True if the operation was cancelled before it completed."""
        return self._future.cancelled()

    def cancel(self) -> bool:
        """Cancel the operation. A cancelled receive never loses a message.

        Returns:
            True if the request to cancel was made before the operation finished.
        """
        if self._future.done():
            return False
        if self._on_loop_thread():
            return self._future.cancel()
        self._loop.call_soon_threadsafe(self._future.cancel)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block this (non-loop) thread until done. Returns False on timeout.

        Raises:
            RuntimeError: called from the loop's own thread (use ``await work``).
        """
        if self._future.done():
            return True
        if self._on_loop_thread():
            raise RuntimeError("Work.wait() would block the event loop; use 'await work' instead")
        event = self._done_event
        if event is None:    # one event and one callback, however often threads poll
            event = self._done_event = threading.Event()
            self._loop.call_soon_threadsafe(self._future.add_done_callback, lambda _f: event.set())
        return event.wait(timeout)

    def result(self, timeout: float | None = None) -> T:
        """The operation's result, waiting up to ``timeout`` seconds from another thread.

        Raises:
            CommTimeoutError: not done within ``timeout``.
            asyncio.InvalidStateError: called on the loop thread before it is done.
            Whatever the operation raised.
        """
        self._wait_done(timeout)
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's exception (None on success); waits like :meth:`result`, and
        raises the same way when it cannot."""
        self._wait_done(timeout)
        return self._future.exception()

    def _wait_done(self, timeout: float | None) -> None:
        if not self._future.done():
            if self._on_loop_thread():
                raise asyncio.InvalidStateError("Work is not done yet; await it on the loop")
            if not self.wait(timeout):
                raise CommTimeoutError(f"{self._description or 'operation'} not done after {timeout} s")

    def add_done_callback(self, fn: Callable[["Work[T]"], Any]) -> None:
        """Call ``fn(work)`` on the loop thread once the operation is done."""

        def _callback(_fut: asyncio.Future) -> None:
            fn(self)

        if self._on_loop_thread():
            self._future.add_done_callback(_callback)
        else:
            self._loop.call_soon_threadsafe(self._future.add_done_callback, _callback)
