"""Items sent ahead (rlinf.channel._ahead) to consumers at prefetch=0 under
performance_aware: each still gets its items once and in put order, gets are served from
what arrived ahead, and what a consumer that stopped asking holds comes back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rlinf import EndOfChannel

from .test_channel import comms  # noqa: F401 (a fixture)
from .wait import until

pytestmark = pytest.mark.multiproc


async def _one_waiting(driver, comms, name: str, speed: float, ack: bool = False, **options) -> tuple:
    """A performance_aware channel (``options``), a consumer (declared ``speed``) that joined
    it with a get started: (channel, consumer, its get)."""
    ch = await driver.create_channel(name, policy="performance_aware", in_process=True, **options)
    (comm,) = await comms(1)
    consumer = await comm.channel(name, speed=speed)
    first = consumer.async_get(ack=ack)
    await consumer.stats(timeout=10)
    return ch, consumer, first


async def _two_waiting(driver, comms, name: str, speed: float) -> tuple:
    """A performance_aware channel, consumers a and b (declared ``speed``) that joined it,
    each with a get started: (channel, a, b, a's get, b's get)."""
    ch = await driver.create_channel(name, policy="performance_aware", in_process=True)
    comm_a, comm_b = await comms(2)
    a = await comm_a.channel(name, speed=speed)
    b = await comm_b.channel(name, speed=speed)
    work_a, work_b = a.async_get(), b.async_get()
    await a.stats(timeout=10)
    await b.stats(timeout=10)
    return ch, a, b, work_a, work_b


async def test_a_busy_consumer_gets_its_next_items_ahead_once_and_in_put_order(driver, comms):
    """Items of 10 ms (declared speed 100, weight 1): the next ones arrive while the
    consumer works, so some of its gets complete at once; every item comes once, in order."""
    async with asyncio.timeout(60):
        ch, consumer, first = await _one_waiting(driver, comms, "ahead-order", 100.0)   # joined before the puts
        n = 40
        for i in range(n):
            await ch.put(i, weight=1.0)
        got, at_once = [await first], 0
        while len(got) < n:
            await asyncio.sleep(0.01)             # works 10 ms (the channel runs meanwhile)
            work = consumer.async_get()
            at_once += work.done()
            got.append(await asyncio.wait_for(work, 10))
        assert got == list(range(n))
        assert at_once > n // 4, at_once
        stats = await ch.stats()
        assert stats.length == 0 and stats.consumer("c0:0").pending_count <= 1
        await ch.close()


async def test_batches_and_acked_gets_take_what_was_sent_ahead_in_order(driver, comms):
    """get_batch takes from what arrived ahead (by the get_batch rule), get(ack=True) too;
    nothing is lost, duplicated or reordered."""
    async with asyncio.timeout(60):
        ch, consumer, first = await _one_waiting(driver, comms, "ahead-batch", 100.0, ack=True)
        n = 40
        for i in range(n):
            await ch.put(i, weight=1.0)
        got = [await first]
        consumer.task_done(got[0])
        while len(got) < n:
            await asyncio.sleep(0.02)
            if len(got) % 2:
                got += await consumer.get_batch(max_items=4, timeout=10)
            else:
                item = await consumer.get(timeout=10, ack=True)
                consumer.task_done(item)
                got.append(item)
        assert got == list(range(n))
        assert consumer.unacked == 0 and not consumer._buffers.get(None)
        await ch.close()


async def test_what_went_ahead_to_a_consumer_that_stopped_asking_goes_to_one_that_waits(driver, comms):
    """a takes one item and never asks again: the item sent ahead to it while it "worked"
    is recalled once another consumer waits, given back, and taken by b (stealing, on by
    default for performance_aware: b may get it after newer ones)."""
    async with asyncio.timeout(60):
        ch, a, b, work_a, work_b = await _two_waiting(driver, comms, "ahead-recall", 20.0)
        for i in range(4):                        # 50 ms each: LPT places two and two
            await ch.put(i, weight=1.0)
        first_a = await work_a
        await until(lambda: a._buffers.get(None), what="a's next item sent ahead")
        got_b = [await work_b]
        while len(got_b) < 3:                     # its own, then a's: recalled and given back
            got_b.append(await b.get(timeout=10))
        assert sorted([first_a, *got_b]) == [0, 1, 2, 3]
        assert not a._buffers.get(None)
        stats = await ch.stats()
        assert stats.consumer("c0:0").pending_count == 1      # the one it holds, nothing more
        await ch.close()


async def test_large_items_sent_ahead_arrive_in_order(driver, comms):
    """Items of 100 kB travel out of band (and through shared memory): sent ahead too."""
    async with asyncio.timeout(60):
        ch, consumer, first = await _one_waiting(driver, comms, "ahead-large", 100.0)
        n = 10
        for i in range(n):
            await ch.put(np.full(100_000, i, dtype=np.uint8), weight=1.0)
        got = [int((await first)[0])]
        while len(got) < n:
            await asyncio.sleep(0.01)
            got.append(int((await consumer.get(timeout=10))[0]))
        assert got == list(range(n))
        await ch.close()


async def test_an_item_ahead_overdue_while_none_waited_goes_to_a_consumer_that_waits_later(driver, comms):
    """b takes one item and stops asking, its next one ahead; a is busy past b's recall
    deadline, then asks: b's item comes back to a (stealing is on), and after close, a's
    next get ends with EndOfChannel."""
    async with asyncio.timeout(60):
        ch, a, b, wa, wb = await _two_waiting(driver, comms, "ahead-late", 10.0)
        for w in (5.0, 0.5, 0.5):                 # LPT: 5 to a (0.5 s), 0.5 and 0.5 to b
            await ch.put(w, weight=w)
        assert await wa == 5.0 and await wb == 0.5
        await until(lambda: b._buffers.get(None), what="b's next item sent ahead")
        await asyncio.sleep(0.5)                  # a works its 0.5 s, past b's deadline; b never asks
        assert await a.get(timeout=10) == 0.5
        await ch.close()
        with pytest.raises(EndOfChannel):
            await a.get(timeout=10)


async def test_no_item_ahead_escapes_the_staleness_bound(driver, comms):
    """max_staleness=0: after advance(1), no get returns a version-0 item."""
    async with asyncio.timeout(60):
        # 50 ms per item of weight 1
        ch, trainer, first = await _one_waiting(driver, comms, "ahead-stale", 20.0, max_staleness=0)
        for i in range(4):
            await ch.put(i, weight=1.0, version=0)
        assert await first == 0
        await asyncio.sleep(0.08)                 # "trains" past the time its next item would go ahead
        await ch.advance(1)
        await ch.put(100, weight=1.0, version=1)
        assert await trainer.get(timeout=10) == 100
        assert (await ch.stats()).stale_dropped == 3
        await ch.close()


async def test_get_batch_takes_what_was_sent_ahead_and_what_else_is_there(driver, comms):
    """The get_batch rule: the longest prefix of the items available to it, within
    max_items, not only those that were sent ahead."""
    async with asyncio.timeout(60):
        ch, c, first = await _one_waiting(driver, comms, "ahead-topup", 20.0)
        for i in range(12):
            await ch.put(i, weight=1.0)
        assert await first == 0
        await until(lambda: c._buffers.get(None), what="the next item sent ahead")
        assert await c.get_batch(max_items=10, timeout=10) == list(range(1, 11))
        assert await c.get_batch(max_items=10, timeout=10) == [11]
        await ch.close()


async def _drain_rest(ch, comm, name: str) -> list:
    """Close the channel; a new consumer takes what is left: the items, in its order."""
    d = await comm.channel(name, speed=1000.0)
    await ch.close()
    got = []
    while True:
        try:
            got += await d.get_batch(timeout=10)
        except EndOfChannel:
            return got


@pytest.mark.parametrize("detach_at_once", [True, False])
async def test_a_batch_given_up_while_topping_up_then_detached_loses_nothing(driver, comms, detach_at_once):
    """get_batch took the items sent ahead and asks for the rest; cancelled before the
    answer, they stay with the handle, still ahead for the channel: detached, they go back."""
    async with asyncio.timeout(60):
        name = f"ahead-topup-cancel-{detach_at_once}"
        ch = await driver.create_channel(name, policy="performance_aware", in_process=True)
        comm, other = await comms(2)
        c = await comm.channel(name, speed=20.0)
        first = c.async_get()
        await c.stats(timeout=10)
        for i in range(6):
            await ch.put(i, weight=1.0)
        assert await first == 0
        await until(lambda: c._buffers.get(None), what="an item sent ahead")
        ahead = [i[0] for i in c._buffers[None]]
        batch = asyncio.ensure_future(c.get_batch(max_items=10, timeout=10))
        await asyncio.sleep(0)                    # it took them and sent its top-up
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        assert [i[0] for i in c._buffers[None]] == ahead
        if not detach_at_once:                    # the top-up's answer comes back (unget)
            await c.stats(timeout=10)
        await c.detach()
        assert sorted(await _drain_rest(ch, other, name)) == [1, 2, 3, 4, 5]


async def test_a_get_given_up_with_its_answer_on_the_way_keeps_put_order(driver, comms):
    """The answer of a get given up comes back (unget): no items go ahead meanwhile (they
    would come first), so the consumer still gets its items in put order."""
    async with asyncio.timeout(60):
        ch, c, first = await _one_waiting(driver, comms, "ahead-abandon", 1e6, ack=True)
        await ch.put(0, weight=1.0)
        assert await first == 0                   # never task_done: the declared speed holds
        for i in range(1, 6):
            await ch.put(i, weight=1.0)
        await ch.flush()                          # placed for c
        get = asyncio.ensure_future(c.get(timeout=10))
        await asyncio.sleep(0)                    # its get is on its way
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
        assert [await c.get(timeout=10) for _ in range(5)] == [1, 2, 3, 4, 5]
        await ch.close()


@pytest.mark.parametrize("then", ["put", "close"])
async def test_a_get_racing_a_topping_up_get_batch_is_answered(driver, comms, then):
    """Another task's get while get_batch tops up (the items it took still ahead for the
    channel) is answered by the next item put, or ends as the channel closes: not taken by
    the channel as answered by those items."""
    async with asyncio.timeout(60):
        name = f"ahead-topup-race-{then}"
        ch, c, first = await _one_waiting(driver, comms, name, 20.0)
        for i in range(6):
            await ch.put(i, weight=1.0)
        assert await first == 0
        await until(lambda: c._buffers.get(None), what="an item sent ahead")
        batch = asyncio.ensure_future(c.get_batch(max_items=10, timeout=10))
        await asyncio.sleep(0)                    # it took the items ahead and sent its top-up
        get = asyncio.ensure_future(c.get(timeout=10))
        assert await batch == [1, 2, 3, 4, 5]
        await until(lambda: c._gets, what="the get's op")
        await c.stats(timeout=10)                 # the channel has the get
        # Time passes beyond the batch's expected work (5 items at 20/s): nothing is due
        # to go ahead then, and item 6 reaches the consumer only by answering its get.
        await asyncio.sleep(0.3)
        if then == "put":
            await ch.put(6, weight=1.0)
            assert await get == 6
            await ch.close()
        else:
            await ch.close()
            with pytest.raises(EndOfChannel):
                await get
