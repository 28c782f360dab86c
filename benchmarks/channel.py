"""Data channel benchmarks (BENCHMARKS.md Q1-Q3), rlinf beside its baselines in one run.

    python benchmarks/channel.py [--quick]

Q1: 1 KiB items put -> get, 1 producer -> 1 consumer and 4 -> 2, every process its own;
    rlinf (channel process in between, consumers with prefetch=256) vs raw pyzmq
    PUSH/PULL on zmq.asyncio (producers push straight to the consumers, item i of a
    producer to consumer i % C: no broker) and ray.util.queue (skipped when ray is not
    installed). Rate = all items / (start signal -> last item received).
Q2: the 40 MiB nested 10-tensor object, producer process -> channel process -> consumer
    process on this node (maxsize=2, the consumer touches every page), steady-state time
    per item vs one memcpy of the same bytes into a paged-in buffer.
Q3: 4 consumer processes with speeds 1, 1, 2, 4 (weight units per second, scaled so a
    step takes ~0.5 s); synchronous steps of 256 items with log-normal weights (sigma 1,
    seeded); a consumer "works" an item for weight / speed (time.sleep) and gets one item
    at a time (prefetch=0). Per step: imbalance = (max busy - min busy) / mean busy and
    the step time; medians over the steps, per policy.
Q3b (``--only q3b``): the same per step, first step included, with 48 items per step
    (0.5 s) and 256 (0.5 s, where the speed-4 consumer's items take 2.4 ms at the median,
    and 2 s), for fifo, RLinf's least-loaded dispatch (:class:`LeastLoaded`, fewest
    pending items) and performance_aware; step time against the LPT oracle (longest item
    first to the consumer that finishes it first, knowing every weight and speed). Then
    256 in 0.5 s again with ``prefetch=1``, a reference (the consumer asks ahead itself;
    at prefetch=0 performance_aware sends each consumer its next items just before it
    needs them). A performance_aware step over 15% is printed with each consumer's busy
    time, time between items, first start and last end, and the weights it worked.

``--quick`` (what ``rlinf bench --quick`` and the test suite run) sends fewer items,
times fewer Q2 items and Q3 steps (3 steps of 128 items, ~0.2 s), makes Q2's object of
numpy arrays instead of torch tensors, so its processes need not import torch (seconds
per process on a small machine), and leaves out the ray.util.queue baseline (starting
Ray takes ~10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, baseline_context, nested_object, print_rows, touch  # noqa: E402
from balance_sim import lpt_oracle  # noqa: E402

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

ctx = baseline_context()
SPEEDS = (1.0, 1.0, 2.0, 4.0)
POLICIES = ("fifo", "round_robin", "weighted_round_robin", "shortest_queue", "performance_aware")
ITEM = b"x" * 1024


# ------------------------------------------------------------------------------------ Q1
async def _q1_producer(comm, name: str, n: int):
    ch = await comm.channel(name, timeout=60)
    await comm.recv("driver:0", tag=1)                 # go
    for _ in range(n):
        await ch.put(ITEM)
    await ch.flush(timeout=60)
    return n


async def _q1_consumer(comm, name: str, prefetch: int):
    ch = await comm.channel(name, timeout=60, prefetch=prefetch)
    await comm.send("attached", "driver:0", tag=2)
    count, last = 0, 0.0
    try:
        while True:
            await ch.get()
            count += 1
            last = time.perf_counter()
    except rlinf.EndOfChannel:
        return count, last


async def _q1_rlinf(producers: int, consumers: int, n: int, tag: str) -> float:
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        name = f"q1-{tag}"
        # the channel and every process start at once; producers wait for the "go"
        ch, cons, prods = await asyncio.gather(
            comm.create_channel(name), cluster.spawn(_q1_consumer, "cons", consumers, args=(name, 256)),
            cluster.spawn(_q1_producer, "prod", producers, args=(name, n)))
        for address in cons.addresses:
            await comm.recv(address, tag=2)
        t0 = time.perf_counter()
        for address in prods.addresses:
            await comm.send("go", address, tag=1)
        await prods.join(timeout=600)
        await ch.close(timeout=60)
        results = await cons.join(timeout=600)
        total = sum(r[0] for r in results)
        assert total == producers * n, (total, producers * n)
        return total / (max(r[1] for r in results) - t0)


def _raw_push(endpoints: list[str], n: int, go) -> None:
    import zmq.asyncio

    async def main():
        context = zmq.asyncio.Context()
        socks = []
        for ep in endpoints:
            s = context.socket(zmq.PUSH)
            s.connect(ep)
            socks.append(s)
        go.wait()
        k = len(socks)
        for i in range(n):
            await socks[i % k].send(ITEM)
        await asyncio.sleep(0.5)
    run_loop(main())


def _raw_pull(endpoint: str, n: int, ready, done) -> None:
    import zmq.asyncio

    async def main():
        s = zmq.asyncio.Context().socket(zmq.PULL)
        s.bind(endpoint)
        ready.put(True)
        for _ in range(n):
            await s.recv()
        done.put(time.perf_counter())
    run_loop(main())


def _q1_raw(producers: int, consumers: int, n: int) -> float:
    d = tempfile.mkdtemp(prefix="rlinf-bench-")
    try:
        return _q1_raw_in(d, producers, consumers, n)
    finally:
        shutil.rmtree(d, ignore_errors=True)    # the PULL sockets' files


def _q1_raw_in(d: str, producers: int, consumers: int, n: int) -> float:
    endpoints = [f"ipc://{d}/pull{i}" for i in range(consumers)]
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    pulls = [ctx.Process(target=_raw_pull, args=(ep, producers * n // consumers, ready, done)) for ep in endpoints]
    for p in pulls:
        p.start()
    for _ in pulls:
        ready.get(timeout=60)
    pushes = [ctx.Process(target=_raw_push, args=(endpoints, n, go)) for _ in range(producers)]
    for p in pushes:
        p.start()
    time.sleep(1.0)                     # let every PUSH connect before the clock starts
    t0 = time.perf_counter()
    go.set()
    end = max(done.get(timeout=600) for _ in pulls)
    for p in pulls + pushes:
        p.join(10)
    return producers * n / (end - t0)


def _ray_queue_rate(n: int) -> float | None:
    try:
        import ray
        from ray.util.queue import Queue
    except ImportError:
        return None

    # a private local instance: never a Ray cluster that happens to run on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        q = Queue()

        @ray.remote
        def produce(q, n):
            for _ in range(n):
                q.put(ITEM)

        t0 = time.perf_counter()
        ref = produce.remote(q, n)
        for _ in range(n):
            q.get()
        ray.get(ref)
        return n / (time.perf_counter() - t0)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------ Q2
async def _q2_producer(comm, name: str, reps: int, torch_tensors: bool = True):
    ch = await comm.channel(name, timeout=60)
    obj = nested_object(40 << 20, torch_tensors=torch_tensors)
    await comm.recv("driver:0", tag=1)
    for _ in range(reps):
        await ch.put(obj)
    return reps


async def _q2_consumer(comm, name: str, reps: int, prefetch: int = 1):
    ch = await comm.channel(name, timeout=60, prefetch=prefetch)
    nbytes = sum(t.nbytes for t in nested_object(40 << 20, torch_tensors=False)["tensors"].values())
    memcpy = [_memcpy_time(nbytes, 5)]               # the baseline, in this process, before
    await comm.send("attached", "driver:0", tag=2)
    times = []
    for _ in range(reps):
        obj = await ch.get(timeout=120)
        touch(obj)
        times.append(time.perf_counter())
        del obj
    memcpy.append(_memcpy_time(nbytes, 5))           # ... and after the stream
    return times, statistics.median(memcpy), nbytes


async def _q2_rlinf(reps: int, torch_tensors: bool = True) -> tuple[float, float, int]:
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        ch = await comm.create_channel("q2", maxsize=2)
        cons = await cluster.spawn(_q2_consumer, "cons", 1, args=("q2", reps))
        await comm.recv("cons:0", tag=2)
        prod = await cluster.spawn(_q2_producer, "prod", 1, args=("q2", reps, torch_tensors))
        await comm.send("go", "prod:0", tag=1)
        ((times, memcpy, nbytes),) = await cons.join(timeout=600)
        await prod.join(timeout=60)
        await ch.close()
    gaps = np.diff(times[1:])            # steady state: the first item pays connection setup
    return float(np.median(gaps)), memcpy, nbytes


def _memcpy_time(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).random(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------ Q3
async def _q3_consumer(comm, names: list[str], scale: float, prefetch: int = 0):
    speed = SPEEDS[int(comm.address.rsplit(":", 1)[1])]
    for name in names:
        ch = await comm.channel(name, timeout=120, prefetch=prefetch)
        work = ch.async_get()                          # join before the first step starts
        await ch.stats(timeout=60)
        await comm.send("attached", "driver:0", tag=2)
        try:
            end = None
            while True:
                step, weight = await work
                t0 = time.perf_counter()
                time.sleep(weight / speed * scale)     # "work" for weight / speed
                t1 = time.perf_counter()
                # (diagnostics: the time from its previous item's end to this one's start, reporting
                # it, asking and waiting; when this one started and ended, same clock as the driver's)
                await comm.send((step, comm.address, t1 - t0, weight, t0 - end if end else 0.0, t0, t1),
                                "driver:0", tag=3)
                end = t1
                work = ch.async_get()
        except rlinf.EndOfChannel:
            pass
        await ch.detach()
    return True


def _q3_weights(steps: int, items: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.lognormvariate(0.0, 1.0) for _ in range(items)] for _ in range(steps)]


class LeastLoaded(rlinf.LoadBalancePolicy):
    """RLinf's least-loaded dispatch, a reference: each item to the consumer with the
    fewest pending items (ties: the first)."""

    name = "least_loaded"

    def select_consumer(self, item, consumers):
        return min(range(len(consumers)), key=lambda i: (consumers[i].pending_count, i))


async def _q3_rlinf(steps: int, items: int, seed: int, step_seconds: float,
                    policies: tuple = POLICIES, prefetch: int = 0) -> dict[str, dict]:
    weights = _q3_weights(steps, items, seed)
    mean_step_units = statistics.fmean(sum(w) for w in weights) / sum(SPEEDS)
    scale = step_seconds / mean_step_units
    out = {}
    policies = tuple(p if isinstance(p, str) else p.name for p in policies), policies
    names = [f"q3-{p}" for p in policies[0]]
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        # the channel processes and the learners all start at once, before anything is timed
        # (a learner waits for each channel by name)
        channels, group = await asyncio.gather(
            asyncio.gather(*(comm.create_channel(name, policy=policy) for policy, name in zip(policies[1], names))),
            cluster.spawn(_q3_consumer, "learner", len(SPEEDS), args=(names, scale, prefetch)))
        for policy, ch in zip(policies[0], channels):
            out[policy] = await _q3_run(comm, ch, group, weights, scale)
            out[policy]["oracle"] = [max(lpt_oracle(w, SPEEDS)) * scale for w in weights]
        await group.join(timeout=120)
    return out


async def _q3_run(comm, ch, group, weights, scale) -> dict:
    for address in group.addresses:
        await comm.recv(address, tag=2)
    imbalances, step_times, ideal, per_step = [], [], [], []
    for step, ws in enumerate(weights):
        busy = {a: 0.0 for a in group.addresses}
        # per consumer, for the diagnostics: the weights it worked in order, its time between items,
        # when its first item started and its last ended (from the step's start)
        got: dict = {a: [] for a in group.addresses}
        between, first, last = dict.fromkeys(busy, 0.0), dict.fromkeys(busy, math.inf), dict.fromkeys(busy, 0.0)
        t0 = time.perf_counter()
        for w in ws:
            await ch.put((step, w), weight=w)
        for _ in ws:
            (s, address, b, w, gap, start, end), _src = await comm.recv_any(tag=3, timeout=120)
            assert s == step
            busy[address] += b
            got[address].append(round(w, 2))
            between[address] += gap if got[address][1:] else 0.0     # (not the gap between steps)
            first[address], last[address] = min(first[address], start - t0), max(last[address], end - t0)
        step_times.append(time.perf_counter() - t0)
        per_step.append({name: [round(d[a], 4) for a in busy] for name, d in
                         (("busy", busy), ("between", between), ("first", first), ("last", last))})
        per_step[-1]["weights"] = list(got.values())
        values = list(busy.values())
        imbalances.append((max(values) - min(values)) / statistics.fmean(values))
        ideal.append(sum(ws) / sum(SPEEDS) * scale)
    stats = await ch.stats()
    await ch.close()
    return {"imbalance": statistics.median(imbalances), "max_imbalance": max(imbalances),
            "step_time": statistics.median(step_times), "ideal": statistics.median(ideal), "step_times": step_times,
            "imbalances": imbalances, "stats": str(stats), "per_step": per_step}


# ------------------------------------------------------------------------------------ main
def run(quick: bool = False, only: str = "q1,q2,q3") -> list[Row]:
    n = 2000 if quick else 20000
    rows = []
    if "q1" in only:
        rows += _run_q1(n, None if quick else min(n, 2000))
    if "q2" in only:
        rows += _run_q2(quick)
    if "q3" in only.replace("q3b", ""):
        rows += _run_q3(quick)
    if "q3b" in only:
        rows += _run_q3b(quick)
    return rows


def _run_q1(n: int, ray_items: int | None) -> list[Row]:
    rows = []
    raw11 = _q1_raw(1, 1, n)
    rl11 = run_loop(_q1_rlinf(1, 1, n, "11"))
    raw42 = _q1_raw(4, 2, n // 2)
    rl42 = run_loop(_q1_rlinf(4, 2, n // 2, "42"))
    print(f"Q1 1->1 rlinf {rl11:.0f}/s raw {raw11:.0f}/s; 4->2 rlinf {rl42:.0f}/s raw {raw42:.0f}/s",
          file=sys.stderr)
    if ray_items is None:     # --quick: starting Ray alone takes ~10 s on a small machine
        ray_rate, note = None, "not run with --quick (Ray's start-up takes ~10 s)"
    else:
        ray_rate = _ray_queue_rate(ray_items)
        note = "" if ray_rate else "ray not installed"
    rows += [
        Row("Q1 1 KiB put->get rate, 1->1", rl11, "raw pyzmq PUSH/PULL", raw11, "msg/s", True, ">= 0.3x"),
        Row("Q1 1 KiB put->get rate, 4->2", rl42, "raw pyzmq PUSH/PULL", raw42, "msg/s", True, ">= 0.3x"),
        Row("Q1 1 KiB put->get rate, 1->1", rl11, "ray.util.queue", ray_rate, "msg/s", True, ">= 100x", note),
    ]
    return rows


def _run_q2(quick: bool) -> list[Row]:
    item, memcpy, nbytes = run_loop(_q2_rlinf(5, torch_tensors=False) if quick else _q2_rlinf(16))
    print(f"Q2 rlinf {item * 1e3:.1f} ms/item, memcpy {memcpy * 1e3:.1f} ms", file=sys.stderr)
    return [Row("Q2 40 MiB nested object, same node", nbytes / item / 1e9, "memcpy (paged-in)",
                nbytes / memcpy / 1e9, "GB/s", True, ">= 0.4x")]


def _run_q3(quick: bool) -> list[Row]:
    rows = []
    q3 = run_loop(_q3_rlinf(3, 128, 20240601, 0.2) if quick else _q3_rlinf(10, 256, 20240601, 0.5))
    for policy in POLICIES:
        r = q3[policy]
        print(f"Q3 {policy}: imbalance {r['imbalance']:.1%} (steps {[f'{x:.0%}' for x in r['imbalances']]}), "
              f"step {r['step_time']:.3f} s, ideal {r['ideal']:.3f} s", file=sys.stderr)
    rr = q3["round_robin"]["imbalance"]
    for policy in POLICIES:
        r = q3[policy]
        rows.append(Row(f"Q3 imbalance, {policy}", r["imbalance"] * 100, "round_robin", rr * 100, "%",
                        False, "<= 10% (best)", f"max {r['max_imbalance']:.0%}"))
    for policy in POLICIES:
        r = q3[policy]
        rows.append(Row(f"Q3 step time, {policy}", r["step_time"], "ideal (total work / total speed)",
                        r["ideal"], "s", False, ""))
    return rows


def _run_q3b(quick: bool) -> list[Row]:
    rows = []
    for items, seconds, prefetch in ((48, 0.5, 0), (256, 0.5, 0), (256, 2.0, 0), (256, 0.5, 1)):
        q3 = run_loop(_q3_rlinf(3 if quick else 10, items, 20240601, seconds, ("fifo", LeastLoaded, "performance_aware"),
                                prefetch))
        items = f"{items} in {seconds:g} s" + (f", prefetch={prefetch}" if prefetch else "")
        for policy, r in q3.items():
            vs = [t / o for t, o in zip(r["step_times"], r["oracle"])]
            print(f"Q3b {items}/step {policy}: steps {[f'{x:.0%}' for x in r['imbalances']]}, step time "
                  f"{statistics.median(vs):.2f}x LPT (worst {max(vs):.2f}x)", file=sys.stderr)
            for step, x in enumerate(r["imbalances"]) if policy == "performance_aware" else ():
                if x > 0.15:    # each consumer's (speeds 1, 1, 2, 4) busy time, times and items, in order
                    print(f"  step {step} {x:.0%}: {r['per_step'][step]}", file=sys.stderr)
            rows.append(Row(f"Q3b {items}/step worst step imbalance, {policy}", r["max_imbalance"] * 100, "-", None,
                            "%", False, "<= 15%", f"first {r['imbalances'][0]:.0%}, median {r['imbalance']:.1%}"))
            rows.append(Row(f"Q3b {items}/step step time, {policy}", statistics.median(r["step_times"]),
                            "LPT oracle", statistics.median(r["oracle"]), "s", False,
                            "<= 1.10x" if policy == "performance_aware" else "", f"worst step {max(vs):.2f}x LPT"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="q1,q2,q3", help="comma-separated subset of q1,q2,q3,q3b")
    args = parser.parse_args()
    print_rows("Channel (Q1-Q3)", run(args.quick, args.only))


if __name__ == "__main__":
    main()
