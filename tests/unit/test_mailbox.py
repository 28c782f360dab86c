"""rlinf.core._mailbox: hand-over to waiting receivers, lifetimes, and cancellation."""

from __future__ import annotations

import asyncio
import weakref

import numpy as np

from rlinf.core._mailbox import Mailbox, Message


def _message(tag: int = 0) -> tuple[Message, weakref.ref]:
    buf = np.ones(16, np.uint8)     # stands for a view of a shared-memory slot
    return Message("a:0", "inc", tag, b"", [buf]), weakref.ref(buf)


async def _two_waiting_receives(other_src: str | None) -> tuple[Mailbox, asyncio.Task, asyncio.Task]:
    """A mailbox, a receive from a:0 waiting in it, and a second one (from ``other_src``,
    None: any source) waiting behind it."""
    mailbox = Mailbox()
    first = asyncio.create_task(mailbox.wait("a:0", 0))
    await asyncio.sleep(0)                   # let it park
    second = asyncio.create_task(mailbox.wait(other_src, 0))
    await asyncio.sleep(0)
    return mailbox, first, second


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_a_handed_over_message_dies_when_the_receiver_drops_it():
    """The loop keeps a finished future alive until the receiving task yields; the
    message handed over through it must not live that long (its buffers may hold a
    shared-memory slot the sender is waiting for)."""
    mailbox = Mailbox()

    async def receiver() -> bool:
        msg = await mailbox.wait("a:0", 0)
        del msg
        return ref() is None     # gone before this task yields

    task = asyncio.create_task(receiver())
    await asyncio.sleep(0)                   # let it park
    msg, ref = _message()
    mailbox.deliver(msg)
    del msg
    async with asyncio.timeout(5):
        assert await task


async def test_a_receive_cancelled_after_the_hand_over_puts_the_message_back():
    mailbox = Mailbox()
    task = asyncio.create_task(mailbox.wait("a:0", 0))
    await asyncio.sleep(0)
    first, _ = _message()
    mailbox.deliver(first)                   # handed over; the task has not resumed yet
    task.cancel()
    async with asyncio.timeout(5):
        try:
            await task
        except asyncio.CancelledError:
            pass
    second, _ = _message()
    mailbox.deliver(second)
    assert mailbox.get_nowait("a:0", 0) is first    # back at the front, nothing lost
    assert mailbox.get_nowait("a:0", 0) is second


async def test_a_cancelled_receive_passes_its_message_to_the_next_waiter():
    """Put back while another receive (same source and tag, or any source) waits: that
    one gets it, in order; queued instead, the next message would reach it first."""
    for other_src in ("a:0", None):
        mailbox, cancelled, waiting = await _two_waiting_receives(other_src)
        first, _ = _message()
        mailbox.deliver(first)               # handed to the first receive, which is then cancelled
        async with asyncio.timeout(5):
            await _cancel(cancelled)
            second, _ = _message()
            mailbox.deliver(second)
            assert await waiting is first, other_src
        assert mailbox.get_nowait("a:0", 0) is second


async def test_a_receive_cancelled_in_the_turn_both_messages_arrived_keeps_the_order():
    """Two receives wait; both messages arrive in one loop turn (one each), and the first
    receive is cancelled before it resumed (a timeout due in that turn): the second must
    get the first message, and the second message is next. It got the second one, and
    the first came after it."""
    for other_src in ("a:0", None):
        mailbox, cancelled, waiting = await _two_waiting_receives(other_src)
        (first, _), (second, _) = _message(), _message()
        mailbox.deliver(first)
        mailbox.deliver(second)              # both handed over, neither receive has resumed
        async with asyncio.timeout(5):
            await _cancel(cancelled)
            assert await waiting is first, other_src
        assert mailbox.get_nowait("a:0", 0) is second


async def test_a_retired_tag_drops_queued_and_later_messages_and_is_remembered_boundedly():
    from rlinf.core._mailbox import RETIRED_TAGS

    mailbox = Mailbox()
    queued, queued_ref = _message("g:1")
    mailbox.deliver(queued)
    kept, _ = _message(0)
    mailbox.deliver(kept)
    del queued
    mailbox.retire("g:1")
    assert queued_ref() is None and len(mailbox) == 1          # dropped: its buffers are free
    late, late_ref = _message("g:1")
    mailbox.deliver(late)
    del late
    assert late_ref() is None and mailbox.get_nowait(None, "g:1") is None
    assert mailbox.get_nowait("a:0", 0) is kept                   # other tags are untouched
    for i in range(RETIRED_TAGS):
        mailbox.retire(f"other:{i}")
    again, _ = _message("g:1")                                    # forgotten after RETIRED_TAGS more
    mailbox.deliver(again)
    assert mailbox.get_nowait("a:0", "g:1") is again
