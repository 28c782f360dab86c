"""rlinf.core._busypoll: polling before sleeping, the adaptive window, cancellation, CPU bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlinf.config import Settings
from rlinf.core._busypoll import DEFAULT_US, BusyPoll
from rlinf.errors import PeerLostError
from rlinf.core._mailbox import Mailbox, Message

#: A maximum no wait in these tests comes near, even on a loaded machine.
_LONG_US = 1e6


def _due(delay: float, value: object = None) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.call_later(delay, lambda: future.done() or future.set_result(value))
    return future


async def _wait(poll: BusyPoll, future: asyncio.Future) -> object:
    async with asyncio.timeout(10):
        return await poll.wait(future)


async def test_a_result_due_within_the_window_is_caught_while_polling():
    poll = BusyPoll(_LONG_US)
    for i in range(3):
        assert await _wait(poll, _due(0.002, i)) == i
    assert (poll.caught, poll.slept) == (3, 0)
    assert poll.window == poll.max
    assert poll.polled > 0.003                        # ~2 ms each, polling


async def test_waits_longer_than_the_maximum_halve_the_window_until_polling_stops():
    poll = BusyPoll(200)
    for _ in range(6):
        await _wait(poll, _due(0.01))
    # 200 -> 100 -> 50 -> 25 us, then below the floor: off. The last two did not poll.
    assert (poll.caught, poll.slept, poll.window) == (0, 4, 0.0)
    assert poll.polled < 0.05


async def test_a_wait_within_the_maximum_grows_the_window_back():
    poll = BusyPoll(_LONG_US)
    poll.window = 0.0
    await _wait(poll, _due(0.02))
    assert (poll.caught, poll.slept) == (0, 0)        # off: it slept without polling
    assert poll.window >= 0.03                        # 1.5 x the wait
    assert await _wait(poll, _due(0.002, "next")) == "next"
    assert poll.caught == 1


async def test_an_exception_comes_through_as_from_a_plain_await():
    poll = BusyPoll(_LONG_US)
    future = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.002, future.set_exception, PeerLostError("gone", peer="a:0"))
    with pytest.raises(PeerLostError):
        await _wait(poll, future)


async def test_cancelling_a_polling_wait_cancels_the_future_and_polling_resumes_later():
    poll = BusyPoll(_LONG_US)
    future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(poll.wait(future))
    for _ in range(3):
        await asyncio.sleep(0)                        # it is polling now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    assert future.cancelled()
    assert await _wait(poll, _due(0.002, 1)) == 1
    assert poll.caught == 1


async def test_one_wait_per_loop_polls_at_a_time():
    poll = BusyPoll(_LONG_US)
    first = asyncio.create_task(poll.wait(_due(0.01, 1)))
    await asyncio.sleep(0)                            # the first polls
    async with asyncio.timeout(10):
        assert await poll.wait(_due(0.002, 2)) == 2   # the second just waits
        assert await first == 1
    assert (poll.caught, poll.slept) == (1, 0)


async def test_an_idle_wait_costs_at_most_the_window_in_cpu():
    poll = BusyPoll(2000)
    cpu = time.thread_time()
    await _wait(poll, _due(0.3))
    assert time.thread_time() - cpu < 0.1             # 2 ms of polling, then asleep
    assert poll.slept == 1


async def test_polling_off_just_waits():
    poll = BusyPoll(0)
    assert await _wait(poll, _due(0.002, "x")) == "x"
    assert (poll.caught, poll.slept, poll.polled) == (0, 0, 0.0)


def test_the_environment_sets_the_maximum():
    def from_env(env: dict[str, str]) -> BusyPoll:   # as the communicator builds it
        return BusyPoll(Settings.from_env(env).busy_poll_us)

    assert from_env({}).max == DEFAULT_US / 1e6 == BusyPoll().max
    assert from_env({"RLINF_BUSY_POLL": "250"}).max == 250e-6
    assert from_env({"RLINF_BUSY_POLL": "0"}).window == 0
    for bad in ("fast", "-5"):
        with pytest.raises(ValueError, match=f"RLINF_BUSY_POLL={bad!r}"):
            from_env({"RLINF_BUSY_POLL": bad})
    with pytest.raises(ValueError, match=">= 0"):
        BusyPoll(-5)


def test_the_report_is_plain_values():
    report = BusyPoll(500).report()
    assert report == {"window_us": 500, "max_us": 500, "caught": 0, "slept": 0, "polled_s": 0.0}


async def test_a_polling_receive_cancelled_after_the_hand_over_puts_the_message_back():
    """The mailbox's cancellation guarantee holds while the receive polls."""
    mailbox = Mailbox(BusyPoll(_LONG_US))
    task = asyncio.create_task(mailbox.wait("a:0", 0))
    await asyncio.sleep(0)                            # parked, polling
    msg = Message("a:0", "inc", 0, b"", [])
    mailbox.deliver(msg)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    assert mailbox.get_nowait("a:0", 0) is msg


async def test_a_polling_receive_gets_its_message():
    mailbox = Mailbox(BusyPoll(_LONG_US))
    task = asyncio.create_task(mailbox.wait("a:0", 0))
    await asyncio.sleep(0)
    msg = Message("a:0", "inc", 0, b"", [])
    asyncio.get_running_loop().call_later(0.002, mailbox.deliver, msg)
    async with asyncio.timeout(10):
        assert await task is msg
