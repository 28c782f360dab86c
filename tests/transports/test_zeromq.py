"""ZeroMQ transport specifics beyond the conformance suite."""

from __future__ import annotations

import asyncio
import threading

import zmq

from rlinf.transports.zeromq import ReleaseWatcher


class _Tracker:
    """A ZeroMQ message tracker whose frames libzmq lets go of when ``release`` is set."""

    done = False

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self, timeout: float) -> None:
        if not self.release.wait(timeout):
            raise zmq.NotDone


def test_release_watcher_ends_quietly_when_its_loop_is_gone():
    """Zero-copy frames let go of after the loop closed (a program that returned with
    a large send in flight): the watcher thread ends, it does not die of the closed loop
    (pytest turns an exception in a thread into an error)."""
    tracker = _Tracker()

    async def main() -> ReleaseWatcher:
        watcher = ReleaseWatcher(asyncio.get_running_loop())
        watcher.watch(tracker)
        return watcher

    watcher = asyncio.run(main())
    tracker.release.set()
    watcher._thread.join(5)
    assert not watcher._thread.is_alive()
