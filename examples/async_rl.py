"""Asynchronous RL through a channel: generation overlaps training, staleness stays bounded.

Three rollout processes generate with the policy version they hold and tag each rollout
with it; the trainer takes 8 rollouts per version, "trains", and advances the channel's
version. The channel is created with ``max_staleness=1`` and ``batch_size=8``: each
rollout is wrapped in ``async with channel.admit(version)``, which waits until a rollout
started now will be at most one version old when the trainer gets it (pacing: nothing is
generated only to be thrown away). The grant says which version the trainer is at; a
rollout worker that is behind refreshes its weights first.

Run:  python examples/async_rl.py
"""

import asyncio

import numpy as np

import rlinf

MAX_STALENESS, BATCH, VERSIONS = 1, 8, 6


async def rollout(comm) -> int:
    channel = await comm.channel("rollouts")
    rng = np.random.default_rng(int(comm.address.split(":")[1]))
    version, made = 0, 0                               # the policy version this worker holds
    while True:
        try:
            async with channel.admit(version) as admission:
                if admission.current > version:       # the trainer moved on: refresh the weights
                    version = admission.current        # (a real worker pulls them here)
                length = int(rng.lognormal(3, 1))      # long-tailed generation time
                await asyncio.sleep(length / 20_000)
                tokens = rng.integers(0, 100, size=length)
                await channel.put({"tokens": tokens, "version": version}, weight=length, version=version)
                made += 1
        except rlinf.ClosedError:                      # the trainer is done
            return made


async def main() -> None:
    async with rlinf.Cluster() as cluster:
        channel = await cluster.create_channel("rollouts", max_staleness=MAX_STALENESS, batch_size=BATCH)
        workers = await cluster.spawn(rollout, "rollout", n=3)
        for version in range(VERSIONS):
            batch: list = []
            while len(batch) < BATCH:
                batch += await channel.get_batch(max_items=BATCH - len(batch), timeout=60)
            behind = [version - item["version"] for item in batch]
            assert max(behind) <= MAX_STALENESS
            await asyncio.sleep(0.005)                 # a training step
            await channel.advance(version + 1)         # the new policy
            print(f"version {version}: trained on {len(batch)} rollouts, versions behind {behind}", flush=True)
        stats = await channel.stats()
        await channel.close()
        made = await workers.join(timeout=60)
        print(f"rollouts made {sum(made)}, trained {VERSIONS * BATCH}, stale dropped {stats.stale_dropped}, "
              f"staleness max {stats.consumers[0].staleness_max}")
        assert stats.stale_dropped == 0


if __name__ == "__main__":
    asyncio.run(main())
