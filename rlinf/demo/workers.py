"""The demo's worker processes: rollout workers and learners (spawned by the driver).

Data flow per iteration ``k`` (learners hold policy version ``k``):

* rollout workers play episodes with the newest weights they have and ``put`` each one
  into the channel, weight = its length, tagged with the policy version that played it.
  They never wait for the learners except for a soft cap: after producing about 1.5x
  their share of an iteration's steps with one version, they wait (up to a second) for
  the next weights, which bounds how stale the queued data gets;
* every learner takes ``steps_per_iter / M`` steps' worth of episodes with
  ``get_batch(target_weight=...)``, dropping any played by a version older than
  ``k - 1``; the learners ``all_gather`` their episode returns and return statistics
  (so each computes the same baseline and the same stopping decision) and
  ``all_reduce`` (sum) their gradients, then take the same Adam step;
* learner 0 ``broadcast``s version ``k + 1`` to the group (learner 0 + rollout workers),
  or a stop message once the mean return of the recent episodes reaches the target or
  the iteration cap is hit, and reports progress to the driver.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

import numpy as np

__all__ = ["rollout_main", "learner_main", "PROGRESS_TAG", "FINISH_TAG", "DEFAULTS"]

#: Hyper-parameters (REINFORCE with reward-to-go and a global return baseline; these
#: solve CartPole-v1 in a few dozen iterations of 4000 steps).
DEFAULTS = {"hidden": 32, "lr": 0.01, "gamma": 0.99}

PROGRESS_TAG = 1
FINISH_TAG = 2
_MAX_LAG = 1            # learners drop episodes played by a policy older than this many versions
_ROLLOUT_SLACK = 1.5    # a rollout worker produces up to this many times its share per version
_WAIT_FOR_WEIGHTS = 1.0  # seconds a capped rollout worker waits for new weights before going on


# torch is imported inside the worker functions, so the driver, which only needs this
# module's names to spawn them, does not pay for importing torch.
def _state(policy) -> dict:
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


async def rollout_main(comm, cfg: dict[str, Any], learner0: str, rollouts: list[str], channel: str,
                       driver: str) -> dict:
    """A rollout worker: play, put episodes into the channel, pick up new weights."""
    import torch

    from . import rl

    torch.set_num_threads(1)
    group = comm.group([learner0, *rollouts])
    ch = await comm.channel(channel)
    rank = rollouts.index(comm.address)
    runner = rl.EnvRunner(cfg["envs"], seed=cfg["seed"] * 1000 + 17 * rank + 1, gamma=cfg["gamma"])
    policy = rl.make_policy(hidden=cfg["hidden"], seed=cfg["seed"])
    share = cfg["steps_per_iter"] / len(rollouts)
    chunk = max(cfg["envs"] * 16, 64)
    stats = {"address": comm.address, "pid": os.getpid(), "episodes": 0, "steps": 0, "put_seconds": 0.0,
             "waits": 0, "versions": 0}
    msg = await group.broadcast(None, root=learner0)
    try:
        while True:
            if msg.get("stop"):
                break
            version = msg["version"]
            policy.load_state_dict(msg["state"])
            stats["versions"] += 1
            pending = asyncio.ensure_future(group.async_broadcast(None, root=learner0))
            produced = 0
            while not pending.done():
                if produced >= _ROLLOUT_SLACK * share:
                    stats["waits"] += 1
                    await asyncio.wait([pending], timeout=_WAIT_FOR_WEIGHTS)
                    if pending.done():
                        break
                episodes = runner.run(policy, chunk)
                started = time.perf_counter()
                for ep in episodes:
                    item = {"obs": ep["obs"], "actions": ep["actions"], "rewards": ep["rewards"],
                            "returns": ep["returns"], "length": ep["length"], "ret": ep["ret"],
                            "version": version, "rollout": comm.address}
                    await ch.put(item, weight=float(ep["length"]))
                    produced += ep["length"]
                    stats["episodes"] += 1
                    stats["steps"] += ep["length"]
                stats["put_seconds"] += time.perf_counter() - started
                await asyncio.sleep(0)   # let the broadcast make progress
            msg = await pending
    finally:
        runner.close()
    stats["comm"] = comm.stats().to_dict()
    return await _finish(comm, driver, stats)


async def _finish(comm, driver: str, stats: dict) -> dict:
    """Stay until the driver says the job is over: a worker that leaves right after the
    last collective could otherwise still owe a peer that collective's acknowledgement."""
    await comm.recv(driver, tag=FINISH_TAG)
    return stats


async def _take(ch, target: float, version: int, stats: dict) -> list[dict]:
    """Episodes worth ``target`` steps, played by version ``version - _MAX_LAG`` or newer."""
    fresh: list[dict] = []
    weight = 0.0
    while weight < target:
        batch = await ch.get_batch(target_weight=target - weight, timeout=120)
        for item in batch:
            stats["items"] += 1
            stats["weight"] += item["length"]
            if item["version"] < version - _MAX_LAG:
                stats["dropped"] += 1
                continue
            fresh.append(item)
            weight += item["length"]
            stats["lag"][version - item["version"]] += 1
    return fresh


async def learner_main(comm, cfg: dict[str, Any], learners: list[str], rollouts: list[str], channel: str,
                       driver: str) -> dict:
    """A learner: take balanced batches, all-reduce gradients, (learner 0) broadcast weights."""
    import torch

    from . import rl

    torch.set_num_threads(1)
    rank = learners.index(comm.address)
    lead = learners[0]
    lgroup = comm.group(learners)
    wgroup = comm.group([lead, *rollouts]) if rank == 0 else None
    ch = await comm.channel(channel)
    policy = rl.make_policy(hidden=cfg["hidden"], seed=cfg["seed"])   # same init on every learner
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg["lr"])
    target = cfg["steps_per_iter"] / len(learners)
    recent: collections.deque[float] = collections.deque(maxlen=cfg["window"])
    stats = {"address": comm.address, "pid": os.getpid(), "items": 0, "weight": 0, "dropped": 0, "used_items": 0,
             "used_steps": 0, "wait_seconds": 0.0, "compute_seconds": 0.0, "reduce_seconds": 0.0,
             "lag": collections.Counter()}
    if wgroup is not None:
        await wgroup.broadcast({"version": 0, "state": _state(policy)}, root=lead)
    started = time.perf_counter()
    for it in range(cfg["iterations"]):
        t0 = time.perf_counter()
        fresh = await _take(ch, target, it, stats)
        t1 = time.perf_counter()
        mine = {"returns": [e["ret"] for e in fresh], "stats": rl.return_stats(fresh),
                "dropped": stats["dropped"]}
        gathered = await lgroup.all_gather(mine)
        returns = [r for g in gathered for r in g["returns"]]
        mean, std = rl.mean_std(sum(np.asarray(g["stats"]) for g in gathered))
        total_steps = float(sum(g["stats"][2] for g in gathered))
        t2 = time.perf_counter()
        optimizer.zero_grad()
        rl.reinforce_gradients(policy, fresh, mean, std)
        t3 = time.perf_counter()
        grads = await lgroup.all_reduce(rl.flat_grads(policy), op="sum")
        t4 = time.perf_counter()
        rl.set_flat_grads(policy, grads / max(total_steps, 1.0))
        optimizer.step()
        stats["used_items"] += len(fresh)
        stats["used_steps"] += sum(e["length"] for e in fresh)
        stats["wait_seconds"] += t1 - t0
        stats["reduce_seconds"] += (t2 - t1) + (t4 - t3)
        stats["compute_seconds"] += (t3 - t2) + (time.perf_counter() - t4)
        recent.extend(returns)
        recent_mean = float(np.mean(recent)) if recent else 0.0
        solved = len(recent) >= min(cfg["window"], 10) and recent_mean >= cfg["target"]
        last = solved or it == cfg["iterations"] - 1
        if wgroup is not None:
            update = {"stop": True} if last else {"version": it + 1, "state": _state(policy)}
            await wgroup.broadcast(update, root=lead)
            await comm.send({"iteration": it + 1, "episodes": len(returns), "steps": int(total_steps),
                             "mean_return": float(np.mean(returns)) if returns else 0.0,
                             "recent_mean": recent_mean, "dropped": int(sum(g["dropped"] for g in gathered)),
                             "time": time.perf_counter() - started, "solved": solved, "last": last},
                            driver, tag=PROGRESS_TAG)
        if last:
            break
    stats["lag"] = {str(k): v for k, v in sorted(stats["lag"].items())}
    stats["comm"] = comm.stats().to_dict()
    return await _finish(comm, driver, stats)
