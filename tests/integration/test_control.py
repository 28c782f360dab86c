"""The control session's view of the roster stays consistent with the event stream."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

import rlinf
from rlinf.control.manager import Manager

pytestmark = pytest.mark.multiproc


class _ThreadManager:
    """A manager on its own thread and loop, so it keeps answering while the test
    deliberately holds the worker's loop."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.manager: Manager | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with Manager("tcp://127.0.0.1:0") as self.manager:
            self.ready.set()
            await self._stop.wait()

    def __enter__(self) -> Manager:
        self._thread.start()
        assert self.ready.wait(30), "manager thread did not start"
        return self.manager

    def __exit__(self, *exc_info) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def _register_in_thread(address: str, manager: Manager, registered: threading.Event,
                        release: threading.Event) -> threading.Thread:
    async def main() -> None:
        async with rlinf.connect(address, manager=manager.address, token=manager.token):
            registered.set()
            while not release.is_set():   # stay registered until the test is done
                await asyncio.to_thread(release.wait, 0.1)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


async def test_a_roster_reply_read_with_a_later_join_does_not_report_the_joiner_lost():
    """A roster reply and the "joined" event that follows it can be read in one batch;
    the roster must be applied where it sits in the stream, not when the waiting task
    resumes (then it is stale, and the peer that just joined looked lost)."""
    with _ThreadManager() as manager:
        async with asyncio.timeout(60):
            async with rlinf.connect("a:0", manager=manager.address, token=manager.token) as a:
                gone: list[str] = []
                a.on_peer_gone(lambda address, incarnation: gone.append(address))
                control = a._lifecycle.control
                refresh = asyncio.create_task(control._refresh())
                await asyncio.sleep(0)   # the roster request is sent; its reply is not read yet
                # Hold this loop until the reply is queued, then let "b" register, so the
                # manager queues "joined b:0" right behind the (now stale) roster.
                assert control._sock.poll(10_000, zmq.POLLIN), "no roster reply"
                registered, release = threading.Event(), threading.Event()
                joiner = _register_in_thread("b:0", manager, registered, release)
                try:
                    assert registered.wait(30), "b:0 did not register"
                    control._on_readable()   # one batch: roster reply, then the join
                    await refresh
                    assert gone == []
                    assert "b:0" in control._known
                finally:
                    release.set()
                    await asyncio.to_thread(joiner.join, 30)
