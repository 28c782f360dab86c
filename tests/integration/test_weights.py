"""The versioned weight store (issue 25, DESIGN.md §2): round trips, mismatches, waiting,
sharded visibility, atomicity under a racing publisher, a killed publisher, other nodes."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import torch

import rlinf

from . import workers_weights as ww
from .same import assert_same
from .wait import until

pytestmark = pytest.mark.multiproc


def _contiguous(tree):
    """What a pull must produce for ``tree``: the same values, contiguous."""
    if isinstance(tree, dict):
        return {k: _contiguous(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_contiguous(v) for v in tree)
    return tree.copy() if isinstance(tree, np.ndarray) else tree.contiguous()


async def test_a_mixed_tree_round_trips_from_another_process(cluster, driver):
    async with asyncio.timeout(60):
        publisher = await cluster.spawn(ww.publish_and_wait, "pub", args=("mixed", 2))
        await driver.recv("pub:0", tag=5)
        ws = await driver.weights("mixed")
        assert await ws.latest() == 2
        tree, v = await ws.get()
        assert v == 2
        assert_same(_contiguous(ww.mixed_tree(2)), tree)
        into = ww.empty_like_tree(ww.mixed_tree(0))
        into["layers"][0]["w"] = torch.empty(6, 10).t()          # a non-contiguous target too
        storage = into["embed"]["weight"].data_ptr()
        assert await ws.pull(into) == 2
        assert_same(_contiguous(ww.mixed_tree(2)), _contiguous(into))
        assert into["embed"]["weight"].data_ptr() == storage     # in place
        stats = await ws.stats()
        assert stats.latest == 2 and stats.this_pulls == 2 and "driver:0" in stats.subscribers
        assert "weight store 'mixed'" in str(stats)
        assert publisher.addresses == ["pub:0"]


async def test_publish_captures_and_versions_must_grow(driver):
    async with asyncio.timeout(30):
        ws = await driver.weights("capture")
        src = {"w": torch.zeros(1000)}
        await ws.publish(src, 3)
        src["w"].fill_(9)                                 # after publish returned: not in version 3
        tree, v = await ws.get()
        assert v == 3 and bool((tree["w"] == 0).all())
        for bad in (3, 2):
            with pytest.raises(ValueError, match="not newer"):
                await ws.publish(src, bad)
        with pytest.raises(TypeError):
            await ws.publish({"w": "not a tensor"}, 4)
        with pytest.raises(ValueError, match="shard"):
            await ws.publish(src, 4, shard=2, num_shards=2)
        await ws.publish(src, 4)
        assert (await ws.get())[1] == 4


async def test_a_second_publisher_of_the_same_shard_is_refused(cluster, driver):
    async with asyncio.timeout(30):
        await (await driver.weights("one")).publish({"w": torch.zeros(4)}, 1)
        other = await cluster.connect("other:0").start()
        try:
            with pytest.raises(rlinf.AddressInUseError):
                await (await other.weights("one")).publish({"w": torch.zeros(4)}, 2)
        finally:
            await other.aclose()


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "dtype"])
async def test_a_mismatch_names_the_key_and_copies_nothing(driver, case):
    async with asyncio.timeout(30):
        ws = await driver.weights(f"mm-{case}")
        await ws.publish({"a": torch.ones(4), "b": {"c": torch.ones(2, 3)}, "z": torch.ones(5)}, 1)
        into = {"a": torch.zeros(4), "b": {"c": torch.zeros(2, 3)}, "z": torch.zeros(5)}
        expect = {"missing": "b/c: published, but not", "extra": "q: not in the published",
                  "shape": r"b/c: the target is float32\[3, 2\]", "dtype": r"b/c: the target is float64"}[case]
        if case == "missing":
            del into["b"]["c"]
        elif case == "extra":
            into["q"] = torch.zeros(1)
        elif case == "shape":
            into["b"]["c"] = torch.zeros(3, 2)
        else:
            into["b"]["c"] = torch.zeros(2, 3, dtype=torch.float64)
        with pytest.raises(ValueError, match=expect):
            await ws.pull(into, timeout=10)
        assert all(bool((t == 0).all()) for t in (into["a"], into["z"], *into["b"].values(), *into.get("q", [])))
        stats = await ws.stats()
        assert stats.versions[1]["readers"] == 0            # the failed pull released its version


async def test_newer_than_waits_and_times_out(cluster, driver):
    async with asyncio.timeout(30):
        ws = await driver.weights("wait")
        reader = await cluster.connect("reader:0").start()
        try:
            rs = await reader.weights("wait")
            early = asyncio.create_task(rs.pull({"w": torch.zeros(3)}, timeout=20))   # before the store exists
            await ws.publish({"w": torch.ones(3)}, 1)
            assert await early == 1
            later = asyncio.create_task(rs.pull({"w": torch.zeros(3)}, newer_than=1, timeout=20))
            await until(lambda: _waiting(ws, 1), what="the pull to wait")
            assert not later.done()
            await ws.publish({"w": torch.full((3,), 2.0)}, 2)
            assert await later == 2
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(rlinf.CommTimeoutError, match="newer than 2"):
                await rs.pull({"w": torch.zeros(3)}, newer_than=2, timeout=0.3)
            assert 0.25 < loop.time() - start < 3
            await until(lambda: _waiting(ws, 0), what="the timed-out pull to stop waiting")
            await ws.publish({"w": torch.full((3,), 3.0)}, 3)
            stats = await ws.stats()
            assert list(stats.versions) == [3], stats       # nobody holds 1 or 2 (the late grant went back)
        finally:
            await reader.aclose()


async def test_a_cancelled_pull_holds_nothing(driver):
    async with asyncio.timeout(30):
        ws = await driver.weights("cancel")
        await ws.publish({"w": torch.ones(3)}, 1)
        task = asyncio.create_task(ws.pull({"w": torch.zeros(3)}, newer_than=1))
        await until(lambda: _waiting(ws, 1), what="the pull to wait")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: _waiting(ws, 0), what="the directory to drop the cancelled pull")
        await ws.publish({"w": torch.full((3,), 2.0)}, 2)
        await ws.publish({"w": torch.full((3,), 3.0)}, 3)
        stats = await ws.stats()
        assert list(stats.versions) == [3] and stats.pulls == 0, stats


async def _waiting(ws, n: int) -> bool:
    return (await ws.stats()).waiting == n


async def test_a_sharded_version_is_visible_only_when_complete(cluster, driver):
    async with asyncio.timeout(60):
        ws = await driver.weights("sharded")
        part = {"s0": ww.flat_tree(1, n=2, numel=100)}
        await ws.publish(part, 1, shard=0, num_shards=2)
        assert await ws.latest() is None
        with pytest.raises(rlinf.CommTimeoutError):
            await ws.get(timeout=0.3)
        waiting = asyncio.create_task(ws.get(timeout=20))
        await until(lambda: _waiting(ws, 1), what="the get to wait")
        other = await cluster.connect("shard1:0").start()
        try:
            await (await other.weights("sharded")).publish({"s1": ww.flat_tree(1, n=2, numel=100)}, 1, shard=1,
                                                            num_shards=2)
            tree, v = await waiting
            assert v == 1 and await ws.latest() == 1
            assert_same({"s0": ww.flat_tree(1, n=2, numel=100), "s1": ww.flat_tree(1, n=2, numel=100)}, tree)
            into = {"s1": ww.flat_tree(-1, n=2, numel=100), "s0": ww.flat_tree(-1, n=2, numel=100)}
            assert await ws.pull(into) == 1              # its keys in another order: matched by key
            assert_same(tree, {"s0": into["s0"], "s1": into["s1"]})
            with pytest.raises(ValueError, match="not 1 of 3"):
                await (await other.weights("sharded")).publish({"s1": torch.zeros(1)}, 2, shard=1, num_shards=3)
            third = await cluster.connect("shard2:0").start()
            try:                                            # the directory checks the count as well
                with pytest.raises(ValueError, match="has 2 shard.*num_shards=3"):
                    await (await third.weights("sharded")).publish({"s2": torch.zeros(1)}, 2, shard=2, num_shards=3)
            finally:
                await third.aclose()
        finally:
            await other.aclose()
        # its shard went with it: no complete version is left, and a pull says so
        with pytest.raises(rlinf.PeerLostError, match="shard1|weights.sharded:1"):
            await ws.get(timeout=10)


async def test_pulls_racing_back_to_back_publishes_never_mix_versions(cluster, driver):
    """W3's check, smaller: every pulled tree holds one version only."""
    async with asyncio.timeout(120):
        # one OpenMP thread each: torch's spin-waiting threads would starve three busy
        # processes on a 2-CPU machine (ten times slower, and no more racing)
        one = {"OMP_NUM_THREADS": "1"}
        publisher = await cluster.spawn(ww.publish_back_to_back, "pub", args=("race", 100), env=one)
        await driver.recv("pub:0", tag=5)
        readers = await cluster.spawn(ww.pull_and_check, "reader", n=2, args=("race", 250), env=one)
        for address in readers.addresses:
            await driver.recv(address, tag=5)
        await driver.send("go", "pub:0", tag=6)
        assert await driver.recv("pub:0", tag=5) == 100
        results = await readers.join(timeout=100)
        await driver.send("done", "pub:0", tag=6)
        await publisher.join(timeout=30)
        assert [torn for torn, _ in results] == [0, 0], results
        assert all(seen > 1 for _, seen in results), results     # they did race the publisher


async def test_a_killed_publisher_fails_waiting_pulls(cluster, driver):
    async with asyncio.timeout(60):
        await cluster.spawn(ww.publish_and_wait, "pub", args=("doomed", 1))
        await driver.recv("pub:0", tag=5)
        ws = await driver.weights("doomed")
        assert (await ws.get())[1] == 1
        waiting = asyncio.create_task(ws.pull(ww.empty_like_tree(ww.mixed_tree(0)), newer_than=1, timeout=30))
        await until(lambda: _waiting(ws, 1), what="the pull to wait")
        pid = next(w.pid for w in await driver.peers() if w.address == "weights.doomed:0")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(rlinf.PeerLostError):
            await waiting
        await until(lambda: not [n for n in os.listdir("/dev/shm") if n.startswith(f"rlinf-{pid}-")],
                    what="the dead publisher's segments to be swept")
        # a restarted trainer (here: this process) makes the store live again
        await ws.publish({"w": torch.ones(3)}, 7)
        other = await cluster.connect("late:0").start()
        try:
            assert (await (await other.weights("doomed")).get(timeout=10))[1] == 7
            assert (await ws.get(timeout=10))[1] == 7
        finally:
            await other.aclose()


async def test_pullers_on_another_node_get_the_bytes_over_the_network_once(cluster, driver):
    """Two pullers on another node, two pulls each: the first to ask fetches the version
    over the network into buckets of its own (the node's relay); every other pull there
    copies from those. Freed with the version: nothing is left behind."""
    async with asyncio.timeout(60):
        ws = await driver.weights("far")
        await ws.publish(ww.mixed_tree(4), 4)
        size = (await ws.stats()).versions[4]["bytes"]
        pullers = await cluster.spawn(ww.pull_mixed, "far", n=2, args=("far", 4), env={"RLINF_NODE_ID": "node-far"})
        for address in pullers.addresses:
            await driver.recv(address, tag=5)
        stats = await ws.stats()
        for address in pullers.addresses:
            await driver.send("go", address, tag=6)
        results = await pullers.join(timeout=30)
        for v, tree, into, _ in results:
            assert v == 4
            assert_same(_contiguous(ww.mixed_tree(4)), tree)
            assert_same(_contiguous(ww.mixed_tree(4)), into)
        assert stats.bytes_by_path == {"net": size, "shm": 3 * size}, stats
        assert sorted(sum((list(r[3]) for r in results), [])).count("net") == 1
        assert list(stats.versions) == [4] and stats.versions[4]["readers"] == 0


async def test_a_pull_cancelled_as_its_grant_arrives_holds_nothing(cluster, driver):
    async with asyncio.timeout(60):
        ws = await driver.weights("late-cancel")
        await ws.publish({"w": torch.ones(3)}, 1)
        reader = await cluster.connect("reader:0").start()
        try:
            rs = await reader.weights("late-cancel")
            settle, box = rs._calls.settle, {}

            def settle_then_cancel(message):          # the cancel lands in the grant's loop tick
                settled = settle(message)
                if message[0] == "grant":
                    box["pull"].cancel()
                return settled

            rs._calls.settle = settle_then_cancel
            box["pull"] = asyncio.create_task(rs.pull({"w": torch.zeros(3)}))
            with pytest.raises(asyncio.CancelledError):
                await box["pull"]
            rs._calls.settle = settle
            for v in (2, 3):
                await ws.publish({"w": torch.full((3,), float(v))}, v)
            await until(lambda: _held(ws, [3]), what="version 1 to be given back")
        finally:
            await reader.aclose()


async def _held(ws, versions: list[int]) -> bool:
    return list((await ws.stats()).versions) == versions


async def test_a_cancelled_shard_publish_keeps_its_bucket_while_the_directory_serves_it(cluster, driver):
    """Shard 1's publish is cancelled after the directory registered it (the answer is
    late): its bucket must stay version 1's, not be refilled by shard 1's next publish."""
    async with asyncio.timeout(60):
        w0 = await driver.weights("sh-cancel")
        other = await cluster.connect("shard1:0").start()
        try:
            w1 = await other.weights("sh-cancel")
            await w0.publish({"a": torch.full((1 << 16,), 1.0)}, 1, shard=0, num_shards=2)
            await w1.publish({"b": torch.full((1 << 16,), 0.0)}, 0, shard=1, num_shards=2)   # makes its holder
            calls = w1._holder._calls
            settle = calls.settle
            calls.settle = lambda message: True                  # the directory's answer is late
            publish = asyncio.create_task(w1.publish({"b": torch.full((1 << 16,), 1.0)}, 1, shard=1, num_shards=2))
            await until(lambda: _latest_is(w0, 1), what="version 1 to be visible")
            publish.cancel()
            with pytest.raises(asyncio.CancelledError):
                await publish
            calls.settle = settle
            for v in (2, 3):                                    # shard 1 goes on alone
                await w1.publish({"b": torch.full((1 << 16,), float(v))}, v, shard=1, num_shards=2)
            tree, v = await w0.get(timeout=10)
            assert v == 1 and bool((tree["a"] == 1).all()) and bool((tree["b"] == 1).all())
        finally:
            await other.aclose()


async def _latest_is(ws, version: int) -> bool:
    return await ws.latest() == version


def _pause_first_copy(ws) -> tuple[asyncio.Event, asyncio.Event]:
    """Make the first copy of ``ws``'s pulls wait: ``entered`` is set when it would
    start, and it starts once ``go`` is set."""
    entered, go, run = asyncio.Event(), asyncio.Event(), ws._run

    async def paused(fn, *args, size, running):
        if not entered.is_set():
            entered.set()
            await go.wait()
        await run(fn, *args, size=size, running=running)

    ws._run = paused
    return entered, go


async def test_a_pull_whose_bucket_is_refilled_under_it_fails(cluster):
    """The directory leaves while a same-node pull copies a sharded version: shard 1's
    holder frees its versions and its next publish refills the bucket. The pull, which
    has not heard of the departure, sees the bucket's stamp change and fails rather
    than return a torn tree."""
    async with asyncio.timeout(60):
        s0, s1, reader = [await cluster.connect(f"{n}:0").start() for n in ("s0", "s1", "reader")]
        try:
            w0, w1 = await s0.weights("refill"), await s1.weights("refill")
            await w0.publish({"a": torch.ones(1000)}, 1, shard=0, num_shards=2)
            await w1.publish({"b": torch.ones(1000)}, 1, shard=1, num_shards=2)
            rs = await reader.weights("refill")
            rs._on_gone = lambda address, incarnation: None      # it hears of no departure
            entered, go = _pause_first_copy(rs)
            pull = asyncio.create_task(rs.get(timeout=30))
            await entered.wait()                                 # granted, about to copy shard 0
            await s0.aclose()                                    # the directory leaves
            await until(lambda: not w1._holder.versions, what="shard 1's holder to free its versions")
            with pytest.raises(rlinf.PeerLostError):             # refills the bucket, finds no directory
                await w1.publish({"b": torch.full((1000,), 2.0)}, 2, shard=1, num_shards=2)
            go.set()
            with pytest.raises(rlinf.PeerLostError, match="torn"):
                await pull
        finally:
            for comm in (reader, s1, s0):
                await comm.aclose()


async def test_a_shard_publish_without_its_directory_times_out(driver):
    async with asyncio.timeout(30):
        ws = await driver.weights("no-directory")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(rlinf.CommTimeoutError, match="not published within"):
            await ws.publish({"b": torch.ones(3)}, 1, shard=1, num_shards=2, timeout=0.5)
        assert loop.time() - start < 5


async def test_a_fetch_from_another_node_runs_a_window_ahead_and_stops_when_cancelled(cluster, driver,
                                                                                      monkeypatch):
    async with asyncio.timeout(60):
        from rlinf.weights import _holder, store

        monkeypatch.setattr(store, "CHUNK", 1 << 20)                  # a chunk per tensor
        ws = await driver.weights("window")
        await ws.publish({f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)}, 1)
        holder = ws._holder
        monkeypatch.setenv("RLINF_NODE_ID", "node-far")
        far = cluster.connect("far:0")
        monkeypatch.delenv("RLINF_NODE_ID")
        await far.start()
        try:
            rs = await far.weights("window")
            run = rs._run
            entered, _ = _pause_first_copy(rs)
            pull = asyncio.create_task(rs.get(timeout=30))
            await entered.wait()                                      # the first chunk is in
            [fetch] = holder._fetching.values()                       # 4 ahead, 1 more per chunk taken
            [(_, queue)] = rs._fetches.values()
            await until(lambda: fetch.next == _holder.WINDOW + 1 and queue.qsize() == _holder.WINDOW,
                        what="the window to arrive")
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            await until(lambda: not holder._fetching, what="the holder to stop sending")
            assert fetch.next == _holder.WINDOW + 1                    # nothing more was sent
            rs._run = run
            tree, v = await rs.get(timeout=30)
            assert v == 1 and all(bool((tree[f"t{i}"] == i).all()) for i in range(12))
        finally:
            await far.aclose()


async def test_latest_and_stats_time_out_when_the_directory_does_not_answer(driver):
    async with asyncio.timeout(30):
        ws = await driver.weights("mute")
        await ws.publish({"w": torch.ones(3)}, 1)
        holder = ws._holder
        handle = holder._handle
        holder._handle = lambda src, message: None if message[0] in ("latest", "stats") else handle(src, message)
        for ask in (ws.latest, ws.stats):
            with pytest.raises(rlinf.CommTimeoutError, match="no answer"):
                await ask(timeout=0.3)
        holder._handle = handle
        assert await ws.latest(timeout=10) == 1


def _on_node(cluster, monkeypatch, address: str, node: str):
    """A communicator (not started) of this process that says it runs on ``node``."""
    monkeypatch.setenv("RLINF_NODE_ID", node)
    try:
        return cluster.connect(address)
    finally:
        monkeypatch.delenv("RLINF_NODE_ID")


def _pause_copy(ws, nth: int, fn: str | None = None) -> asyncio.Event:
    """Make the ``nth`` copy of ``ws`` (of ``fn`` only, if given) wait for good (until
    its pull is cancelled): the event is set when it starts waiting."""
    entered, run, calls = asyncio.Event(), ws._run, [0]

    async def paused(f, *args, size, running):
        if fn is None or f.__name__ == fn:
            calls[0] += 1
            if calls[0] == nth:
                entered.set()
                await asyncio.Event().wait()
        await run(f, *args, size=size, running=running)

    ws._run = paused
    return entered


class _SlowLink:
    """``core`` with a slow link to ``dst``: after the first ``passed`` chunks, what it
    sends there waits (in order) for :meth:`release`, the sends still in flight (their
    zero-copy views of the relay's bucket still to be read)."""

    def __init__(self, core, dst: str, passed: int) -> None:
        self._core, self._dst, self._passed = core, dst, passed
        self.held: list[tuple[tuple, str, asyncio.Future]] = []
        self._released = False

    def __getattr__(self, name):
        return getattr(self._core, name)

    def start_send(self, message, dst, tag):
        if dst == self._dst and not self._released and (self.held or (message[0] == "chunk" and not self._passed)):
            future = asyncio.get_running_loop().create_future()
            self.held.append((message, tag, future))
            return future
        self._passed -= dst == self._dst and message[0] == "chunk"
        return self._core.start_send(message, dst, tag)

    def release(self) -> None:
        self._released = True
        for message, tag, future in self.held:
            sent = self._core.start_send(message, self._dst, tag)
            sent.add_done_callback(lambda s, f=future: f.done() or (
                f.set_exception(s.exception()) if s.exception() else f.set_result(None)))


async def test_a_relay_reuses_its_bucket_only_once_the_chunks_it_forwarded_are_out(cluster, driver, monkeypatch):
    """Relay U forwards every chunk of version 1 to relay D, half of them still on a slow
    link (sends holding views of U's bucket), when U's own pull is cancelled and U then
    relays version 2. Version 2 must not land in the bucket those sends read: D gets
    version 1 whole, never a torn tree."""
    from rlinf.weights import store

    monkeypatch.setattr(store, "CHUNK", 1 << 20)
    n = 6                                                          # chunks, all within the window
    async with asyncio.timeout(60):
        ws = await driver.weights("slow-link")
        await ws.publish(ww.flat_tree(1, n, 1 << 18), 1)
        u = await _on_node(cluster, monkeypatch, "u:0", "node-b").start()
        d = await _on_node(cluster, monkeypatch, "d:0", "node-c").start()
        link = None
        try:
            wu, wd = await u.weights("slow-link"), await d.weights("slow-link")
            link = wu._core = _SlowLink(wu._core, "d:0", n // 2)
            run = wu._run
            entered = _pause_copy(wu, n, "unpack_range")           # every chunk landed and forwarded
            relaying = asyncio.create_task(wu.get(timeout=30))
            await entered.wait()
            pull = asyncio.create_task(wd.get(timeout=30))
            await until(lambda: len(link.held) == n - n // 2, what="D's chunks to be sent")
            relaying.cancel()
            with pytest.raises(asyncio.CancelledError):
                await relaying
            wu._run = run
            await ws.publish(ww.flat_tree(2, n, 1 << 18), 2)
            assert (await wu.get(newer_than=1, timeout=30))[1] == 2      # U relays version 2
            link.release()
            tree, v = await pull
            assert v == 1 and [float(tree[f"t{i}"][0]) for i in range(n)] == [1.0] * n
            assert all(bool((t == 1).all()) for t in tree.values())
        finally:
            if link is not None:
                link.release()
            for comm in (d, u):
                await comm.aclose()


@pytest.mark.parametrize("hears", ["relay", "downstream"])
async def test_the_publisher_leaving_while_a_relay_streams_fails_the_relay_downstream(cluster, monkeypatch, hears):
    """The publisher (the store's directory) leaves while relay U streams version 1 to
    relay D. Whichever hears of it first (U: it frees the version, its stream with it;
    D: its sources free everything), D's pull fails with PeerLostError at once rather
    than wait for chunks that will never come."""
    from rlinf.weights import store

    monkeypatch.setattr(store, "CHUNK", 1 << 20)
    async with asyncio.timeout(60):
        pub = await cluster.connect("trainer:0").start()
        u = await _on_node(cluster, monkeypatch, "u:0", "node-b").start()
        d = await _on_node(cluster, monkeypatch, "d:0", "node-c").start()
        try:
            wp, wu, wd = [await c.weights("leaving") for c in (pub, u, d)]
            await wp.publish(ww.flat_tree(1, 16, 1 << 18), 1)          # 16 chunks
            entered = _pause_copy(wu, 6)                              # U is in the middle of it
            relaying = asyncio.create_task(wu.get(timeout=30))
            await entered.wait()
            pull = asyncio.create_task(wd.get(timeout=30))
            await until(lambda: (1, 0) in wu._streams._by_key and wu._streams._by_key[1, 0]._fetchers,
                        what="D to stream from U")
            deaf = wd if hears == "relay" else wu                     # has not heard of it yet
            deaf._on_gone = lambda address, incarnation: None
            await pub.aclose()
            async with asyncio.timeout(10):
                with pytest.raises(rlinf.PeerLostError):
                    await pull
            relaying.cancel()
            with pytest.raises((asyncio.CancelledError, rlinf.PeerLostError)):
                await relaying
        finally:
            for comm in (d, u, pub):
                await comm.aclose()
