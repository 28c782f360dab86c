"""GPU buffers between processes: mixed CPU+GPU nested objects, bfloat16 and
non-contiguous tensors, forced staged fallback, and a kill -9 during a GPU transfer."""

from __future__ import annotations

import asyncio
import os

import pytest

import rlinf

from . import workers_gpu

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.multiproc


def _payload():
    dev = torch.device("cuda", 0)
    return {
        "w": torch.randn(256, 256, device=dev),
        "bf": torch.randn(1000, device=dev).to(torch.bfloat16),
        "nc": torch.arange(64, device=dev, dtype=torch.float32).reshape(8, 8).t(),   # non-contiguous
        "big": torch.randn(8 << 20, device=dev),                                       # 32 MiB
        "cpu": torch.ones(3),
        "meta": {"step": 7},
    }


async def test_mixed_cpu_gpu_object_round_trip(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.gpu_echo, "g", 1, args=("driver:0", 2))
        obj = _payload()
        for _ in range(2):
            await driver.send(obj, "g:0")
            reply = await driver.recv("g:0")
            assert reply["devices"] == ["cpu", "cuda:0"]
            back = reply["obj"]
            for key in ("w", "bf", "nc", "big"):
                assert back[key].is_cuda and back[key].dtype == obj[key].dtype
                assert torch.equal(back[key], obj[key]), key
            assert torch.equal(back["cpu"], obj["cpu"]) and back["meta"] == {"step": 7}
        assert await group.join() == [0]


async def test_forced_staged_fallback(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.gpu_echo, "s", 1, args=("driver:0", 1),
                                    env={"RLINF_DISABLE_TRANSPORTS": "nccl,cuda_ipc"})
        t = torch.randn(1 << 20, device="cuda")
        await driver.send(t, "s:0")
        reply = await driver.recv("s:0")
        assert torch.equal(reply["obj"], t)
        await group.join()


async def test_peer_killed_during_gpu_transfer(cluster, driver):
    async with asyncio.timeout(120):
        group = await cluster.spawn(workers_gpu.gpu_echo, "k", 1, args=("driver:0", 10))
        pending = driver.async_recv("k:0")
        os.kill(group.pids[0], 9)
        with pytest.raises(rlinf.PeerLostError):
            await pending


async def test_gpu_items_through_a_channel_arrive_on_the_consumers_device(cluster, driver):
    async with asyncio.timeout(180):
        ch = await driver.create_channel("gpu-items")
        group = await cluster.spawn(workers_gpu.channel_consumer, "q", 1, args=("driver:0", "gpu-items", 4))
        items = [torch.full((1 << 18,), float(i), device="cuda") for i in range(4)]
        for t in items:
            await ch.put(t)
        report = await driver.recv("q:0")
        assert report == [("cuda:0", float(t.sum())) for t in items]
        await group.join()
