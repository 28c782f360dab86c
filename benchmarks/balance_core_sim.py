"""Q3b: balance per step, driving the real channel core through simulated time.

Unlike ``balance_sim.py`` (which feeds policies snapshots and assumes every item is
placed at put time), this runs :class:`rlinf.channel._core.ChannelCore` itself — the
policy, speed meters and work stealing exactly as the channel process runs them — with
a fake clock: a producer puts a step's items at once; each consumer ``get``s one item
(``prefetch=0``), works ``weight / speed`` simulated seconds, reports it done with its
next ``get``. A step ends when every item is finished; the next starts then.

Per step: imbalance = (max busy - min busy) / mean busy, and step time, against
references computed on the same weights: the LPT oracle (longest item first to the
consumer that finishes it first, with known weights and speeds: a near-optimal
makespan that a FIFO channel cannot reach, as it reorders) and RLinf's least-loaded
dispatch (each item, in order, to the consumer with the fewest pending items).

Run:  python benchmarks/balance_core_sim.py [--quick] [--items 48 256] [--steps N]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from pathlib import Path

try:
    from rlinf.channel._core import ChannelCore
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlinf.channel._core import ChannelCore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import text_table  # noqa: E402
from balance_sim import least_loaded, lpt_oracle  # noqa: E402

__all__ = ["SPEEDS", "CONFIGS", "simulate_core", "lpt_oracle", "least_loaded", "run", "main"]

SPEEDS: tuple[float, ...] = (1.0, 1.0, 2.0, 4.0)
#: label -> ChannelCore options
CONFIGS: dict[str, dict] = {
    "fifo": {"policy": "fifo"},
    "performance_aware": {"policy": "performance_aware", "work_stealing": False},
    "performance_aware+stealing": {"policy": "performance_aware", "work_stealing": True},
    "shortest_queue+stealing": {"policy": "shortest_queue", "work_stealing": True},
}
DEFAULT_SEED = 20240601


def _imbalance(busy: list[float]) -> float:
    mean = statistics.fmean(busy)
    return (max(busy) - min(busy)) / mean if mean > 0 else 0.0


def simulate_core(options: dict, steps: list[list[float]], speeds: tuple[float, ...] = SPEEDS,
                  rtt: float = 0.0, jitter: float = 0.0, seed: int = 0) -> list[tuple[list[float], float]]:
    """Run the channel core over ``steps``; per step (busy per consumer, step time).
    ``rtt``: simulated seconds between a consumer's get and the items reaching it;
    ``jitter``: each item's time is off by up to this share, at random (a loaded machine:
    speeds measured from one item are off too)."""
    rng = random.Random(seed)
    now = [0.0]
    inbox: list = []

    def send(h, op) -> None:
        if op[0] == "items":
            inbox.append((h.src, op))

    core = ChannelCore("sim", send=send, clock=lambda: now[0], **options)
    names = [f"c{i}:0" for i in range(len(speeds))]
    for src in ["p:0", *names]:
        core.handle_ops(src, 1, [("hello", 1, "i", "n", src)])
    rids = iter(range(1, 1 << 30))
    for src in names:
        core.handle_ops(src, 1, [("get", next(rids), None, 1, None, None)])
    inbox.clear()
    results = []
    events: list = []        # (time, seq, consumer index, item id, seconds)
    seq = iter(range(1 << 30))
    for weights in steps:
        start = now[0]
        busy = [0.0] * len(speeds)
        core.handle_ops("p:0", 1, [("put", None, w, 0, b"") for w in weights])
        left = len(weights)
        while True:
            for src, op in inbox:       # items reach their consumer: it works on them
                i = names.index(src)
                core.handle_ops(src, 1, [("took", [it[0] for it in op[3]], False)])
                seconds = sum(it[1] for it in op[3]) / speeds[i] * (1 + rng.uniform(-jitter, jitter))
                heapq.heappush(events, (now[0] + rtt + seconds, next(seq), i, [it[0] for it in op[3]], seconds))
            inbox.clear()
            if not left:
                break
            now[0], _, i, ids, seconds = heapq.heappop(events)
            busy[i] += seconds
            left -= len(ids)
            core.handle_ops(names[i], 1, [("done", ids, seconds), ("get", next(rids), None, 1, None, None)])
        results.append((busy, now[0] - start))
    return results


def _row(label: str, per_step: list[tuple[list[float], float]], oracle: list[float]) -> dict:
    imbalances = [_imbalance(b) for b, _ in per_step]
    times = [t for _, t in per_step]
    vs = [t / o for t, o in zip(times, oracle)]
    return {"metric": f"Q3b worst step imbalance, {label}", "rlinf": max(imbalances), "unit": "%",
            "baseline": "-", "target": "<= 15%", "note": f"median {statistics.median(imbalances):.1%}, "
            f"step time {statistics.median(vs):.2f}x LPT", "config": label, "first_step": imbalances[0], "median_imbalance": statistics.median(imbalances),
            "worst_step": max(imbalances), "median_step_time": statistics.median(times),
            "vs_oracle_median": statistics.median(vs), "vs_oracle_worst": max(vs),
            "imbalances": imbalances}


def _with_items(n: int, row: dict) -> dict:
    return {**row, "items": n, "metric": row["metric"].replace("Q3b", f"Q3b {n}/step")}


def run(quick: bool = False, *, items: tuple[int, ...] = (48, 256), steps: int | None = None,
        seed: int = DEFAULT_SEED, sigma: float = 1.0, jitter: float = 0.0) -> list[dict]:
    """Every config and reference on the same weights, per items-per-step setting."""
    n_steps = steps or (8 if quick else 20)
    rows = []
    for n in items:
        rng = random.Random(seed)
        weights = [[rng.lognormvariate(0.0, sigma) for _ in range(n)] for _ in range(n_steps)]
        oracle = [max(lpt_oracle(w)) for w in weights]
        refs = {"lpt_oracle": [(lpt_oracle(w), max(lpt_oracle(w))) for w in weights],
                "least_loaded": [(least_loaded(w), max(least_loaded(w))) for w in weights]}
        for label, per_step in refs.items():
            rows.append(_with_items(n, _row(label, per_step, oracle)))
        for label, options in CONFIGS.items():
            rows.append(_with_items(n, _row(label, simulate_core(options, weights, jitter=jitter), oracle)))
    return rows


def format_table(rows: list[dict]) -> str:
    return text_table([("items", "{items}"), ("config", "{config}"), ("step 1", "{first_step:.1%}"),
                       ("median", "{median_imbalance:.1%}"), ("worst", "{worst_step:.1%}"),
                       ("step time", "{median_step_time:.2f}s"), ("vs LPT", "{vs_oracle_median:.2f}x"),
                       ("worst vs LPT", "{vs_oracle_worst:.2f}x")], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps instead of 20")
    parser.add_argument("--items", type=int, nargs="+", default=[48, 256])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--jitter", type=float, default=0.0, help="each item's time off by up to this share")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.quick, items=tuple(args.items), steps=args.steps, seed=args.seed, jitter=args.jitter)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"Q3b per step: speeds {list(SPEEDS)}, log-normal weights sigma 1, seed {args.seed}; "
          "imbalance = (max busy - min busy) / mean busy\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
