"""B1: simulated asynchronous RL through a real channel — synchronous vs paced vs discard-only.

BENCHMARKS.md B1: 4 producers whose rollouts take log-normal times (sigma 1), one
trainer that consumes B = 32 items per version and spends a fixed update time on each.
The channel is real (its own process, created by a local cluster); only the work is
simulated (``asyncio.sleep``). Each rollout's weight is its length (its generation time
in ms), so a bias toward short rollouts shows as a shorter mean trained length.

Three runs, same workload, in one process:

* ``sync``: ``max_staleness=0, batch_size=32`` with ``admit`` — a version's rollouts
  are generated only once the trainer is at that version (the synchronous baseline).
* ``paced``: ``max_staleness=2, batch_size=32`` with ``admit`` — generation overlaps
  training, bounded by pacing.
* ``discard``: ``max_staleness=2`` without ``batch_size`` — producers generate freely;
  the bound is kept only by dropping rollouts that became too old (the safety net).

A producer takes the trainer's current version when it starts a rollout (a weight pull,
free here) — with pacing, once admitted. Reported per run (medians over repeats):
trained items per second (from the end of version 1 to the end of the last), items
trained older than ``k``, rollouts discarded, mean trained vs generated length.

Run:  python benchmarks/async_rl_sim.py [--quick] [--versions N] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

try:
    import rlinf
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import rlinf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import text_table  # noqa: E402

__all__ = ["MODES", "run_once", "run", "main"]

PRODUCERS = 4
BATCH = 32
MEDIAN_ROLLOUT = 0.010          # seconds; log-normal, sigma 1 (mean ~16.5 ms)
SIGMA = 1.0
UPDATE = 0.200                  # the trainer's fixed update time per version
#: name -> (max_staleness, batch_size, admit)
MODES: dict[str, tuple[int, int | None]] = {"sync": (0, BATCH), "paced": (2, BATCH), "discard": (2, None)}


async def _producer(ch: rlinf.Channel, state: dict, rng: random.Random, paced: bool) -> None:
    try:
        while True:
            async with ch.admit(state["version"]) as admission:
                version = max(state["version"], admission.current) if paced else state["version"]
                seconds = MEDIAN_ROLLOUT * rng.lognormvariate(0.0, SIGMA)
                await asyncio.sleep(seconds)
                length = seconds * 1000
                state["generated"].append(length)
                await ch.put({"version": version, "length": length}, weight=length, version=version)
    except rlinf.ClosedError:
        return


async def run_once(cluster: rlinf.Cluster, mode: str, versions: int, seed: int, name: str) -> dict:
    """One run of ``mode`` over ``versions`` trainer versions; its figures."""
    k, batch_size = MODES[mode]
    ch = await cluster.create_channel(name, max_staleness=k, batch_size=batch_size)
    state: dict = {"version": 0, "generated": []}
    producers = [asyncio.create_task(_producer(ch, state, random.Random(seed * 100 + i), batch_size is not None))
                 for i in range(PRODUCERS)]
    trained, behind, started = [], [], None
    for version in range(versions):
        batch: list = []
        while len(batch) < BATCH:
            batch += await ch.get_batch(max_items=BATCH - len(batch), timeout=60)
        behind += [version - item["version"] for item in batch]
        trained += [item["length"] for item in batch]
        await asyncio.sleep(UPDATE)
        state["version"] = version + 1
        await ch.advance(version + 1)
        if version == 0:
            started = time.perf_counter()
    elapsed = time.perf_counter() - started
    stats = await ch.stats()
    await ch.close()
    await asyncio.gather(*producers)
    return {"mode": mode, "max_staleness": k, "batch_size": batch_size,
            "throughput": (versions - 1) * BATCH / elapsed,
            "too_old": sum(1 for b in behind if b > k), "max_behind": max(behind),
            "discarded": stats.stale_dropped, "generated": len(state["generated"]),
            "mean_trained_len": statistics.fmean(trained), "mean_generated_len": statistics.fmean(state["generated"])}


async def _run(versions: int, repeats: int, seed: int) -> list[dict]:
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    async with rlinf.Cluster() as cluster:
        for r in range(repeats):                 # interleaved: drift hits every mode alike
            for mode in MODES:
                results[mode].append(await run_once(cluster, mode, versions, seed + r, f"b1-{mode}-{r}"))
    rows = []
    for mode, runs in results.items():
        row = {key: statistics.median(one[key] for one in runs) for key in runs[0]
               if isinstance(runs[0][key], (int, float)) and key not in ("max_staleness", "batch_size")}
        row.update(mode=mode, max_staleness=runs[0]["max_staleness"], batch_size=runs[0]["batch_size"],
                   too_old=max(one["too_old"] for one in runs), discarded_total=sum(one["discarded"] for one in runs),
                   throughputs=[one["throughput"] for one in runs], versions=versions, repeats=repeats)
        rows.append(row)
    sync = rows[0]["throughput"]
    for row in rows:          # also the fields of ``rlinf bench``'s table
        row.update(vs_sync=row["throughput"] / sync, batch=row["batch_size"] or "-", metric=f"B1 trained items/s, {row['mode']}",
                   rlinf=row["throughput"], baseline="sync (max_staleness=0)", baseline_value=sync,
                   unit="items/s", higher_is_better=True, target=">= 1.5x" if row["mode"] == "paced" else "",
                   note=f"{row['too_old']} trained > k, {row['discarded_total']} discarded")
    return rows


def run(quick: bool = False, *, versions: int | None = None, repeats: int | None = None, seed: int = 1) -> list[dict]:
    """Every mode on the same workload; one row per mode (medians over repeats)."""
    return asyncio.run(_run(versions or (8 if quick else 16), repeats or (1 if quick else 3), seed))


def format_table(rows: list[dict]) -> str:
    return text_table([("run", "{mode}"), ("k", "{max_staleness}"), ("B", "{batch}"),
                       ("items/s", "{throughput:.1f}"), ("vs sync", "{vs_sync:.2f}x"), (">k trained", "{too_old}"),
                       ("discarded", "{discarded:.0f}"), ("generated", "{generated:.0f}"),
                       ("trained len", "{mean_trained_len:.1f}"), ("generated len", "{mean_generated_len:.1f}")],
                      rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 versions, 1 repeat")
    parser.add_argument("--versions", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.quick, versions=args.versions, repeats=args.repeats, seed=args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(f"B1 async RL: {PRODUCERS} producers, rollouts log-normal (median {MEDIAN_ROLLOUT * 1000:.0f} ms, "
          f"sigma {SIGMA}), trainer B={BATCH} per version, update {UPDATE * 1000:.0f} ms; "
          f"{r0['versions']} versions x {r0['repeats']} repeats (medians; '>k trained' and discarded: per run)\n")
    print(format_table(rows))
    paced = rows[1]
    ok = paced["too_old"] == 0 and paced["discarded_total"] == 0 and paced["vs_sync"] >= 1.5
    print(f"\npaced: {paced['too_old']} trained older than k, {paced['discarded_total']} discarded, "
          f"{paced['vs_sync']:.2f}x sync: {'meets' if ok else 'MISSES'} B1 (0, 0, >= 1.5x)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
