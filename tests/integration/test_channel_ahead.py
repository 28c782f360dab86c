"""Items sent ahead (rlinf.channel._ahead) to consumers at prefetch=0 under
performance_aware: each still gets its items once and in put order, gets are served from
what arrived ahead, and what a consumer that stopped asking holds comes back."""

from __future__ import annotations

import asyncio

import pytest

from .test_channel import comms  # noqa: F401 (a fixture)
from .wait import until

pytestmark = pytest.mark.multiproc


async def test_a_busy_consumer_gets_its_next_items_ahead_once_and_in_put_order(driver, comms):
    """Items of 10 ms (declared speed 100, weight 1): the next ones arrive while the
    consumer works, so some of its gets complete at once; every item comes once, in order."""
    async with asyncio.timeout(60):
        ch = await driver.create_channel("ahead-order", policy="performance_aware", in_process=True)
        (comm,) = await comms(1)
        consumer = await comm.channel("ahead-order", speed=100.0)
        first = consumer.async_get()
        await consumer.stats(timeout=10)          # it joined before the puts
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
        ch = await driver.create_channel("ahead-batch", policy="performance_aware", in_process=True)
        (comm,) = await comms(1)
        consumer = await comm.channel("ahead-batch", speed=100.0)
        first = consumer.async_get(ack=True)
        await consumer.stats(timeout=10)
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
        ch = await driver.create_channel("ahead-recall", policy="performance_aware", in_process=True)
        comm_a, comm_b = await comms(2)
        a = await comm_a.channel("ahead-recall", speed=20.0)
        b = await comm_b.channel("ahead-recall", speed=20.0)
        work_a, work_b = a.async_get(), b.async_get()
        await a.stats(timeout=10)
        await b.stats(timeout=10)
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
