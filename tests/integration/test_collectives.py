"""Collectives on groups formed on the fly, between real processes (loopback only).

The scenarios live in ``workers_coll``; every member, the driver included, runs the same
one and checks its own results.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

import rlinf
from rlinf.collectives.reshard import reshard

from . import workers, workers_coll

pytestmark = pytest.mark.multiproc


async def _spmd(cluster, driver, scenario: str, layout: dict[str, tuple[int, dict]], *args):
    """Spawn ``layout`` ({name: (n, env)}) running ``scenario`` over every spawned worker
    plus the driver, run it in the driver too; returns the driver's and workers' results."""
    members = ["driver:0"] + [f"{name}:{i}" for name, (n, _) in layout.items() for i in range(n)]
    groups = [await cluster.spawn(workers_coll.run, name, n, args=(scenario, members, *args), env=env)
              for name, (n, env) in layout.items()]
    mine = await getattr(workers_coll, scenario)(driver, members, *args)
    theirs = [r for g in groups for r in await g.join(timeout=60)]
    return mine, theirs


@pytest.mark.parametrize("layout", [
    {"w": (1, {})},                                                      # 2 processes, 1 node
    {"a": (1, {}), "b": (2, {"RLINF_NODE_ID": "node-b"}), "c": (1, {"RLINF_NODE_ID": "node-c"})},  # 5, 3 nodes
], ids=["2procs-1node", "5procs-3nodes"])
async def test_every_collective(cluster, driver, layout):
    async with asyncio.timeout(120):
        mine, theirs = await _spmd(cluster, driver, "every_collective", layout)
        assert theirs == [mine] * len(theirs)              # one group id everywhere
        if "c" in layout:
            # driver:0's large broadcast sent one copy to each other node (to its leader)
            # and one to its same-node member: nothing big to the rest
            out = driver.stats().peers
            moved = {peer: s.bytes_out + s.shared_out for peer, s in out.items()}
            assert moved["b:0"] > 8 << 20 and moved["a:0"] > 8 << 20
            assert out["a:0"].shared_out > 8 << 20 and out["b:0"].shared_out == 0   # same node: shared memory
            assert moved["b:1"] < 1 << 20 and moved["c:0"] < 1 << 20


async def test_groups_overlap_mismatch_and_time_out(cluster, driver):
    """Overlapping groups concurrent with p2p; mismatched calls raise ValueError instead
    of hanging (and the group stays usable); a member that never comes times out."""
    async with asyncio.timeout(120):
        mine, theirs = await _spmd(cluster, driver, "group_behaviour", {"m": (2, {})})
        jobs, roots, timeouts = mine
        assert jobs == 3 and [t[0] for t in theirs] == [4, 3]     # m:0 is in both pairs
        # different roots: both believed roots (driver:0 and m:0) see each other's data
        assert roots[0] == theirs[0][1][0] == "ValueError"
        assert theirs[1][1][0] in ("ValueError", "ok")
        for outcomes in (roots, theirs[0][1], theirs[1][1]):
            assert outcomes[1:] == ["ValueError", "ValueError"]       # kind, then shape
        for outcomes in (timeouts, theirs[0][2]):
            assert [what for what, _ in outcomes] == ["timeout", "timeout"]
            assert all(0.5 < elapsed < 5 for _, elapsed in outcomes)
        assert len(theirs[1]) == 2


async def test_single_member_group_and_bad_arguments(driver):
    async with asyncio.timeout(30):
        g = driver.group(["driver:0"])
        assert (g.size, g.rank, g.members) == (1, 0, ["driver:0"])
        assert await g.broadcast({"x": 1}, root="driver:0") == {"x": 1}
        assert await g.gather(5, root=0) == [5]
        assert await g.scatter([7], root=0) == 7
        assert await g.all_gather("a") == ["a"] and await g.all_to_all(["b"]) == ["b"]
        await g.barrier()
        assert np.array_equal(await g.all_reduce(np.arange(3), op="max"), np.arange(3))
        assert await g.async_all_gather(1) == [1]
        with pytest.raises(ValueError, match="root"):
            await g.broadcast(1, root="nobody:0")
        with pytest.raises(ValueError, match="one object per member"):
            await g.scatter([1, 2], root=0)
        with pytest.raises(TypeError, match="numpy array or a torch tensor"):
            await g.all_reduce([1, 2])
        with pytest.raises(ValueError, match="op must be"):
            await g.all_reduce(np.ones(2), op="prod")
        with pytest.raises(TypeError, match="floating-point"):
            await g.all_reduce(np.ones(2, dtype=np.int64), op="mean")
        with pytest.raises(TypeError, match="numeric array"):
            await g.all_reduce(np.array([1, "a"], dtype=object))
        frozen = np.ones(2)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            await g.all_reduce(frozen, inplace=True)
        with pytest.raises(ValueError, match="share memory"):       # checked before anything moves
            await g.all_reduce(torch.ones(1).expand(4), inplace=True)
        with torch.inference_mode():
            inference = torch.ones(2)
        with pytest.raises(ValueError, match="inference"):
            await g.all_reduce(inference, inplace=True)
        with pytest.raises(ValueError, match="not a member"):
            driver.group(["a:0", "b:0"])
        with pytest.raises(ValueError, match="duplicate"):
            driver.group(["driver:0", "driver:0"])
        with pytest.raises(TypeError):
            driver.group("driver:0")
        assert "size=1" in repr(g) and g.id in repr(g)
        # resharding within one worker: 1 -> 1
        shard = workers_coll.batch(0, 4, 0)
        workers_coll.assert_same(await reshard(driver, shard, src=["driver:0"], dst=["driver:0"]), shard)
        with pytest.raises(ValueError, match="must pass its shard"):
            await reshard(driver, None, src=["driver:0"], dst=["driver:0"])
        with pytest.raises(ValueError, match="neither a source nor a destination"):
            await reshard(driver, shard, src=["a:0"], dst=["b:0"])
        with pytest.raises(ValueError, match="same size along dim"):
            await reshard(driver, {"a": np.ones(2), "b": np.ones(3)}, src=["driver:0"], dst=["driver:0"])


async def test_errors_before_a_call_starts_reach_the_other_members(cluster, driver):
    """An async_* Work cancelled before its task ran, and a bad reshard argument, used
    to fail only where they happened: the other members waited forever."""
    async with asyncio.timeout(60):
        async with cluster.connect("peer:0") as peer:
            members = ["driver:0", "peer:0"]
            mine, theirs = driver.group(members), peer.group(members)
            work = mine.async_all_gather("never")
            assert work.cancel()                              # its task has not run yet
            with pytest.raises(rlinf.RlinfError, match="failed on driver:0: cancelled"):
                await theirs.all_gather("waits", timeout=10)
            assert await asyncio.gather(mine.all_gather(1), theirs.all_gather(2)) == [[1, 2], [1, 2]]

            shard = np.arange(8.0).reshape(4, 2)
            results = await asyncio.gather(
                reshard(driver, shard, src=["driver:0"], dst=["peer:0"], dim="0"),
                reshard(peer, None, src=["driver:0"], dst=["peer:0"], dim=0, timeout=10),
                return_exceptions=True)
            assert [type(r) for r in results] == [TypeError, TypeError], results
            assert "dim must be an int" in str(results[1])
            _, got = await asyncio.gather(                    # numpy integers are ints
                reshard(driver, shard, src=["driver:0"], dst=["peer:0"], dim=np.int64(0)),
                reshard(peer, None, src=["driver:0"], dst=["peer:0"], dim=0, timeout=10))
            assert np.array_equal(got, shard)


async def test_reshard_sources_that_disagree_fail_everywhere(cluster, driver):
    """float32 from one source and float64 from another: numpy promoted where they met
    and not elsewhere, so destinations got different dtypes."""
    async with asyncio.timeout(60):
        async with cluster.connect("s1:0") as s1, cluster.connect("d1:0") as d1:
            src, dst = ["driver:0", "s1:0"], ["d1:0"]
            results = await asyncio.gather(
                reshard(driver, {"x": np.ones((4, 2), np.float32)}, src=src, dst=dst, timeout=20),
                reshard(s1, {"x": np.ones((4, 2), np.float64)}, src=src, dst=dst, timeout=20),
                reshard(d1, None, src=src, dst=dst, timeout=20), return_exceptions=True)
            assert [type(r) for r in results] == [ValueError] * 3, results
            assert all("differ at $['x']" in str(r) and "float64" in str(r) for r in results)
            same = await asyncio.gather(                        # key order does not matter
                reshard(driver, {"x": np.ones((4, 2)), "y": np.ones(4)}, src=src, dst=dst, timeout=20),
                reshard(s1, {"y": np.ones(2), "x": np.ones((2, 2))}, src=src, dst=dst, timeout=20),
                reshard(d1, None, src=src, dst=dst, timeout=20))
            assert same[2]["x"].shape == (6, 2) and same[2]["y"].shape == (6,)


async def test_a_timeout_fails_the_late_member_too_and_leaves_nothing_queued(cluster, driver):
    """The late member used to succeed on the data sent before the timeout, and late
    messages could stay queued (holding shared memory) once the drain window closed."""
    async with asyncio.timeout(60):
        async with cluster.connect("late:0") as late:
            members = ["driver:0", "late:0"]
            early, tardy = driver.group(members), late.group(members)
            with pytest.raises(rlinf.CommTimeoutError):
                await early.all_gather(np.ones(1 << 18), timeout=0.3)      # 2 MiB: shared memory
            await driver.send("after the abort", "late:0", tag=7)          # one link: in order
            await late.recv("driver:0", tag=7, timeout=10)
            with pytest.raises(rlinf.CommTimeoutError, match="failed on driver:0"):
                await tardy.all_gather(np.ones(1 << 18), timeout=10)
            # the next call's messages come after the late ones on every link
            assert await asyncio.gather(early.all_gather(1), tardy.all_gather(2)) == [[1, 2], [1, 2]]
            assert len(driver._mailbox) == 0 and len(late._mailbox) == 0


async def test_killed_member_fails_every_survivor(cluster, driver):
    async with asyncio.timeout(90):
        victims = await cluster.spawn(workers.idle, "victim", 2)
        first = ["driver:0", "k:0", "victim:0"]
        second = ["driver:0", "k:0", "victim:1"]
        waiters = await cluster.spawn(workers_coll.run, "k", 1,
                                      args=("wait_for_victims", first, second, ["victim:0", "victim:1"]))
        for _ in range(2):
            await driver.recv_any(tag=7)                   # both victims are up
        killed_at = []
        for members, start, victim in (
                (first, lambda g: g.async_broadcast(None, root="victim:0", timeout=60), 0),
                (second, lambda g: g.async_all_gather("driver:0", timeout=60), 1)):
            await driver.recv("k:0", tag=8)               # the other survivor is (about to be) in the call
            work = start(driver.group(members))
            assert not work.done()
            killed_at.append(time.time())
            os.kill(victims.pids[victim], 9)
            with pytest.raises(rlinf.PeerLostError) as info:
                await work
            assert info.value.peer == f"victim:{victim}"
            assert time.time() - killed_at[-1] < 3.0
        for outcomes in await waiters.join(timeout=30):
            for (what, at, peer), victim, killed in zip(outcomes, ("victim:0", "victim:1"), killed_at):
                assert (what, peer) == ("lost", victim)
                assert at - killed < 3.0


async def test_a_restarted_member_meets_the_others_in_a_group_made_under_a_new_name(cluster, driver):
    """A restarted member numbers its calls from 0 while the others go on: the group is
    made again under a new name (a named group is another group, numbered from 0)."""
    async with asyncio.timeout(90):
        members = ["driver:0", "w:0"]
        first = await cluster.spawn(workers_coll.gather_in_named_group, "w", 1, args=(members, "", True))
        assert await driver.group(members).all_gather("driver:0", timeout=30) == ["driver:0", "w:0"]
        await driver.recv("w:0", tag=9, timeout=30)
        await first.kill()
        again = await cluster.spawn(workers_coll.gather_in_named_group, "w", 1, args=(members, "gen1", False))
        assert await driver.group(members, name="gen1").all_gather("driver:0", timeout=30) == members
        assert await again.join(timeout=30) == [members]
        with pytest.raises(TypeError, match="name"):
            driver.group(members, name=1)
        assert driver.group(members, name="gen1").id != driver.group(members).id
