"""A producer group and a consumer group placed by Ray, exchanging tensors through rlinf.

Ray places and supervises the workers (each rank is a Ray actor with its own resources);
rlinf moves the data between them directly. Producers put rollouts (dicts of torch
tensors) into the channel "rollouts"; consumers take them until the channel is closed
and drained. Ray is not on the data path: items go from producer to channel to
consumer over rlinf's transports (shared memory on one node, TCP across nodes).

Run:  python examples/ray_pipeline.py                      # starts a local Ray
      RAY_ADDRESS=<head>:6379 python examples/ray_pipeline.py   # joins a Ray cluster
      python examples/ray_pipeline.py --launcher local      # the same program, no Ray
"""

import argparse
import asyncio
import os

import rlinf


async def producer(comm, n_items: int) -> int:
    import torch

    channel = await comm.channel("rollouts")
    torch.manual_seed(int(comm.address.split(":")[1]))
    for step in range(n_items):
        obs = torch.randn(256, 64)                          # 64 KiB of observations
        await channel.put({"source": comm.address, "step": step, "obs": obs, "total": obs.sum()})
    await channel.flush()                                   # all of them reached the channel
    return n_items


async def consumer(comm) -> tuple[int, str]:
    import torch

    channel = await comm.channel("rollouts")
    consumed = 0
    async for item in channel:                              # ends after close() + drain
        assert torch.allclose(item["obs"].sum(), item["total"])
        consumed += 1
    return consumed, comm.info.node_id


def _ray_options(n_workers: int) -> tuple[dict, str]:
    """Connect to Ray; the spawn options and the manager's bind address to use."""
    import ray

    import rlinf.ray

    if os.environ.get("RAY_ADDRESS"):
        rlinf.ray.init()                                    # the cluster of RAY_ADDRESS
    else:                                                   # a local Ray, 1 logical CPU per rank
        rlinf.ray.init(address="local", num_cpus=n_workers, include_dashboard=False)
    hosts = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    # Actors on other machines must reach the manager: all interfaces there, loopback here.
    bind = "tcp://0.0.0.0:0" if len(hosts) > 1 else "tcp://127.0.0.1:0"
    return {"launcher": "ray", "resources": {"num_cpus": 1}}, bind


async def main(launcher: str, producers: int, consumers: int, items: int) -> None:
    if launcher == "ray":
        options, bind = _ray_options(producers + consumers)
        spread, pack = {"placement": "spread"}, {"placement": "pack"}
    else:
        options, bind, spread, pack = {}, "tcp://127.0.0.1:0", {}, {}
    async with rlinf.Cluster(bind=bind) as cluster:
        channel = await cluster.create_channel("rollouts", maxsize=16)
        learners = await cluster.spawn(consumer, "learner", n=consumers, **options, **pack)
        actors = await cluster.spawn(producer, "actor", n=producers, args=(items,), **options, **spread)
        produced = sum(await actors.join(timeout=120))
        await channel.close()                               # learners drain, then stop
        results = await learners.join(timeout=120)
        consumed = [n for n, _node in results]
        print(f"produced {produced}, consumed {sum(consumed)} (per learner: {consumed}) "
              f"with launcher {launcher}")
        for address, (_n, node) in zip(learners.addresses, results):
            print(f"{address} ran on node {node}")
        assert produced == sum(consumed)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=["ray", "local"], default="ray")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--items", type=int, default=20, help="rollouts per producer")
    args = parser.parse_args()
    asyncio.run(main(args.launcher, args.producers, args.consumers, args.items))
