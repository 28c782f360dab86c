"""A producer/consumer pipeline through a channel (a named queue in its own process).

Three actor processes put weighted rollouts into the channel "rollouts"; two learner
processes take them until the channel is closed and drained. The channel balances
items across learners (FIFO competition by default); ``maxsize`` applies backpressure.

Run:  python examples/channel_pipeline.py
"""

import asyncio

import numpy as np

import rlinf


async def actor(comm, n_items: int) -> int:
    channel = await comm.channel("rollouts")
    rng = np.random.default_rng(int(comm.address.split(":")[1]))
    for i in range(n_items):
        length = int(rng.integers(4, 64))                 # episodes differ in cost...
        item = {"source": comm.address, "obs": rng.random((length, 8), dtype=np.float32)}
        await channel.put(item, weight=float(length))     # ...and say so with a weight
    await channel.flush()                                 # all of them reached the channel
    return n_items


async def learner(comm) -> int:
    channel = await comm.channel("rollouts")
    consumed = 0
    async for item in channel:                            # ends after close() + drain
        consumed += 1
        assert item["obs"].shape[1] == 8
    return consumed


async def main() -> None:
    async with rlinf.Cluster() as cluster:
        channel = await cluster.create_channel("rollouts", maxsize=16)
        learners = await cluster.spawn(learner, "learner", n=2)
        actors = await cluster.spawn(actor, "actor", n=3, args=(20,))
        produced = sum(await actors.join(timeout=120))
        await channel.close()                             # learners drain, then stop
        consumed = await learners.join(timeout=120)
        print(f"produced {produced}, consumed {sum(consumed)} (per learner: {consumed})")
        assert produced == sum(consumed)


if __name__ == "__main__":
    asyncio.run(main())
