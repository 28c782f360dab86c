"""Weight sync into preallocated tensors with ``recv_into``.

A trainer updates a model and pushes its ``state_dict()`` to rollout workers after
every step. Each rollout worker receives straight into its own model's parameters
(``recv_into(model.state_dict(), ...)``): no new tensors, the parameters keep their
storage, and a shape or dtype mismatch raises before anything is written.

Run:  python examples/weight_sync.py
"""

import asyncio

import torch

import rlinf


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


async def trainer(comm, rollouts: list[str], steps: int) -> list[float]:
    model, sums = make_model(), []
    for _ in range(steps):
        with torch.no_grad():                                 # stand-in for a training step
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        state = model.state_dict()
        await asyncio.gather(*(comm.send(state, dst) for dst in rollouts))
        sums.append(checksum(model))
    return sums


async def rollout(comm, steps: int) -> list[float]:
    model, sums = make_model(), []
    storage = [p.data_ptr() for p in model.parameters()]
    state = model.state_dict()                                # views of the parameters
    for _ in range(steps):
        await comm.recv_into(state, "trainer:0", timeout=60)
        sums.append(checksum(model))
    assert [p.data_ptr() for p in model.parameters()] == storage   # updated in place
    return sums


async def main() -> None:
    steps = 5
    async with rlinf.Cluster() as cluster:
        rollouts = await cluster.spawn(rollout, "rollout", n=2, args=(steps,))
        train = await cluster.spawn(trainer, "trainer", args=(rollouts.addresses, steps))
        expected = (await train.join(timeout=120))[0]
        for address, sums in zip(rollouts.addresses, await rollouts.join(timeout=120)):
            assert sums == expected, (address, sums, expected)
            print(f"{address}: {steps} weight versions received in place, checksums match")


if __name__ == "__main__":
    asyncio.run(main())
