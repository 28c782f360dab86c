"""An asyncio rollout server: one worker serves generation requests from many actors.

The server loops on ``recv_any``, answers each request to its sender, and follows
actors joining, leaving and dying through ``comm.events()``. Actors come in two waves;
the second wave is killed mid-run: the server drops them and carries on.

Run:  python examples/rollout_server.py
"""

import asyncio

import numpy as np

import rlinf

REQUEST, REPLY, PROGRESS = 1, 2, 3


async def server(comm) -> dict[str, int]:
    served: dict[str, int] = {}

    async def follow_membership() -> None:
        async for event in comm.events():                    # joined / left / lost
            if event.address.startswith("actor"):
                print(f"server: {event.address} {event.kind}", flush=True)

    watcher = asyncio.create_task(follow_membership())
    weights = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    while True:
        request, src = await comm.recv_any(tag=REQUEST)
        if request == "shutdown":
            break
        actions = np.argmax(request["obs"] @ weights, axis=1)   # "generation"
        try:
            await comm.send({"step": request["step"], "actions": actions}, src, tag=REPLY, timeout=30)
        except rlinf.PeerLostError:                          # the actor died meanwhile
            continue
        served[src] = served.get(src, 0) + 1
    watcher.cancel()
    return served


async def actor(comm, steps: int, report_at: int = -1) -> int:
    rng = np.random.default_rng()
    for step in range(steps):
        if step == report_at:                                # tell the driver we are going
            await comm.send(step, "driver:0", tag=PROGRESS)
        obs = rng.random((8, 16), dtype=np.float32)
        await comm.send({"step": step, "obs": obs}, "server:0", tag=REQUEST)
        reply = await comm.recv("server:0", tag=REPLY, timeout=60)
        assert reply["step"] == step and reply["actions"].shape == (8,)
    return steps


async def main() -> None:
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as driver:
        srv = await cluster.spawn(server, "server")
        wave1 = await cluster.spawn(actor, "actorA", n=3, args=(200,))
        wave2 = await cluster.spawn(actor, "actorB", n=2, args=(10**9, 20))   # would run forever
        for _ in range(len(wave2)):
            await driver.recv_any(tag=PROGRESS, timeout=60)  # both are 20 requests in
        await wave2.kill()                                   # both die mid-conversation
        print("wave 1 done:", await wave1.join(timeout=120), flush=True)
        await driver.send("shutdown", "server:0", tag=REQUEST)
        served = (await srv.join(timeout=60))[0]
        print("requests served per actor:", served)
        assert all(served[f"actorA:{r}"] == 200 for r in range(3))
        assert all(served[f"actorB:{r}"] >= 20 for r in range(2))


if __name__ == "__main__":
    asyncio.run(main())
