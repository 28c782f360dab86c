"""Weight sync through the versioned weight store.

A trainer publishes its model's ``state_dict()`` after every step; rollout workers pull
the newest version into their own model's parameters between episodes, each at its own
pace (``pull(into=..., newer_than=...)``: in place, never a mix of two versions, a
shape or dtype mismatch raises before anything is written). The store keeps a version
while a pull reads it, so the trainer never waits for its readers.

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


async def trainer(comm, steps: int) -> dict[int, float]:
    ws = await comm.weights("policy")
    model, sums = make_model(), {}
    for version in range(1, steps + 1):
        with torch.no_grad():                                 # stand-in for a training step
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        await asyncio.sleep(0.02)
        await ws.publish(model.state_dict(), version)         # captured: training may go on
        sums[version] = checksum(model)
    await comm.recv("rollout:0", timeout=60)                  # the data lives here: stay until
    await comm.recv("rollout:1", timeout=60)                  # the rollouts are done
    return sums


async def rollout(comm, steps: int) -> dict[int, float]:
    ws = await comm.weights("policy")
    model, seen, version = make_model(), {}, 0
    rank = int(comm.address.rpartition(":")[2])
    storage = [p.data_ptr() for p in model.parameters()]
    state = model.state_dict()                                # views of the parameters
    while version < steps:
        version = await ws.pull(into=state, newer_than=version, timeout=60)
        seen[version] = checksum(model)
        await asyncio.sleep(0.03 * (rank + 1))               # an episode; rank 1 is slower
    assert [p.data_ptr() for p in model.parameters()] == storage   # updated in place
    await comm.send("done", "trainer:0")
    return seen


async def main() -> None:
    steps = 20
    async with rlinf.Cluster() as cluster:
        rollouts = await cluster.spawn(rollout, "rollout", n=2, args=(steps,))   # they wait for version 1
        train = await cluster.spawn(trainer, "trainer", args=(steps,))
        published = (await train.join(timeout=120))[0]
        for address, seen in zip(rollouts.addresses, await rollouts.join(timeout=120)):
            assert all(published[v] == s for v, s in seen.items()), (address, seen)
            print(f"{address}: pulled {len(seen)} of {steps} versions in place, "
                  f"last {max(seen)}; checksums match their versions")


if __name__ == "__main__":
    asyncio.run(main())
