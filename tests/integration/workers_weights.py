"""Module-level worker targets for the weight store tests (spawn imports them)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch


def mixed_tree(version: int) -> dict:
    """A nested tree of every kind the store must carry, its values derived from
    ``version``: bf16, fp16, fp32, int64, bool, 0-d, a non-contiguous source, numpy."""
    g = torch.Generator().manual_seed(version)
    wide = torch.randn(6, 10, generator=g)
    return {
        "embed": {"weight": torch.randn(32, 16, generator=g).to(torch.bfloat16)},
        "layers": [
            {"w": wide.t(), "b": torch.randn(6, generator=g).to(torch.float16)},       # w: non-contiguous
            {"w": torch.randn(3, 5, generator=g)[:, ::2], "steps": torch.tensor(version, dtype=torch.int64)},
        ],
        "scale": torch.tensor(0.5 + version),                                               # 0-d
        "mask": torch.rand(7, generator=g) > 0.5,
        "table": (np.arange(12, dtype=np.int64).reshape(3, 4) * version, np.full((2,), version, np.float32)),
        "empty": torch.empty(0, 4),
    }


def empty_like_tree(tree):
    """Preallocated targets shaped like ``tree`` (contiguous; sentinel-filled)."""
    if isinstance(tree, dict):
        return {k: empty_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(empty_like_tree(v) for v in tree)
    if isinstance(tree, np.ndarray):
        return np.full(tree.shape, 7, tree.dtype)
    return torch.full(tuple(tree.shape), 7, dtype=tree.dtype)


def flat_tree(version: int, n: int = 8, numel: int = 1 << 16) -> dict:
    """``n`` fp32 tensors of ``numel`` elements, every element equal to ``version`` (a
    torn read shows as two different values)."""
    return {f"t{i}": torch.full((numel,), float(version)) for i in range(n)}


async def publish_and_wait(comm, name: str, versions: int):
    """Publish versions 1..versions of :func:`mixed_tree`, tell the driver, then stay (to
    be killed or cancelled)."""
    ws = await comm.weights(name)
    for v in range(1, versions + 1):
        await ws.publish(mixed_tree(v), v)
    await comm.send("published", "driver:0", tag=5, timeout=30)
    await asyncio.Event().wait()


async def publish_back_to_back(comm, name: str, versions: int):
    """Publish versions 1..versions of :func:`flat_tree` as fast as it can, once the
    driver said go; tell it the count and stay (the data lives here) until it says done."""
    ws = await comm.weights(name)
    await ws.publish(flat_tree(0), 0)
    await comm.send("ready", "driver:0", tag=5, timeout=30)
    await comm.recv("driver:0", tag=6, timeout=30)
    for v in range(1, versions + 1):
        await ws.publish(flat_tree(v), v)
    await comm.send(versions, "driver:0", tag=5, timeout=30)
    await comm.recv("driver:0", tag=6, timeout=60)


async def pull_and_check(comm, name: str, pulls: int):
    """Pull :func:`flat_tree` ``pulls`` times into the same tensors; return the torn
    reads (a pull whose tensors hold anything but the version it returned) and the
    versions seen."""
    ws = await comm.weights(name)
    into = flat_tree(-1)
    torn, seen = 0, set()
    await comm.send("ready", "driver:0", tag=5, timeout=30)
    for i in range(pulls):
        # the first pull waits for the race to begin (a loaded machine may start it late)
        v = await ws.pull(into, newer_than=0 if i == 0 else None, timeout=30)
        seen.add(v)
        torn += any(not bool((t == float(v)).all()) for t in into.values())
    return torn, len(seen)


async def pull_mixed(comm, name: str, version: int):
    """Get version ``version`` of :func:`mixed_tree` (from another node: the test sets
    ``RLINF_NODE_ID``), into fresh tensors and into preallocated ones; tell the driver,
    and once it says so (every puller is done: a relay's copy leaves with its process)
    return both trees and the bytes moved by path."""
    ws = await comm.weights(name)
    tree, v = await ws.get(newer_than=version - 1, timeout=30)
    into = empty_like_tree(mixed_tree(0))
    assert await ws.pull(into, timeout=30) == v
    stats = await ws.stats()
    await comm.send("pulled", "driver:0", tag=5, timeout=30)
    await comm.recv("driver:0", tag=6, timeout=30)
    return v, tree, into, stats.this_bytes_by_path


async def publish_shard(comm, name: str, shard: int, num_shards: int, version: int):
    """Publish this rank's shard (keys ``s<shard>.*``) of ``version``."""
    ws = await comm.weights(name)
    await ws.publish({f"s{shard}": flat_tree(version, n=2, numel=100)}, version, shard=shard,
                     num_shards=num_shards)
    return version
