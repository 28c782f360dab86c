"""What the timeline trace costs: P1 (64 B round trip p50) and P2 (1 KiB one-way rate)
with tracing off and on (RLINF_TRACE set), beside a baseline tree without the trace, in
one interleaved run (the variants take turns, so a noisy neighbour hits them alike).

    python benchmarks/trace_overhead.py --baseline /path/to/other/tree [--rounds 5]

``--baseline``: a source tree of rlinf to compare against (e.g. ``git archive main``
unpacked); without it only off and on are measured. Each round runs each variant in a
fresh process (``--one``), which prints one JSON line. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import round_trips  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _echo(comm, n):
    for _ in range(n):
        await comm.send(await comm.recv("driver:0"), "driver:0")


async def _flood(comm, n, size):
    payload = b"x" * size
    await comm.recv("driver:0")
    cpu = time.process_time()       # (all its threads: the trace writer's included)
    for _ in range(n):
        await comm.send(payload, "driver:0")
    return time.process_time() - cpu


async def _measure(n: int, m: int) -> dict[str, float]:
    import rlinf

    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        await cluster.spawn(_echo, "echo", 1, args=(n,))
        lat = await round_trips(comm, "echo:0", n)
        flood = await cluster.spawn(_flood, "flood", 1, args=(m, 1024))
        await comm.send("go", "flood:0")
        t0, cpu = time.perf_counter(), time.process_time()
        for _ in range(m):
            await comm.recv("flood:0")
        rate = m / (time.perf_counter() - t0)
        cpu = time.process_time() - cpu
        (sender_cpu,) = await flood.join(timeout=60)
    return {"p1_us": lat[len(lat) // 2] * 1e6, "p2_rate": rate, "p2_recv_cpu_us": cpu / m * 1e6,
            "p2_send_cpu_us": sender_cpu / m * 1e6}


def _one(n: int, m: int) -> None:
    from rlinf.control.client import run

    print(json.dumps(run(_measure(n, m))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a source tree of rlinf to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", type=int, default=2000, help="P1 round trips per round")
    parser.add_argument("-m", type=int, default=30000, help="P2 messages per round")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args.n, args.m)
        return
    traces = tempfile.mkdtemp(prefix="rlinf-trace-bench-")
    variants = [("off", HERE, {}), ("on", HERE, {"RLINF_TRACE": traces})]
    if args.baseline:
        variants.insert(0, ("baseline", os.path.abspath(args.baseline), {}))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    try:
        for r in range(args.rounds):
            for name, tree, extra in variants:
                env = {k: v for k, v in os.environ.items() if k != "RLINF_TRACE"}
                env.update(extra, PYTHONPATH=tree)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "-n", str(args.n),
                                      "-m", str(args.m)], env=env, capture_output=True, text=True, timeout=300,
                                     cwd=tree)
                if out.returncode:
                    raise SystemExit(f"{name}: {out.stderr}")
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    finally:
        size = sum(os.path.getsize(os.path.join(traces, f)) for f in os.listdir(traces))
        shutil.rmtree(traces, ignore_errors=True)
    first = variants[0][0]
    p1_0 = statistics.median(x["p1_us"] for x in results[first])
    p2_0 = statistics.median(x["p2_rate"] for x in results[first])
    cpu_0 = {side: statistics.median(x[f"p2_{side}_cpu_us"] for x in results[first]) for side in ("send", "recv")}
    print(f"| variant | P1 p50 (us) | vs {first} | P2 rate (msg/s) | vs {first} | P2 CPU per message, "
          f"sender / receiver (us) | vs {first} | P2 runs (k msg/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, _, _ in variants:
        p1 = statistics.median(x["p1_us"] for x in results[name])
        p2 = statistics.median(x["p2_rate"] for x in results[name])
        cpu = {side: statistics.median(x[f"p2_{side}_cpu_us"] for x in results[name]) for side in ("send", "recv")}
        runs = " ".join(f"{x['p2_rate'] / 1000:.1f}" for x in results[name])
        print(f"| {name} | {p1:.1f} | {p1 / p1_0:.3f}x | {p2:,.0f} | {p2 / p2_0:.3f}x | "
              f"{cpu['send']:.2f} / {cpu['recv']:.2f} | {cpu['send'] / cpu_0['send']:.3f}x / "
              f"{cpu['recv'] / cpu_0['recv']:.3f}x | {runs} |")
    print(f"(trace files written by the 'on' runs: {size / 1e6:.1f} MB in all)")


if __name__ == "__main__":
    main()
