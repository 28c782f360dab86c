"""A producer that puts and leaves at once: a clean close delivers every put it made
(DESIGN.md §4: a clean close delivers what was handed over, channel puts included)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import rlinf

from . import workers_channel as wc

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("close", [False, True], ids=["returns", "acloses"])
@pytest.mark.parametrize("size,n", [(8, 100), (200 << 10, 40), (4 << 20, 6)], ids=["small", "200KB", "4MiB"])
async def test_puts_made_just_before_a_clean_exit_all_arrive(cluster, driver, size, n, close):
    name = f"exit-{size}-{int(close)}"
    async with asyncio.timeout(90):
        ch = await driver.create_channel(name)
        producer = await cluster.spawn(wc.put_and_leave, "prod", 1, args=(name, n, size, close))
        assert await producer.join(timeout=60) == [n]
        got = []
        while len(got) < n:
            got.extend(await ch.get_batch(timeout=10))
    assert [item["i"] for item in got] == list(range(n))
    for item in got:
        assert item["data"].nbytes == size and int(item["data"][0]) == item["i"] % 251


async def test_a_close_that_cannot_deliver_its_puts_raises(cluster, driver):
    """The channel process dies after the puts returned: the producer's close cannot
    deliver them, and says so (bounded by the linger) instead of returning quietly."""
    async with asyncio.timeout(60):
        await driver.create_channel("gone")
        pid = next(w.pid for w in await driver.peers() if w.address == "channel.gone:0")
        comm = await cluster.connect("prod:0").start()
        ch = await comm.channel("gone", timeout=10)
        await ch.put("confirmed")
        await ch.flush(timeout=10)
        os.kill(pid, signal.SIGKILL)
        for i in range(5):             # no await yields here: each put returns, queued
            await ch.put(i)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises((rlinf.PeerLostError, rlinf.CommTimeoutError), match="5 put.*may not have arrived"):
            await comm.aclose()
        assert loop.time() - start < 5.0
        assert comm.closed
        await comm.aclose()            # idempotent: closed, nothing more to say


async def test_a_producer_still_putting_while_its_communicator_closes_loses_nothing(cluster, driver):
    """Every put that returned arrives; the producer's next put raises ClosedError."""
    async with asyncio.timeout(60):
        ch = await driver.create_channel("busy")
        comm = await cluster.connect("prod:0").start()
        producer = await comm.channel("busy", timeout=10)
        returned = []

        async def produce():
            i = 0
            while True:
                await producer.put(i)
                returned.append(i)
                i += 1
                await asyncio.sleep(0)      # a producer doing other work between puts

        task = asyncio.ensure_future(produce())
        await producer.put("first")
        await comm.aclose()
        with pytest.raises(rlinf.ClosedError):
            await task
        got = await ch.get_batch(timeout=10)
        while (await ch.stats(timeout=10)).length:
            got.extend(await ch.get_batch(timeout=10))
    got.remove("first")
    assert got == returned and returned
