"""Data channels between real processes: ordering, no loss, faults, backpressure, policies."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal

import numpy as np
import pytest

import rlinf
from rlinf.channel import Channel
from rlinf.channel.server import ServerProcess
from rlinf.info import socket_dirs

from . import workers_channel as wc
from .wait import reaped, until

pytestmark = pytest.mark.multiproc


@pytest.fixture
async def comms(cluster):
    """``await comms(n)``: n more communicators of the cluster in this loop (c<i>:0)."""
    made: list = []

    async def make(n: int):
        for _ in range(n):
            made.append(await cluster.connect(f"c{len(made)}:0").start())
        return made[-n:]

    yield make
    async with asyncio.timeout(30):
        for comm in made:
            await comm.aclose()


def _refuse():
    raise RuntimeError("cannot rebuild this here")


class Undecodable:
    """Encodes (pickled) anywhere, decodes nowhere (say, a class a consumer cannot import)."""

    def __reduce__(self):
        return _refuse, ()


async def _handles(comms, name: str, n: int, **options) -> list[Channel]:
    return [await comm.channel(name, timeout=10, **options) for comm in await comms(n)]


async def _join(handles: list[Channel], **get_options) -> list[rlinf.Work]:
    """Each handle starts a get, in order; returns once the server has seen each one."""
    works = []
    for h in handles:
        works.append(h.async_get(**get_options))
        await h.stats(timeout=10)          # answered after the get, on the same link
    return works


# -- correctness under concurrency -------------------------------------------------------------
async def test_many_producers_many_consumers_no_loss_no_duplicates(cluster, driver):
    n = 250
    async with asyncio.timeout(90):
        ch = await driver.create_channel("many")
        consumers = await cluster.spawn(wc.consume_all, "cons", 2, args=("many",))
        for address in consumers.addresses:
            assert await driver.recv(address, tag=4) == "attached"
        producers = await cluster.spawn(wc.produce, "prod", 3, args=("many", n))
        assert await producers.join(timeout=60) == [n] * 3
        await ch.close(timeout=10)
        results = await consumers.join(timeout=60)
    everything = [item for got in results for item in got]
    ids = [(src, i) for src, i, _key in everything]
    assert len(ids) == len(set(ids)) == 3 * n                       # no loss, no duplicate
    for got in results:                                              # each consumer sees each
        for src in producers.addresses:                              # producer's items in order
            mine = [i for s, i, _ in got if s == src]
            assert mine == sorted(mine)


async def test_per_key_order_and_keys_are_separate(cluster, driver):
    async with asyncio.timeout(60):
        ch = await driver.create_channel("keys", in_process=True)
        producer = await cluster.spawn(wc.produce, "kp", 1, args=("keys", 300, ("a", "b", ("c", 1))))
        await producer.join(timeout=30)
        with pytest.raises(rlinf.CommTimeoutError):
            await ch.get(timeout=0.2)                               # the default key is empty
        for key in ("b", ("c", 1), "a"):
            got = await ch.get_batch(key=key, timeout=10)
            assert [i for _, i, _ in got] == list(range(["a", "b", ("c", 1)].index(key), 300, 3))
            assert {k for _, _, k in got} == {key}


async def test_prefetching_consumers_get_everything_once(cluster, driver):
    async with asyncio.timeout(60):
        ch = await driver.create_channel("pre", in_process=True)
        consumers = await cluster.spawn(wc.consume_all, "pc", 2, args=("pre", 8))
        for address in consumers.addresses:
            assert await driver.recv(address, tag=4) == "attached"
        for i in range(400):
            ch.put_nowait(i)
        await ch.close(timeout=10)
        results = await consumers.join(timeout=30)
    assert sorted(results[0] + results[1]) == list(range(400))
    assert results[0] == sorted(results[0]) and results[1] == sorted(results[1])


async def test_prefetched_gets_report_taken_finished_and_acked_items(driver, comms):
    """Gets served from the prefetch buffer (no round trip) still tell the server what
    was taken, finished (by the next get, or task_done) and may be sent next."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("pref", in_process=True)
        (consumer,) = await _handles(comms, "pref", 1, prefetch=4)
        for i in range(7):
            await ch.put(i, weight=i)
        got = [await consumer.get(timeout=5) for _ in range(3)]
        held = await consumer.get(ack=True, timeout=5)
        assert got + [held] == [0, 1, 2, 3] and consumer.unacked == 1
        stats = (await consumer.stats(timeout=5)).consumer("c0:0")
        assert (stats.consumed_count, stats.consumed_weight, stats.unacked) == (3, 3.0, 1)
        consumer.task_done(held)
        snap = await consumer.stats(timeout=5)
        stats = snap.consumer("c0:0")
        # 0-3 finished; 4-6 prefetched (the credit was given back as items were taken)
        assert (stats.consumed_count, stats.consumed_weight, stats.unacked) == (4, 6.0, 0)
        assert (stats.pending_count, stats.pending_weight) == (3, 15.0)
        assert snap.get_count == 7 and snap.length == 0
        assert [consumer.get_nowait() for _ in range(3)] == [4, 5, 6]
        await ch.close(timeout=5)
        with pytest.raises(rlinf.EndOfChannel):
            await consumer.get(timeout=5)


# -- faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["plain", "ack", "prefetch"])
async def test_killed_consumer_items_are_requeued(cluster, driver, mode):
    """A consumer takes one item (round robin gives it half of them), then is killed."""
    ack = mode == "ack"
    async with asyncio.timeout(60):
        ch = await driver.create_channel("kill", policy="round_robin", in_process=True)
        victim = await cluster.spawn(wc.take_one_and_hang, "victim", 1,
                                     args=("kill", ack, 3 if mode == "prefetch" else 0))
        assert await driver.recv("victim:0", tag=5) == "joined"
        (first,) = await _join([ch])
        for i in range(10):
            await ch.put(i)
        taken_by_victim = await driver.recv("victim:0", tag=6)
        assert taken_by_victim == 0                                  # it joined first
        await victim.kill()
        got = [await first] + [await ch.get(timeout=10) for _ in range(9 if ack else 8)]
        with pytest.raises(rlinf.CommTimeoutError):
            await ch.get(timeout=0.3)
        stats = await ch.stats()
    expected = list(range(10)) if ack else list(range(1, 10))
    assert sorted(got) == expected                                   # no loss, no duplicate
    assert stats.requeued >= 4 and [c.name for c in stats.consumers] == ["driver:0"]


async def test_producer_killed_mid_put_leaves_no_half_item(cluster, driver):
    """Kill a producer flooding large items while they are being consumed."""
    size = 3 << 20
    async with asyncio.timeout(60):
        ch = await driver.create_channel("half", maxsize=4, in_process=True)
        producer = await cluster.spawn(wc.flood_large, "flood", 1, args=("half", size))
        seen = []

        def check(item):
            assert item["data"].shape == (size,)
            assert int(item["data"].min()) == int(item["data"].max()) == item["i"] % 251
            seen.append(item["i"])

        for _ in range(6):
            check(await ch.get(timeout=30))
        await producer.kill()
        await ch.close(timeout=10)
        async for item in ch:
            check(item)
    assert seen == list(range(len(seen)))              # a prefix: nothing lost, nothing torn


async def test_channel_process_killed_fails_pending_calls(cluster, driver):
    async with asyncio.timeout(60):
        ch = await driver.create_channel("doomed", maxsize=1)
        info = next(w for w in await driver.peers() if w.address == "channel.doomed:0")
        pid, dirs = info.pid, socket_dirs(info)
        assert len(dirs) == 2
        await ch.put("fills it")
        blocked_put = ch.async_put("waits for space")
        pending_get = ch.async_get(key="other")
        await ch.stats(timeout=10)
        assert not blocked_put.done() and not pending_get.done()
        loop = asyncio.get_running_loop()
        os.kill(pid, signal.SIGKILL)
        start = loop.time()
        for work in (pending_get, blocked_put):
            with pytest.raises(rlinf.PeerLostError):
                await work
        assert loop.time() - start < 3.0
        with pytest.raises(rlinf.PeerLostError):
            await ch.put("after")
        with pytest.raises(rlinf.PeerLostError):
            await ch.get(timeout=5)
        await driver.aclose()     # stops (reaps) what it started: the dead process's sockets go
        assert [d for d in dirs if os.path.exists(d)] == []


async def test_a_channel_process_not_ready_in_time_is_stopped_and_the_timeout_reported(driver):
    """``create_channel``'s wait for its process ends in CommTimeoutError, and the
    process does not outlive it (stopping it while its pipe is still watched must work).
    The process is started here directly: through ``create_channel`` the same tiny
    timeout would first apply to its lookup at the manager."""
    config = {"maxsize": 0, "policy": "fifo", "work_stealing": False}
    process = ServerProcess("late", manager=driver.manager_address, token=driver.internal.token, config=config)
    async with asyncio.timeout(60):
        with pytest.raises(rlinf.CommTimeoutError, match="did not start"):
            await process.wait_ready(0.001)
    assert not [p for p in multiprocessing.active_children() if p.name == "rlinf-channel-late"]


async def test_channel_process_exits_when_its_creator_is_killed(cluster, driver):
    async with asyncio.timeout(60):
        events = driver.events()
        creator = await cluster.spawn(wc.create_and_hang, "creator", 1, args=("orphan",))
        assert await driver.recv("creator:0", tag=5) == "created"
        pid = next(w.pid for w in await driver.peers() if w.address == "channel.orphan:0")
        await creator.kill()
        async for event in events:                       # its parent pipe closed: it leaves
            if event.address == "channel.orphan:0" and event.kind in ("left", "lost"):
                break
        await until(lambda: reaped(pid), timeout=5,           # and its process is gone (reaped by init)
                    what=f"channel process {pid} to exit")


async def test_detach_gives_back_prefetched_and_unfinished_items(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("detach", in_process=True)
        first, second = await _handles(comms, "detach", 2)
        second_prefetching = await (await comms(1))[0].channel("detach", prefetch=4)
        for i in range(6):
            await ch.put(i)
        held = await second_prefetching.get(ack=True, timeout=5)     # 0, and 1-4 prefetched
        assert held == 0
        await second_prefetching.stats(timeout=5)
        await second_prefetching.detach()
        with pytest.raises(rlinf.ClosedError):
            await second_prefetching.get()
        got = []
        while len(got) < 6:
            got += await first.get_batch(timeout=5)
        assert sorted(got) == [0, 1, 2, 3, 4, 5]
        with pytest.raises(rlinf.CommTimeoutError):
            await second.get(timeout=0.2)


# -- flow control, close, batches ----------------------------------------------------------------
async def test_maxsize_backpressure(cluster, driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("bp", maxsize=2, in_process=True)
        (consumer,) = await _handles(comms, "bp", 1)
        await ch.put(0)
        await ch.put(1)
        with pytest.raises(rlinf.WouldBlock):
            ch.put_nowait(2)
        with pytest.raises(rlinf.CommTimeoutError):
            await ch.put(2, timeout=0.2)                 # withdrawn: never enters the channel
        later = ch.async_put(3)
        assert (await ch.stats()).length == 2 and not later.done()
        assert await consumer.get(timeout=5) == 0        # frees one slot: the blocked put goes in
        await later
        assert [await consumer.get(timeout=5) for _ in range(2)] == [1, 3]
        await ch.put(4, timeout=5)
        await ch.flush(timeout=5)                        # leases granted meanwhile have arrived
        ch.put_nowait(5)
        with pytest.raises(rlinf.WouldBlock):
            ch.put_nowait(6)                             # full (4, 5)
        await ch.flush(timeout=5)                        # 5 is in before the consumer asks
        assert await consumer.get_batch(timeout=5) == [4, 5]
        await ch.flush(timeout=5)
        ch.put_nowait(7)                                 # the refused put_nowait asked for space


async def test_close_drain_then_end_of_channel_and_process_exit(cluster, driver):
    async with asyncio.timeout(60):
        events = driver.events()
        ch = await driver.create_channel("fin", policy="shortest_queue")
        info = next(w for w in await driver.peers() if w.address == "channel.fin:0")
        assert info.meta["kind"] == "channel" and info.meta["channel"] == "fin"
        for i in range(5):
            await ch.put(i)
        waiting = ch.async_get(key="nothing-here")
        await ch.close(timeout=10)
        with pytest.raises(rlinf.ClosedError):
            await ch.put(99)
        with pytest.raises(rlinf.ClosedError):
            ch.put_nowait(99)
        with pytest.raises(rlinf.EndOfChannel):
            await waiting
        assert [item async for item in ch] == [0, 1, 2, 3, 4]
        with pytest.raises(rlinf.EndOfChannel):
            await ch.get()
        with pytest.raises(rlinf.ClosedError):
            await ch.stats(timeout=5)                    # drained: its server is exiting
        await ch.flush(timeout=5)                        # every put was processed
        async for event in events:                       # drained: the process leaves
            if event.address == "channel.fin:0" and event.kind in ("left", "lost"):
                assert event.kind == "left"
                break


async def test_get_batch_edge_cases(driver):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("batch", in_process=True)
        with pytest.raises(rlinf.CommTimeoutError):
            await ch.get_batch(target_weight=1.0, timeout=0.2)     # empty: times out
        for i, w in enumerate([5.0, 1.0, 1.0, 3.0, 0.5]):
            await ch.put(i, weight=w)
        assert await ch.get_batch(target_weight=2.0, timeout=5) == [0]       # heavier than target
        assert await ch.get_batch(target_weight=2.0, timeout=5) == [1, 2]
        assert await ch.get_batch(max_items=1, timeout=5) == [3]
        assert await ch.get_batch(timeout=5) == [4]
        with pytest.raises(ValueError):
            await ch.get_batch(target_weight=-1)
        with pytest.raises(ValueError):
            await ch.get_batch(max_items=0)
        with pytest.raises(ValueError):
            await ch.put(1, weight=float("nan"))
        with pytest.raises(ValueError):
            await ch.put(1, weight=-0.5)
        with pytest.raises(TypeError):
            await ch.put(1, key=1.5)


async def test_cancelled_gets_and_puts_lose_nothing(driver):
    got = []
    async with asyncio.timeout(30):
        ch = await driver.create_channel("cancel", in_process=True)
        for i in range(100):
            work = ch.async_get()
            if i % 2:
                await asyncio.sleep(0)
            await ch.put(i)
            for _ in range(i % 4):
                await asyncio.sleep(0)
            work.cancel()
            try:
                got.append(await work)
            except asyncio.CancelledError:
                pass
            try:
                got.append(await ch.get(timeout=0.001 * (i % 3)))
            except rlinf.CommTimeoutError:
                pass
        while True:
            try:
                got.append(await ch.get(timeout=0.3))
            except rlinf.CommTimeoutError:
                break
    assert sorted(got) == list(range(100))


async def test_keys_and_weights_the_wire_cannot_carry_are_refused_and_nothing_else_is_lost(driver):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("wire", in_process=True)
        waiting = ch.async_get(key="a")
        await ch.put("kept", key="a")
        for key in (2 ** 64, -2 ** 63 - 1, "\ud800", ("a", 2 ** 70)):
            with pytest.raises(ValueError, match="channel key"):
                await ch.put("never", key=key)     # was accepted, then lost the batch it rode in
        for weight in (10 ** 400, -1, float("inf")):
            with pytest.raises(ValueError, match="weight"):
                await ch.put("never", weight=weight)
        with pytest.raises(TypeError, match="weight"):
            await ch.put("never", weight="3")
        assert await waiting == "kept"
        await ch.put(1, weight=np.int64(3))                 # numpy numbers are numbers
        await ch.put(2, weight=np.float32(1.5), key=2 ** 64 - 1)
        assert await ch.get_batch(timeout=5) == [1]
        assert await ch.get(key=2 ** 64 - 1, timeout=5) == 2
        assert (await ch.stats(timeout=5)).length == 0


async def test_an_item_that_cannot_be_decoded_is_dropped_and_the_rest_go_back(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("undecodable", in_process=True)
        for item in ("a", Undecodable(), "c"):
            await ch.put(item)
        await ch.flush(timeout=5)
        with pytest.raises(rlinf.DecodeError, match=r"cannot be decoded here and was dropped .*the other 2 items"):
            await ch.get_batch(timeout=5)
        assert sorted(await ch.get_batch(timeout=5)) == ["a", "c"]     # were lost with it
        [prefetching] = await _handles(comms, "undecodable", 1, prefetch=4)
        await ch.put(Undecodable())
        await ch.put("d")
        with pytest.raises(rlinf.DecodeError, match="dropped"):
            await prefetching.get(timeout=5)
        assert await prefetching.get(timeout=5) == "d"
        await prefetching.detach()
        await ch.put(Undecodable())
        await ch.close(timeout=5)
        with pytest.raises(rlinf.DecodeError):
            await ch.get(ack=True, timeout=5)
        with pytest.raises(rlinf.EndOfChannel):    # the channel drains (it waited for an ack forever)
            await ch.get(timeout=5)


async def test_an_async_put_cancelled_while_waiting_for_space_never_enters(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("full", maxsize=1, in_process=True)
        [consumer] = await _handles(comms, "full", 1)
        await ch.put("first")
        work = ch.async_put("withdrawn")
        await ch.stats(timeout=5)              # the put is now waiting for space
        assert work.cancel()
        assert await consumer.get(timeout=5) == "first"
        with pytest.raises(rlinf.CommTimeoutError):
            await consumer.get(timeout=0.5)    # it used to arrive here
        await ch.put("after", timeout=5)
        assert await consumer.get(timeout=5) == "after"


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "process"])
async def test_two_creators_racing_for_one_name_one_wins(driver, comms, in_process):
    async with asyncio.timeout(60):
        [other] = await comms(1)
        results = await asyncio.gather(driver.create_channel("race", in_process=in_process),
                                       other.create_channel("race", in_process=in_process),
                                       return_exceptions=True)
        winners = [r for r in results if isinstance(r, Channel)]
        losers = [r for r in results if not isinstance(r, Channel)]
        assert len(winners) == 1 and len(losers) == 1, results   # both "won" before
        assert isinstance(losers[0], rlinf.AddressInUseError) and isinstance(losers[0], ValueError)
        assert "already exists" in str(losers[0])
        await winners[0].put("x", timeout=5)
        assert await winners[0].get(timeout=5) == "x"              # the winner was not replaced
        if not in_process:
            assert len(multiprocessing.active_children()) == 1     # the loser's process is gone


async def test_a_policy_that_cannot_reach_the_channel_process_is_refused(driver):
    class LocalPolicy(rlinf.LoadBalancePolicy):      # not importable by the channel process
        name = "local"

        def select_consumer(self, item, consumers):
            return 0

    with pytest.raises(TypeError, match="cannot be pickled"):
        await driver.create_channel("local-policy", policy=LocalPolicy())
    assert not multiprocessing.active_children()


class _Forgot(rlinf.LoadBalancePolicy):
    """Named its method otherwise: no select_consumer at all."""

    def choose(self, item, consumers):
        return 0


class _OneArgument(rlinf.LoadBalancePolicy):
    def select_consumer(self, item):
        return 0


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "process"])
async def test_a_policy_without_a_usable_select_consumer_is_refused_by_create_channel(driver, in_process):
    """Refused at once, with what is wrong, not accepted to send every item to the shared
    queue with a traceback per item; no server is started."""
    async with asyncio.timeout(30):
        with pytest.raises(TypeError, match=r"_Forgot does not implement select_consumer\(self, item, consumers\)"):
            await driver.create_channel("forgot", policy=_Forgot, in_process=in_process)
        with pytest.raises(TypeError, match=r"select_consumer\(item\) cannot be called as "
                                            r"select_consumer\(item, consumers\)"):
            await driver.create_channel("one-arg", policy=_OneArgument(), in_process=in_process)
        assert not multiprocessing.active_children()
        assert not [w for w in await driver.peers() if w.address.startswith("channel.")]


async def test_a_policy_failing_on_every_item_is_logged_once_and_counted(driver, comms, caplog):
    """Every item still reaches the consumer (through the shared queue); the channel's
    log gets one warning with the first traceback, not one per item; ``stats()`` counts
    every failure. (The server runs in this process, so its log is caplog's.)"""
    class Raises(rlinf.LoadBalancePolicy):
        def select_consumer(self, item, consumers):
            raise RuntimeError(f"no idea where item {item.item_id} goes")

    caplog.set_level(logging.DEBUG, logger="rlinf.channel")
    n = 40
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-raises", policy=Raises(), in_process=True)
        (c,) = await _handles(comms, "p-raises", 1)
        (first,) = await _join([c])          # a consumer of the key: the policy is asked
        for i in range(n):
            await ch.put(i)
        got = [await first] + [await c.get(timeout=10) for _ in range(n - 1)]
        assert got == list(range(n))
        stats = await ch.stats()
        assert stats.policy_errors == n and stats.get_count == n
    records = [r for r in caplog.records if r.name == "rlinf.channel" and "Raises" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    assert "RuntimeError: no idea where item 1 goes" in caplog.text


# -- policies on crafted consumer states in a live channel ----------------------------------------
async def test_fifo_first_waiting_consumer_wins(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-fifo", in_process=True)
        a, b = await _handles(comms, "p-fifo", 2)
        wb, wa = await _join([b, a])
        await ch.put("x")
        await ch.put("y")
        assert (await wb, await wa) == ("x", "y")


async def test_round_robin_in_join_order(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-rr", policy="round_robin", in_process=True)
        cs = await _handles(comms, "p-rr", 3)
        works = await _join(cs)
        for i in range(6):
            await ch.put(i)
        assert [await w for w in works] == [0, 1, 2]
        assert [await c.get(timeout=5) for c in cs] == [3, 4, 5]


async def test_weighted_round_robin_equal_total_weight(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-wrr", policy="weighted_round_robin", in_process=True)
        a, b = await _handles(comms, "p-wrr", 2)
        wa, wb = await _join([a, b])
        for i, w in enumerate([4, 1, 1, 1, 1]):
            await ch.put(i, weight=w)
        assert (await wa, await wb) == (0, 1)
        assert await b.get_batch(max_items=3, timeout=5) == [2, 3, 4]
        with pytest.raises(rlinf.CommTimeoutError):
            await a.get(timeout=0.2)


async def test_shortest_queue_counts_unfinished_work(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-sq", policy="shortest_queue", in_process=True)
        a, b = await _handles(comms, "p-sq", 2)
        wa, wb = await _join([a, b], ack=True)
        await ch.put("heavy", weight=5)          # tie: a; a holds it unfinished (ack)
        assert await wa == "heavy"
        for i in range(6):
            await ch.put(i, weight=1)            # b until its pending weight reaches 5
        assert await wb == 0
        stats = await ch.stats()
        assert stats.consumer("c0:0").pending_count == 2      # heavy + item 5 (tie -> fewer items)
        assert stats.consumer("c1:0").pending_count == 5

        async def unacked() -> int:   # a consumer reports what it took asynchronously
            return (await ch.stats()).consumer("c0:0").unacked

        await until(lambda: unacked(), what="c0:0's report of the item it holds")
        assert await unacked() == 1


async def test_performance_aware_follows_measured_speed(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-pa", policy="performance_aware", in_process=True)
        slow, fast = await _handles(comms, "p-pa", 2)
        clocks = {slow: [0.0], fast: [0.0]}
        for h in (slow, fast):
            h._clock = lambda c=clocks[h]: c[0]
        works = await _join([slow, fast], ack=True)
        await ch.put("s", weight=1)
        await ch.put("f", weight=1)
        for h, work, seconds in ((slow, works[0], 1.0), (fast, works[1], 0.25)):
            item = await work
            clocks[h][0] += seconds
            h.task_done(item)
            await h.stats(timeout=5)
        for i in range(10):
            await ch.put(i, weight=1)
        stats = await ch.stats()
        assert stats.consumer("c0:0").speed == pytest.approx(1.0)
        assert stats.consumer("c1:0").speed == pytest.approx(4.0)
        assert (stats.consumer("c0:0").pending_count, stats.consumer("c1:0").pending_count) == (2, 8)


async def test_performance_aware_places_by_declared_speed_before_measuring(driver, comms):
    """A consumer's declared speed (``comm.channel(name, speed=...)``) stands in until it
    is measured: the first batch is placed at once, 3 to 1."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-hint", policy="performance_aware", in_process=True)
        slow_comm, fast_comm = await comms(2)
        slow = await slow_comm.channel("p-hint", speed=1.0)
        fast = await fast_comm.channel("p-hint", speed=3.0)
        with pytest.raises(ValueError):
            await slow_comm.channel("p-hint", speed=0)
        await _join([slow, fast])
        for i in range(8):
            await ch.put(i, weight=1)
        stats = await ch.stats()
        assert (stats.consumer("c0:0").pending_count, stats.consumer("c1:0").pending_count) == (2, 6)
        assert stats.consumer("c0:0").speed is None          # stats show what was measured


async def test_most_free_memory_and_a_user_policy(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("p-mem", policy="most_free_memory", in_process=True)
        cs = [await comm.channel("p-mem", free_memory=lambda gib=gib: gib << 30)
              for comm, gib in zip(await comms(2), (1, 8))]
        works = await _join(cs)
        for i in range(3):
            await ch.put(i)
        assert await works[1] == 0
        assert (await ch.stats()).consumer("c1:0").free_device_memory == 8 << 30
        assert await cs[1].get_batch(timeout=5) == [1, 2]

        user = await driver.create_channel("p-user", policy=wc.ToLastJoined)
        cs = [await comm.channel("p-user") for comm in await comms(3)]
        works = await _join(cs)
        for i in range(2):
            await user.put(i)
        assert await works[2] == 0 and await cs[2].get(timeout=5) == 1
        assert (await user.stats()).policy == "ToLastJoined"


# -- lifecycle, API surface ------------------------------------------------------------------------
async def test_work_api_iteration_stats_and_acks(driver):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("api", in_process=True)
        get_work = ch.async_get(ack=True)
        put_works = [ch.async_put(np.arange(i + 1), weight=i) for i in range(3)]
        for w in put_works:
            assert await w is None
        first = await get_work
        assert np.array_equal(first, [0]) and ch.unacked == 1
        with pytest.raises(ValueError):
            ch.task_done(np.arange(1))                  # not the object get returned
        ch.task_done(first)
        assert ch.unacked == 0
        stats = await ch.stats()
        assert stats.get_count == 1 and stats.length == 2 and stats.put_count == 3
        assert stats.bytes_in == 8 * (1 + 2 + 3)
        assert "api" in str(stats) and "driver:0" in str(stats)
        await ch.flush(timeout=5)
        await ch.close()
        await ch.close()                                # idempotent
        assert [len(a) async for a in ch] == [2, 3]


async def test_open_missing_or_duplicate_channel(driver):
    async with asyncio.timeout(30):
        with pytest.raises(rlinf.CommTimeoutError):
            await driver.channel("nobody", timeout=0.3)
        await driver.create_channel("dup", in_process=True)
        with pytest.raises(ValueError):
            await driver.create_channel("dup")
        with pytest.raises(ValueError):
            await driver.create_channel("bad:name")
        with pytest.raises(ValueError):
            await driver.create_channel("x", policy="no-such-policy")


async def test_cluster_create_channel_is_stopped_with_the_cluster():
    async with asyncio.timeout(60):
        async with rlinf.Cluster() as cluster:
            ch = await cluster.create_channel("owned", policy="round_robin")
            await ch.put({"a": 1})
            assert await ch.get(timeout=5) == {"a": 1}
            async with cluster.connect("probe:0") as probe:
                pid = next(w.pid for w in await probe.peers() if w.address == "channel.owned:0")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_large_item_is_written_once_and_only_its_descriptor_passes_the_server(cluster, driver, comms):
    """Same node: the producer writes the item into its shared memory once; the channel
    process forwards a reference to it (no copy of its own); the consumer maps the
    producer's bytes; the producer's slot comes back once the consumer drops the item."""
    async with asyncio.timeout(60):
        await driver.create_channel("relayed")
        (consumer,) = await comms(1)
        out = await driver.channel("relayed")
        into = await consumer.channel("relayed")
        item = {"obs": np.arange(1 << 20, dtype=np.float32), "step": 7}
        await out.put(item, weight=2.0)
        await out.flush()
        got = await into.get(timeout=30)
        assert got["step"] == 7 and np.array_equal(got["obs"], item["obs"])
        server = next(p for p in await driver.peers() if p.address == "channel.relayed:0")
        reader = consumer._lifecycle.shm.reader
        assert any(n.startswith(f"rlinf-{server.pid}-") for n in reader._private), reader._private
        assert not any(n.startswith(f"rlinf-{server.pid}-") for n in reader._shared), reader._shared
        assert driver._lifecycle.shm.pool.busy == 1                       # held for the consumer
        del got                                                 # release: consumer -> server -> producer
        await until(lambda: driver._lifecycle.shm.pool.busy == 0, timeout=30, what="the producer's slot to come back")
        await out.close()


async def test_a_huge_max_items_is_no_limit_and_breaks_nothing(driver, comms):
    """It failed at encoding, failing the whole handle (and the puts queued with it)."""
    async with asyncio.timeout(30):
        await driver.create_channel("mi", in_process=True)
        [h] = await _handles(comms, "mi", 1)
        for i in range(3):
            await h.put(i)
        assert await h.get_batch(max_items=2**64, timeout=10) == [0, 1, 2]
        await h.put("after")
        assert await h.get(timeout=10) == "after"
        with pytest.raises(ValueError):
            await h.get_batch(max_items=0)


async def test_put_nowait_gets_the_space_an_idle_handle_leased(driver, comms):
    """The creator's handle leased the only space of the channel at its hello: a
    put_nowait elsewhere asks for it back (as a blocking put does)."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("pn", maxsize=1, in_process=True)
        [producer] = await _handles(comms, "pn", 1)

        def put_nowait() -> bool:
            try:
                producer.put_nowait("x")
            except rlinf.WouldBlock:
                return False
            return True

        assert not put_nowait()                  # no lease yet: asked for one
        await until(put_nowait, what="put_nowait to get the space")
        await producer.flush(timeout=10)
        assert (await ch.stats(timeout=10)).length == 1


async def test_concurrent_closes_all_return(driver, comms):
    async with asyncio.timeout(30):
        await driver.create_channel("cc", in_process=True)
        a, b = await _handles(comms, "cc", 2)
        assert await asyncio.gather(a.close(timeout=10), b.close(timeout=10)) == [None, None]


async def test_task_done_after_detach_says_the_item_went_back(driver, comms):
    async with asyncio.timeout(30):
        ch = await driver.create_channel("td", in_process=True)
        first, second = await _handles(comms, "td", 2)
        await ch.put({"job": 1})
        item = await first.get(ack=True, timeout=10)
        await first.detach()
        with pytest.raises(rlinf.ClosedError, match="detached"):
            first.task_done(item)
        assert await second.get(timeout=10) == {"job": 1}


async def test_a_batch_acked_together_reports_its_time_once(driver, comms):
    """8 items of one get_batch, finished 0.5 s later (the handle's clock): the consumer
    ran at 16 weight per second, not 8 / (8 x 0.5 s) = 2."""
    async with asyncio.timeout(30):
        ch = await driver.create_channel("sp", in_process=True, policy="performance_aware")
        [consumer] = await _handles(comms, "sp", 1)
        now = [1000.0]
        consumer._clock = lambda: now[0]                          # the time the handle reports
        for i in range(8):
            await ch.put(i)
        await ch.flush(timeout=10)
        batch = await consumer.get_batch(timeout=10, ack=True)
        assert len(batch) == 8
        now[0] += 0.5                                              # the "work"
        consumer.task_done(*batch)
        await consumer.flush(timeout=10)

        async def speed():
            return (await ch.stats(timeout=10)).consumer("c0:0").speed

        await until(speed, what="the consumer's speed to be reported")
        assert await speed() == pytest.approx(16.0)
