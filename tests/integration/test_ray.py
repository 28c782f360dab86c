"""The Ray launcher on a two-node Ray cluster on this machine: placement, node identity
and routing, GPU assignment, lost and restarted actors, and a channel pipeline.

(The group call/join/kill/failure tests of ``test_cluster.py`` run over both launchers.)
Worker targets are defined here, at module level: the actors import this module.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

import rlinf

ray = pytest.importorskip("ray")
import rlinf.ray  # noqa: E402  (needs ray)

from .test_cluster import _shm_of  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
RAY_NODES = 2   # the ray_cluster fixture (conftest.py) starts two Ray nodes on this machine


# -- worker targets ------------------------------------------------------------------
class Probe(rlinf.Worker):
    def where(self) -> dict:
        return {"rlinf": self.comm.info.node_id, "ray": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    async def send_big(self, dst: str, nbytes: int) -> None:
        await self.comm.send(np.ones(nbytes // 8), dst, tag=3, timeout=30)

    def transports(self) -> dict[str, int]:
        """Messages sent so far, per transport."""
        return {k: v.msgs for k, v in self.comm.stats().transports.items()}

    async def take(self, src: str) -> float:
        return float((await self.comm.recv(src, tag=3, timeout=30)).sum())

    async def share(self, nbytes: int = 1 << 20) -> int:
        """Send a large array to the driver, who keeps it: our shared memory stays in use."""
        await self.comm.send(np.ones(nbytes // 8), "driver:0", tag=5, timeout=30)
        return os.getpid()

    async def hang(self) -> None:
        await self.comm.send("hanging", "driver:0", tag=6, timeout=30)
        await asyncio.Event().wait()


async def produce_arrays(comm, channel: str, n: int):
    ch = await comm.channel(channel, timeout=30)
    rank = int(comm.address.split(":")[1])
    for i in range(n):
        await ch.put({"obs": np.full((64, 1024), float(rank * n + i), dtype=np.float32), "step": i}, timeout=30)
    await ch.flush(timeout=30)
    return n


async def consume_arrays(comm, channel: str):
    ch = await comm.channel(channel, timeout=30)
    await comm.send("attached", "driver:0", tag=4, timeout=30)
    seen = []
    async with asyncio.timeout(60):
        async for item in ch:
            seen.append(float(item["obs"][0, 0]))
            assert float(item["obs"].sum()) == seen[-1] * 64 * 1024
    return seen


# -- helpers ------------------------------------------------------------
def _pg_states() -> list[str]:
    return [pg["state"] for pg in ray.util.placement_group_table().values()]


async def _next_event(events, address: str, kinds: tuple[str, ...]) -> str:
    async for event in events:
        if event.address == address and event.kind in kinds:
            return event.kind
    raise AssertionError("events ended")


# -- tests ---------------------------------------------------------------------------
async def test_node_identity_and_routing_follow_ray_placement(ray_cluster, cluster, driver):
    head, other = ray_cluster
    async with asyncio.timeout(90):
        assert driver.info.node_id == head                     # rlinf.ray.init() made it so
        here, there = await asyncio.gather(
            cluster.spawn(Probe, "here", 2, launcher="ray", placement=f"node:{head}"),
            cluster.spawn(Probe, "there", 1, launcher="ray", placement=f"node:{other}"))
        where = await here.call("where") + await there.call("where")
        assert [(w["rlinf"], w["ray"]) for w in where] == [(head, head), (head, head), (other, other)]
        assert [w["pid"] for w in where] == here.pids + there.pids
        sent = []
        for dst, receiver in (("here:1", here.call("take", "here:0", ranks=[1])),
                              ("there:0", there.call("take", "here:0"))):
            await asyncio.gather(here.call("send_big", dst, 4 << 20, ranks=[0]), receiver)
            sent.append((await here.call("transports", ranks=[0]))[0])   # counted once it is received
        assert sent[0] == {"shm": 1}                           # same Ray node: shared memory
        assert sent[1] == {"shm": 1, "bulk": 1}                # the other node: the bulk TCP stream
        assert await there.join() == [None]


async def test_placement_groups_gpus_and_release(ray_cluster, cluster):
    head, other = ray_cluster
    async with asyncio.timeout(90):
        spread, gpus = await asyncio.gather(
            cluster.spawn(Probe, "spread", 2, launcher="ray", placement="strict_spread"),
            cluster.spawn(Probe, "gpu", 2, launcher="ray", placement="pack", resources={"num_gpus": 1}))
        assert sorted(w["ray"] for w in await spread.call("where")) == sorted([head, other])
        gpu_where = await gpus.call("where")
        assert sorted(w["gpus"] for w in gpu_where) == ["0", "1"]          # one GPU each, from Ray
        assert {w["ray"] for w in gpu_where} == {head}                      # packed where the GPUs are
        assert _pg_states().count("CREATED") == 2
        await asyncio.gather(spread.join(), gpus.join())
        assert "CREATED" not in _pg_states()                                # released on join

        with pytest.raises(rlinf.CommTimeoutError):                          # no node has 4 GPUs
            await cluster.spawn(Probe, "greedy", 1, launcher="ray", placement="pack",
                                resources={"num_gpus": 4}, ready_timeout=2)
        assert "CREATED" not in _pg_states() and "PENDING" not in _pg_states()

        with pytest.raises(ValueError, match="placement must be"):
            await cluster.spawn(Probe, "x", launcher="ray", placement="everywhere")
        with pytest.raises(ValueError, match="reserves resources"):
            await cluster.spawn(Probe, "x", launcher="ray", placement="pack", resources={"num_cpus": 0})
        with pytest.raises(TypeError, match="resources"):
            await cluster.spawn(Probe, "x", launcher="ray", resources={"num_cpus": -1})
        with pytest.raises(ValueError, match="max_restarts"):
            await cluster.spawn(Probe, "x", launcher="ray", max_restarts=-2)
        with pytest.raises(ValueError, match="launcher='ray'"):
            await cluster.spawn(Probe, "x", placement="pack")
        with pytest.raises(ValueError, match="launcher must be"):
            await cluster.spawn(Probe, "x", launcher="slurm")


async def _watch(events, address: str, kind: str) -> asyncio.Future:
    """The next ``kind`` event of ``address``; the iterator is subscribed on return."""
    fut = asyncio.ensure_future(_next_event(events, address, (kind,)))
    await asyncio.sleep(0)
    return fut


async def _restartable(cluster, name: str, node: str):
    """One Probe rank on ``node`` that Ray restarts once."""
    return await cluster.spawn(Probe, name, 1, launcher="ray", max_restarts=1, placement=f"node:{node}")


async def test_dead_actor_is_lost_and_a_restart_registers_again(ray_cluster, cluster, driver):
    head, _ = ray_cluster
    async with asyncio.timeout(90):
        events = driver.events()
        pending = await _watch(events, "phoenix:0", "lost")
        group = await _restartable(cluster, "phoenix", head)   # on the driver's node: shared memory
        first = group.pids[0]
        await group.call("share")                                   # owns shared memory now
        held = await driver.recv("phoenix:0", tag=5)
        segments = _shm_of(first)
        assert segments
        hanging = asyncio.ensure_future(group.call("hang"))
        assert await driver.recv("phoenix:0", tag=6) == "hanging"  # the call is pending there
        os.kill(first, signal.SIGKILL)                              # dies: Ray restarts it
        assert await pending == "lost"
        assert await _next_event(events, "phoenix:0", ("joined",)) == "joined"
        with pytest.raises(rlinf.WorkerFailedError, match="restarted"):
            await hanging
        where = await group.call("where")                           # the new incarnation serves
        assert where[0]["pid"] == group.pids[0] != first
        del held
        assert [s for s in segments if os.path.exists(s)] == []    # the old one's were removed

        await group.kill(0)                                         # ray.kill: no restart
        assert await _next_event(events, "phoenix:0", ("lost",)) == "lost"
        with pytest.raises(rlinf.WorkerFailedError, match="killed by group.kill"):
            await group.call("where")
        assert "alive=0" in repr(group)
        await events.aclose()


async def test_join_during_a_restart_still_finishes_the_new_incarnation(ray_cluster, cluster, driver):
    """join() on a Worker without run() whose actor is being restarted: the new
    incarnation is told to finish once it is ready, so join returns instead of timing out."""
    head, _ = ray_cluster
    async with asyncio.timeout(90):
        events = driver.events()
        joined = await _watch(events, "lazarus:0", "joined")
        group = await _restartable(cluster, "lazarus", head)
        assert await joined == "joined"
        restarted = await _watch(events, "lazarus:0", "joined")
        os.kill(group.pids[0], signal.SIGKILL)       # Ray restarts it ...
        joining = asyncio.ensure_future(group.join(timeout=60))   # ... while we join
        assert await restarted == "joined"
        assert await joining == [None]
        await events.aclose()


async def test_channel_pipeline_across_nodes(ray_cluster, cluster, driver):
    head, other = ray_cluster
    n = 20
    async with asyncio.timeout(90):
        ch = await cluster.create_channel("rollouts")
        consumers = await cluster.spawn(consume_arrays, "learner", 2, args=("rollouts",), launcher="ray",
                                        placement=f"node:{head}")
        for address in consumers.addresses:
            assert await driver.recv(address, tag=4) == "attached"
        producers = await cluster.spawn(produce_arrays, "actor", 2, args=("rollouts", n), launcher="ray",
                                        placement=f"node:{other}")
        assert await producers.join(timeout=60) == [n, n]
        await ch.close(timeout=10)
        seen = await consumers.join(timeout=60)
        assert sorted(v for got in seen for v in got) == [float(i) for i in range(2 * n)]
