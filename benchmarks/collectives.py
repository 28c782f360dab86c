"""Collective benchmarks (BENCHMARKS.md K1-K2), rlinf beside torch.distributed gloo in one run.

    python benchmarks/collectives.py [--quick]

K1: broadcast of one 64 MiB float32 tensor from a root to 3 receivers on this machine
    (4 processes). Each receiver reads every page of what it got; one round is
    broadcast + barrier, timed at the root.
K2: all_to_all among 4 processes, 8 MiB (a float32 tensor) per ordered pair: each process
    sends 3 x 8 MiB and receives 3 x 8 MiB and reads every page; one round is
    all_to_all + barrier, timed at process 0.

rlinf runs the root / process 0 in the driver (``cluster.connect("driver:0")``) and the
others as spawned workers; gloo runs 4 spawned processes (``init_process_group("gloo")``
over loopback TCP). Medians over the timed rounds (after warm-up rounds);
ratio = gloo time / rlinf time. Ray's collective library is not measured (its CPU
backend needs pygloo, which is not installed on the development machine).

``--quick`` (what ``rlinf bench --quick`` and the test suite run) times 3 rounds instead
of 15 and has rlinf's processes exchange numpy arrays instead of torch tensors, so they
need not import torch (seconds per process on a small machine); gloo keeps torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, baseline_context, free_port, print_rows, touch  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

ctx = baseline_context("torch", "torch.distributed")
# Failure detection is not what is measured here; on a loaded 2-vCPU VM a heartbeat can
# be late by more than the default 1.5 s, which would end the run with PeerLostError.
os.environ.setdefault("RLINF_PEER_TIMEOUT", "10")

BCAST_BYTES = 64 << 20
A2A_BYTES = 8 << 20
PROCS = 4
WARMUP = 2


# ----------------------------------------------------------------------------- rlinf side
async def _rl_bcast_member(comm, members: list[str], rounds: int) -> None:
    group = comm.group(members)
    for _ in range(rounds):
        obj = await group.broadcast(None, root="driver:0", timeout=120)
        touch(obj)
        del obj
        await group.barrier(timeout=120)


def _full(value: float, nbytes: int, torch_tensors: bool):
    """A float32 tensor (or numpy array) of ``nbytes`` filled with ``value``."""
    if torch_tensors:
        import torch

        return torch.full((nbytes // 4,), value)
    return np.full(nbytes // 4, value, dtype=np.float32)


async def _rl_a2a_member(comm, members: list[str], rounds: int, torch_tensors: bool = True) -> None:
    group = comm.group(members)
    objs = [_full(float(group.rank), A2A_BYTES, torch_tensors) for _ in members]
    for _ in range(rounds):
        out = await group.all_to_all(objs, timeout=120)
        touch(out)
        del out
        await group.barrier(timeout=120)


async def _rlinf(quick: bool) -> dict[str, float]:
    rounds = WARMUP + (3 if quick else 15)
    torch_tensors = not quick
    out = {}
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        for name, target in (("bcast", _rl_bcast_member), ("a2a", _rl_a2a_member)):
            members = ["driver:0"] + [f"{name}:{i}" for i in range(PROCS - 1)]
            args = (members, rounds) if name == "bcast" else (members, rounds, torch_tensors)
            workers = await cluster.spawn(target, name, PROCS - 1, args=args)
            group = comm.group(members)
            if name == "bcast":
                if torch_tensors:
                    import torch

                    payload = torch.rand(BCAST_BYTES // 4)
                else:
                    payload = np.random.default_rng(0).random(BCAST_BYTES // 4, dtype=np.float32)
            else:
                payload = [_full(float(group.rank), A2A_BYTES, torch_tensors) for _ in members]
            times = []
            try:
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    if name == "bcast":
                        await group.broadcast(payload, root="driver:0", timeout=120)
                    else:
                        touch(await group.all_to_all(payload, timeout=120))
                    await group.barrier(timeout=120)
                    times.append(time.perf_counter() - t0)
            finally:   # a worker's failure (with its traceback) explains ours
                await workers.join(timeout=120)
            out[name] = statistics.median(times[WARMUP:])
        out["multicast"] = hasattr(comm.internal, "multicast")
        out["shm"] = "shm" in comm.info.transports
    return out


# ----------------------------------------------------------------------------- gloo side
def _gloo_member(rank: int, port: int, rounds: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PROCS)
    try:
        found = {}
        tensor = torch.rand(BCAST_BYTES // 4) if rank == 0 else torch.empty(BCAST_BYTES // 4)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            dist.broadcast(tensor, src=0)
            touch(tensor)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        found["bcast"] = statistics.median(times[WARMUP:])
        inputs = [torch.full((A2A_BYTES // 4,), float(rank)) for _ in range(PROCS)]
        outputs = [torch.empty(A2A_BYTES // 4) for _ in range(PROCS)]
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            dist.all_to_all(outputs, inputs)
            touch(outputs)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        found["a2a"] = statistics.median(times[WARMUP:])
        if rank == 0:
            results.put(found)
    finally:
        dist.destroy_process_group()



def _gloo(quick: bool) -> dict[str, float]:
    rounds = WARMUP + (3 if quick else 15)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_member, args=(r, port, rounds, results)) for r in range(PROCS)]
    for p in procs:
        p.start()
    try:
        found = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return found


def _memcpy_ms() -> float:
    """One 64 MiB copy into memory already paged in: how loaded the machine is (~3 ms quiet)."""
    src, dst = np.ones(BCAST_BYTES, np.uint8), np.zeros(BCAST_BYTES, np.uint8)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(quick: bool = False) -> list[Row]:
    rl = run_loop(_rlinf(quick))
    gloo = _gloo(quick)
    copy = _memcpy_ms()
    if not rl["shm"]:
        k1 = k2 = "zmq ipc (no shared memory)"
    else:
        k1 = "shm, written once (multicast)" if rl["multicast"] else "shm, one copy per receiver"
        k2 = "shm per pair"
    return [
        Row("K1 broadcast 64 MiB -> 3 local receivers", rl["bcast"], "gloo broadcast", gloo["bcast"], "s",
            target=">= 3x", note=f"{k1}; one 64 MiB memcpy here: {copy:.1f} ms"),
        Row("K2 all_to_all 4 procs x 8 MiB per pair", rl["a2a"], "gloo all_to_all", gloo["a2a"], "s",
            target=">= 4x", note=k2),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = run(args.quick)
    print_rows("Collectives (K1-K2)", rows)
    for r in rows:
        if r.note:
            print(f"{r.metric}: rlinf path = {r.note}")


if __name__ == "__main__":
    main()
