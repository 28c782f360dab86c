"""The weight store with CUDA tensors: captured from the GPU, pulled into GPU tensors
(staged through the holder's host buckets)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.multiproc


async def test_gpu_tensors_publish_and_pull_in_place(cluster, driver):
    async with asyncio.timeout(60):
        source = {"w": torch.randn(64, 32, device="cuda").t(), "b": torch.randn(7, device="cuda").to(torch.bfloat16)}
        ws = await driver.weights("gpu")
        await ws.publish(source, 1)
        reader = await cluster.connect("reader:0").start()
        try:
            rs = await reader.weights("gpu")
            into = {"w": torch.empty(32, 64, device="cuda"), "b": torch.empty(7, device="cuda", dtype=torch.bfloat16)}
            storage = into["w"].data_ptr()
            assert await rs.pull(into, timeout=30) == 1
            assert into["w"].data_ptr() == storage
            assert torch.equal(into["w"], source["w"]) and torch.equal(into["b"], source["b"])
            tree, v = await rs.get(timeout=30)
            assert v == 1 and tree["w"].device.type == "cpu" and torch.equal(tree["w"], source["w"].cpu())
        finally:
            await reader.aclose()
