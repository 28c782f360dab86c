"""Ray: one ~40 MiB nested object between two Ray actors, rlinf beside Ray's own paths.

    python benchmarks/ray_transfer.py [--quick]

Both ends are Ray actors on this machine (a local Ray is started, unless RAY_ADDRESS
names a cluster). The workload is BENCHMARKS.md's nested object (10 float32 torch
tensors of mixed sizes plus scalars and strings; numpy arrays with ``--quick``). The
receiver rebuilds it and touches every page, then answers; one transfer is timed in
the sender from the send to the answer (median over repeats, after a warm-up).

Rows: rlinf between two ranks spawned with ``launcher="ray"`` (the data goes over
rlinf's transports, here shared memory), against a Ray actor call with the object as
its argument (Ray puts it in its object store) and against ``ray.put`` in the sender
plus ``ray.get`` in the receiver (the reference passed in a call).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import ray
from ray import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import Row, nested_object, quick_main, touch  # noqa: E402

import rlinf  # noqa: E402
import rlinf.ray  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

# A loaded 2-core machine can starve a heartbeat thread for over the 2.5 s default.
os.environ.setdefault("RLINF_PEER_TIMEOUT", "10")
SIZE = 40 << 20
WARMUP = 2

# The actors cannot import benchmarks/ (not on their path): send our code by value.
for _module in {_common, sys.modules[__name__]} - {sys.modules["__main__"]}:
    cloudpickle.register_pickle_by_value(_module)


# ----------------------------------------------------------------------------- rlinf
class Sender(rlinf.Worker):
    async def rounds(self, total: int, reps: int, torch_tensors: bool) -> list[float]:
        obj = nested_object(total, torch_tensors=torch_tensors)
        times = []
        for _ in range(WARMUP + reps):
            t0 = time.perf_counter()
            await self.comm.send(obj, "receiver:0", timeout=120)
            await self.comm.recv("receiver:0", tag=1, timeout=120)
            times.append(time.perf_counter() - t0)
        await self.comm.send(None, "receiver:0", timeout=120)
        return times[WARMUP:]


async def receiver(comm) -> None:
    while (obj := await comm.recv("sender:0", timeout=300)) is not None:
        touch(obj)
        del obj                                   # its shared memory goes back now
        await comm.send(b"", "sender:0", tag=1, timeout=120)


async def _rlinf(total: int, reps: int, torch_tensors: bool) -> float:
    async with rlinf.Cluster() as cluster:
        options = {"launcher": "ray", "resources": {"num_cpus": 1}}
        recv = await cluster.spawn(receiver, "receiver", 1, **options)
        send = await cluster.spawn(Sender, "sender", 1, **options)
        (times,) = await send.call("rounds", total, reps, torch_tensors)
        await recv.join(timeout=60)
        return statistics.median(times)


# ------------------------------------------------------------------------------- Ray
@ray.remote(num_cpus=1)
class RayEnd:
    def take(self, obj) -> float:
        return touch(obj)

    def take_ref(self, refs: list) -> float:
        return touch(ray.get(refs[0]))

    def rounds(self, peer, mode: str, total: int, reps: int, torch_tensors: bool) -> list[float]:
        obj = nested_object(total, torch_tensors=torch_tensors)
        times = []
        for _ in range(WARMUP + reps):
            t0 = time.perf_counter()
            if mode == "call":
                ray.get(peer.take.remote(obj))
            else:
                ref = ray.put(obj)
                ray.get(peer.take_ref.remote([ref]))   # in a list: Ray passes the reference
                del ref
            times.append(time.perf_counter() - t0)
        return times[WARMUP:]


def _ray(mode: str, total: int, reps: int, torch_tensors: bool) -> float:
    sender, peer = RayEnd.remote(), RayEnd.remote()
    try:
        return statistics.median(ray.get(sender.rounds.remote(peer, mode, total, reps, torch_tensors)))
    finally:
        ray.kill(sender)
        ray.kill(peer)


# ----------------------------------------------------------------------------- table
def run(quick: bool = False) -> list[Row]:
    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if started:
        rlinf.ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                       object_store_memory=1 << 30)
    else:
        rlinf.ray.init()
    try:
        reps = 3 if quick else 15
        torch_tensors = not quick
        kind = "torch" if torch_tensors else "numpy"
        ours = run_loop(_rlinf(SIZE, reps, torch_tensors))
        call = _ray("call", SIZE, reps, torch_tensors)
        put_get = _ray("put", SIZE, reps, torch_tensors)
    finally:
        if started:
            ray.shutdown()
    metric = f"40 MiB nested ({kind}), actor to actor"
    return [
        Row(metric, ours, "Ray actor call (object as argument)", call, "s"),
        Row(metric, ours, "ray.put + ray.get (reference passed)", put_get, "s"),
    ]


def main() -> None:
    quick_main(__doc__, "Between Ray actors: rlinf vs Ray's object store", run)


if __name__ == "__main__":
    main()
