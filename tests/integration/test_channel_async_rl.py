"""Asynchronous RL through a channel, with real processes: versions, ``advance``, the
staleness bound and pacing with ``admit`` (released by put, exit, cancellation, timeout
and a producer's death)."""

from __future__ import annotations

import asyncio

import pytest

import rlinf

from . import workers_channel as wc
from .wait import until

pytestmark = pytest.mark.multiproc


async def _admitted(ch: rlinf.Channel, version: int) -> asyncio.Task:
    """Start ``async with ch.admit(version)`` in a task that holds the block until told;
    returns once the server has seen the request (an answer after it on the same link)."""
    task = asyncio.get_running_loop().create_task(_hold(ch, version))
    await asyncio.sleep(0)
    await ch.stats(timeout=10)
    return task


async def _counts(ch: rlinf.Channel, expected: tuple[int, int]) -> bool:
    s = await ch.stats(timeout=5)
    return (s.admissions_open, s.admissions_waiting) == expected


async def _hold(ch: rlinf.Channel, version: int) -> None:
    async with ch.admit(version):
        await asyncio.Event().wait()


async def test_advance_is_monotonic_and_stale_items_are_never_handed_out(driver, cluster):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("stale", max_staleness=1, in_process=True)
        consumer = await (await cluster.connect("c0:0").start()).channel("stale", timeout=10)
        try:
            await ch.advance(2)
            await ch.advance(2)                                  # equal: allowed, nothing changes
            with pytest.raises(ValueError, match="never goes back"):
                await consumer.advance(1)                        # any handle; the version stays
            assert (await ch.stats()).version == 2
            with pytest.raises(TypeError):
                await ch.put("x", version=1.5)
            with pytest.raises(ValueError):
                await ch.put("x", version=-1)
            for v in (0, 1, 2, None, 3, 0):
                await ch.put(v, version=v)
            got = await consumer.get_batch(timeout=5)
            assert got == [1, 2, None, 3]                        # 0 < 2 - 1: never handed out
            await ch.advance(4)
            await ch.put("old", version=2)
            await ch.put("new", version=4)
            assert await consumer.get(timeout=5) == "new"
            s = await ch.stats()
            assert s.stale_dropped == 3 and s.keys[0].stale_dropped == 3
            c = s.consumers[0]
            assert c.staleness_max == 1 and c.staleness_histogram == (3, 1)
        finally:
            await consumer.detach()


async def test_admission_is_released_by_put_exit_cancel_and_timeout(driver):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("adm", max_staleness=0, batch_size=2, in_process=True)
        async with ch.admit(0) as first:
            await ch.put("a")                                   # ends it: counts for good
            assert first.used
        async with ch.admit(0):
            pass                                                # exit without a put: place freed
        s = await ch.stats()
        assert (s.admitted, s.admissions_open) == (1, 0)
        holder = await _admitted(ch, 0)                         # the 2nd and last place of version 0
        with pytest.raises(rlinf.CommTimeoutError):
            async with ch.admit(0, timeout=0.2):                # full: times out, withdrawn
                pass
        waiter = await _admitted(ch, 0)
        assert (await ch.stats()).admissions_waiting == 1
        waiter.cancel()                                         # cancelled while waiting: withdrawn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (await ch.stats()).admissions_waiting == 0
        late = await _admitted(ch, 0)
        holder.cancel()                                         # the holder leaves without a put:
        with pytest.raises(asyncio.CancelledError):             # its place goes to the waiting one
            await holder
        await until(lambda: _counts(ch, (1, 0)), timeout=5, what="the waiting admission to be granted")
        s = await ch.stats()
        assert (s.admitted, s.admissions_open, s.admissions_waiting) == (2, 1, 0)
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert await ch.get(timeout=5) == "a"                   # the trainer took 1 item ...
        await ch.advance(1)                                     # ... and moved on: (k + 1) * B places
        for i in range(2):                                      # after it, 1 of them taken by "a"
            async with ch.admit(1, timeout=5):
                await ch.put(i, version=1)
        assert (await ch.stats()).admitted == 3
        waiter = await _admitted(ch, 1)                         # full again: waits ...
        assert (await ch.stats()).admissions_waiting == 1
        await ch.close()
        with pytest.raises(rlinf.ClosedError):                  # ... and is refused by close
            await waiter
        with pytest.raises(rlinf.ClosedError):
            async with ch.admit(1):
                pass


async def test_a_dead_producer_gives_its_admission_back(cluster, driver):
    async with asyncio.timeout(60):
        ch = await driver.create_channel("death", max_staleness=0, batch_size=1, in_process=True)
        victim = await cluster.spawn(wc.admit_and_hang, "victim", 1, args=("death", 0))
        assert await driver.recv("victim:0", tag=5) == "admitted"
        blocked = asyncio.get_running_loop().create_task(_hold(ch, 0))
        await asyncio.sleep(0)
        assert (await ch.stats()).admissions_waiting == 1
        await victim.kill()                                     # its admission is given back
        await until(lambda: _counts(ch, (1, 0)), timeout=15, what="the dead producer's admission to go")
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked


async def test_pacing_end_to_end_bounds_staleness_without_dropping(cluster, driver):
    """4 producer processes pace their rollouts; the trainer consumes B items per version
    and advances: nothing is trained older than k, nothing is dropped."""
    k, b, versions = 1, 8, 12
    async with asyncio.timeout(90):
        ch = await driver.create_channel("paced", max_staleness=k, batch_size=b)
        producers = await cluster.spawn(wc.paced_producer, "prod", 4, args=("paced", versions * b // 4, 0))
        worst = 0
        for version in range(versions):
            batch = []
            while len(batch) < b:
                batch += await ch.get_batch(max_items=b - len(batch), timeout=30)
            worst = max(worst, max(version - made for _src, _i, made in batch))
            await ch.advance(version + 1)
        assert await producers.join(timeout=30) == [versions * b // 4] * 4
        s = await ch.stats()
        assert worst <= k and s.stale_dropped == 0 and s.admitted == versions * b
        assert s.consumers[0].staleness_max <= k


async def test_a_refreshed_rollout_is_put_with_the_version_its_grant_told(driver):
    """A producer that waited in ``admit(0)`` while the trainer moved on is granted with
    ``current = 1``, refreshes, and puts without ``version=``: the item carries 1 (the
    version its admission counts it as made with), so it is trained, not dropped."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("refresh", max_staleness=0, batch_size=1, in_process=True)
        async with ch.admit(0):
            await ch.put("first")

        async def second():
            async with ch.admit(0, timeout=10) as admission:     # waits: version 0's place is taken
                await ch.put("second")                          # (weights refreshed to admission.current)
                return admission

        task = asyncio.get_running_loop().create_task(second())
        await asyncio.sleep(0)
        assert (await ch.stats()).admissions_waiting == 1
        assert await ch.get(timeout=5) == "first"
        await ch.advance(1)
        admission = await task
        assert await ch.get(timeout=5) == "second"
        assert (admission.version, admission.current, admission.made_with) == (0, 1, 1)
        s = await ch.stats()
        assert s.stale_dropped == 0 and s.consumers[0].staleness_histogram == (2,)


async def test_a_group_admission_paces_and_versions_every_put(driver):
    """``admit(v, n=G)``: G places, each put in the block versioned and counted; a put
    beyond G raises; an exit after fewer puts frees the rest."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("group", max_staleness=0, batch_size=4, in_process=True)
        with pytest.raises(ValueError):
            ch.admit(0, n=5)                                    # more than (k + 1) * B: never fits
        with pytest.raises(TypeError):
            ch.admit(0, n=1.0)
        async with ch.admit(0, n=3) as admission:
            for i in range(3):
                await ch.put(i)
            assert admission.used and admission.puts == 3
            with pytest.raises(ValueError, match="beyond"):
                await ch.put("a 4th")
        s = await ch.stats()
        assert (s.admitted, s.admissions_open, s.put_count) == (3, 0, 3)
        assert await ch.get_batch(max_items=3, timeout=5) == [0, 1, 2]
        assert (await ch.stats()).consumers[0].staleness_histogram == (3,)
        await ch.advance(1)
        async with ch.admit(1, n=4, timeout=5):                 # 3 handed out + 4 places
            await ch.put("only one")
        s = await ch.stats()
        assert (s.admitted, s.admissions_open) == (4, 0)       # the 3 not put were freed


async def test_a_put_waiting_for_space_keeps_its_admission_until_it_is_sent(driver):
    """With ``maxsize``, a put made in the block may still wait for space when the block
    exits: the exit reaches the channel after it (the place stays taken meanwhile), and
    a put withdrawn after a timeout gives its place back to the block."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("space", maxsize=1, max_staleness=0, batch_size=1, in_process=True)
        await ch.put("filler")                                  # full, nobody consumes yet
        async with ch.admit(0) as admission:
            with pytest.raises(rlinf.CommTimeoutError):
                await ch.put("withdrawn", timeout=0.2)
            assert not admission.used and admission.puts == 0
            late = ch.async_put("x")                            # still waiting at the exit
        s = await ch.stats()
        assert (s.admitted, s.admissions_open) == (1, 1)       # the exit waits for the put
        assert await ch.get(timeout=5) == "filler"
        await late
        assert await ch.get(timeout=5) == "x"
        s = await ch.stats()
        assert (s.admitted, s.admissions_open, s.stale_dropped) == (1, 0, 0)
        assert s.consumers[0].staleness_histogram == (1,)      # x carried the admission's version


async def test_work_stealing_takes_a_bool_or_0_and_1(driver):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("steal1", policy="round_robin", work_stealing=1, in_process=True)
        await ch.put("x")
        assert await ch.get(timeout=5) == "x"
        with pytest.raises(TypeError):
            await driver.create_channel("steal2", work_stealing="yes", in_process=True)
