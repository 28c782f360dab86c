"""Module-level worker targets and policies for the channel tests (spawn imports them)."""

from __future__ import annotations

import asyncio

import numpy as np

import rlinf


async def produce(comm, name: str, n: int, keys: tuple = (None,)):
    """Put ``(address, i, key)`` for i in 0..n-1, cycling through ``keys``; then flush."""
    ch = await comm.channel(name, timeout=30)
    for i in range(n):
        key = keys[i % len(keys)]
        await ch.put((comm.address, i, key), weight=1.0 + i % 3, key=key, timeout=30)
    await ch.flush(timeout=30)
    return n


async def consume_all(comm, name: str, prefetch: int = 0):
    """Tell the driver we are attached, get until EndOfChannel; return everything got.

    (A channel ends once closed and drained, so the driver closes it only after every
    consumer is attached.)
    """
    ch = await comm.channel(name, timeout=30, prefetch=prefetch)
    await comm.send("attached", "driver:0", tag=4, timeout=30)
    got = []
    async with asyncio.timeout(60):
        async for item in ch:
            got.append(item)
    return got


async def take_one_and_hang(comm, name: str, ack: bool, prefetch: int = 0):
    """Join as a consumer, tell the driver, take one item, report it, then hang (to be killed)."""
    ch = await comm.channel(name, timeout=30, prefetch=prefetch)
    work = ch.async_get(ack=ack)
    await ch.stats(timeout=30)               # our get reached the server before this reply
    await comm.send("joined", "driver:0", tag=5, timeout=30)
    item = await asyncio.wait_for(work, 30)
    await comm.send(item, "driver:0", tag=6, timeout=30)
    await asyncio.Event().wait()


async def flood_large(comm, name: str, size: int):
    """Put numbered large arrays until killed."""
    ch = await comm.channel(name, timeout=30)
    i = 0
    while True:
        await ch.put({"i": i, "data": np.full(size, i % 251, dtype=np.uint8)}, timeout=30)
        i += 1


class ToLastJoined(rlinf.LoadBalancePolicy):
    """A user policy: every item goes to the consumer that joined last."""

    def select_consumer(self, item, consumers):
        return len(consumers) - 1


async def create_and_hang(comm, name: str):
    """Create a channel (its own process), tell the driver, then hang until killed."""
    await comm.create_channel(name)
    await comm.send("created", "driver:0", tag=5, timeout=30)
    await asyncio.Event().wait()


async def put_and_leave(comm, name: str, n: int, size: int, close: bool):
    """Put ``n`` numbered items (with ``size`` bytes of data each) and leave at once: the
    worker function returns (the runtime closes the communicator), or with ``close``
    it closes its communicator itself first. Nothing is flushed or awaited."""
    ch = await comm.channel(name, timeout=30)
    for i in range(n):
        await ch.put({"i": i, "data": np.full(size, i % 251, dtype=np.uint8)}, timeout=30)
    if close:
        await comm.aclose()
    return n


async def admit_and_hang(comm, name: str, version: int):
    """Enter ``ch.admit(version)``, tell the driver, then hang inside the block until killed."""
    ch = await comm.channel(name, timeout=30)
    async with ch.admit(version, timeout=30):
        await comm.send("admitted", "driver:0", tag=5, timeout=30)
        await asyncio.Event().wait()


async def paced_producer(comm, name: str, rollouts: int, seed: int):
    """An asynchronous-RL producer: per rollout, wait for admission with the version it
    holds, take the channel's current version if it moved on meanwhile (a weight
    refresh), "generate" (a short random time) and put inside the block."""
    rng = np.random.default_rng(seed)
    ch = await comm.channel(name, timeout=30)
    version = 0
    for i in range(rollouts):
        async with ch.admit(version, timeout=30) as admission:
            version = max(version, admission.current)
            await asyncio.sleep(float(rng.uniform(0, 0.004)))    # the rollout's work
            await ch.put((comm.address, i, version), version=version, timeout=30)
    await ch.flush(timeout=30)
    return rollouts
