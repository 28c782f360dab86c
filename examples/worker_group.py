"""A controller drives a group of workers: ``rlinf.Worker`` subclasses and ``group.call``.

The driver spawns three "rollout" worker processes. Each holds a toy policy parameter,
plays episodes when asked (``group.call("rollout", ...)``), and takes new parameters
(``group.call("set_param", ...)``). The controller averages the returns, "trains" and
pushes the new parameter: the single-controller pattern of RL frameworks, minus Ray.

Run:  python examples/worker_group.py
"""

import asyncio

import numpy as np

import rlinf


class Rollout(rlinf.Worker):
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.param = 0.0

    async def setup(self) -> None:              # runs once, after self.rank etc. are set
        self.rng = np.random.default_rng(self.seed + self.rank)

    def set_param(self, value: float) -> None:  # plain methods can be called remotely...
        self.param = value

    async def rollout(self, episodes: int) -> float:   # ...and so can async ones
        # toy environment: reward is highest when the action is close to 1.0
        actions = self.param + 0.1 * self.rng.standard_normal(episodes)
        return float(np.mean(-((actions - 1.0) ** 2)))


async def main() -> None:
    async with rlinf.Cluster() as cluster:
        group = await cluster.spawn(Rollout, "rollout", n=3, kwargs={"seed": 0})
        print("workers:", group.addresses)
        param = 0.0
        for step in range(5):
            returns = await group.call("rollout", episodes=100, timeout=60)
            print(f"step {step}: param={param:.3f} mean return={np.mean(returns):.4f}")
            param += 0.5 * (1.0 - param)                       # "training"
            await group.call("set_param", param, timeout=60)
        print("ranks 0 and 2 only:", await group.call("rollout", 10, ranks=[0, 2], timeout=60))
        await group.join(timeout=60)                           # Workers without run() finish
    print("done")


if __name__ == "__main__":
    asyncio.run(main())
