"""Q3: load balancing across consumers of unequal speed — a deterministic simulation.

BENCHMARKS.md Q3: four consumers with speeds 1, 1, 2 and 4 (weight units per second)
take items with log-normal weights (sigma 1). The work arrives in synchronous steps of
256 items; a step ends when the last consumer is done. For each step we report

    imbalance = (max busy - min busy) / mean busy,   busy = sum(weights) / speed

and the step time (max busy), as medians over the steps. No processes are started: the
policies are the real ``rlinf.channel.policies`` objects, fed the snapshots the channel
server would build (pending count/weight as items are assigned in arrival order; speed
measured with ``SpeedMeter`` and ``on_consumed`` from the previous steps). Items are
never reordered within a step.

FIFO does not pre-assign; competing consumers behave like greedy list scheduling: each
item goes to the consumer that becomes free first, which is how it is modelled here.
Policies place one item at a time here (``select_consumer``); the channel's batch
placement and work stealing (``performance_aware``'s defaults) run in
``balance_core_sim.py``, which drives the real channel core. References: RLinf's
least-loaded dispatch (fewest pending items) and the LPT oracle.

Run:  python benchmarks/balance_sim.py [--quick] [--seed N] [--steps N] [--items N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

try:
    from rlinf.channel.policies import ConsumerInfo, ItemInfo, SpeedMeter, make_policy, select_checked
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlinf.channel.policies import ConsumerInfo, ItemInfo, SpeedMeter, make_policy, select_checked

__all__ = ["SPEEDS", "POLICIES", "TARGET_IMBALANCE", "make_steps", "simulate", "lpt_oracle", "least_loaded", "run",
           "main"]

SPEEDS: tuple[float, ...] = (1.0, 1.0, 2.0, 4.0)
POLICIES: tuple[str, ...] = (
    "fifo",
    "round_robin",
    "weighted_round_robin",
    "shortest_queue",
    "performance_aware",
)
TARGET_IMBALANCE = 0.10
DEFAULT_SEED = 20240601


def make_steps(steps: int, items: int, seed: int, sigma: float = 1.0) -> list[list[float]]:
    """Log-normal item weights (mu 0), one list per step, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [[rng.lognormvariate(0.0, sigma) for _ in range(items)] for _ in range(steps)]


def _imbalance(busy: list[float]) -> float:
    mean = statistics.fmean(busy)
    return (max(busy) - min(busy)) / mean if mean > 0 else 0.0


def lpt_oracle(weights: list[float], speeds: tuple[float, ...] = SPEEDS) -> list[float]:
    """Busy time per consumer of the LPT oracle: longest item first, each to the consumer
    that finishes it first, knowing every weight and speed (reorders the step: a
    reference no channel reaches)."""
    load = [0.0] * len(speeds)
    for w in sorted(weights, reverse=True):
        i = min(range(len(speeds)), key=lambda k: (load[k] + w / speeds[k], -speeds[k]))
        load[i] += w / speeds[i]
    return load


def least_loaded(weights: list[float], speeds: tuple[float, ...] = SPEEDS) -> list[float]:
    """Busy time per consumer of RLinf's least-loaded dispatch: each item, in order, to
    the consumer with the fewest pending items (all placed at put time; ties: the first)."""
    counts, load = [0] * len(speeds), [0.0] * len(speeds)
    for w in weights:
        i = min(range(len(speeds)), key=lambda k: (counts[k], k))
        counts[i] += 1
        load[i] += w / speeds[i]
    return load


#: References beside the policies: name -> busy per consumer for one step's weights.
REFERENCES = {"least_loaded (RLinf)": least_loaded, "lpt_oracle": lpt_oracle}


def _simulate_fifo(weights: list[list[float]], speeds: tuple[float, ...]) -> list[list[float]]:
    # Competing consumers: the head of the queue goes to whoever asks first, i.e. to the
    # consumer that becomes free first (ties: lowest index, all ask at t=0).
    busy_per_step = []
    for step in weights:
        free_at = [0.0] * len(speeds)
        for w in step:
            i = min(range(len(speeds)), key=lambda k: (free_at[k], k))
            free_at[i] += w / speeds[i]
        busy_per_step.append(free_at)
    return busy_per_step


def _simulate_assigning(
    name: str, weights: list[list[float]], speeds: tuple[float, ...]
) -> list[list[float]]:
    policy = make_policy(name)
    addresses = [f"learner:{i}" for i in range(len(speeds))]
    meters = [SpeedMeter() for _ in speeds]  # the channel server's meters
    consumed_count = [0] * len(speeds)
    consumed_weight = [0.0] * len(speeds)
    busy_per_step = []
    item_id = 0
    for step in weights:
        pending_count = [0] * len(speeds)
        pending_weight = [0.0] * len(speeds)
        assigned: list[list[ItemInfo]] = [[] for _ in speeds]
        for w in step:
            item = ItemInfo(item_id=item_id, weight=w, producer="rollout:0")
            item_id += 1
            snapshot = [
                ConsumerInfo(
                    address=addresses[i],
                    node_id="sim",
                    pending_count=pending_count[i],
                    pending_weight=pending_weight[i],
                    consumed_count=consumed_count[i],
                    consumed_weight=consumed_weight[i],
                    speed=meters[i].value,
                    waiting=pending_count[i] == 0,
                )
                for i in range(len(speeds))
            ]
            i = select_checked(policy, item, snapshot)
            pending_count[i] += 1
            pending_weight[i] += w
            assigned[i].append(item)
        busy_per_step.append([pending_weight[i] / speeds[i] for i in range(len(speeds))])
        # The step runs to completion; every finished item is reported back.
        for i, items in enumerate(assigned):
            for item in items:
                seconds = item.weight / speeds[i]
                meters[i].update(item.weight, seconds)
                policy.on_consumed(addresses[i], item, seconds)
                consumed_count[i] += 1
                consumed_weight[i] += item.weight
    return busy_per_step


def simulate(name: str, weights: list[list[float]], speeds: tuple[float, ...] = SPEEDS) -> dict:
    """Run one policy over every step.

    Args:
        name: a policy name (``"fifo"`` is modelled as greedy competition).
        weights: item weights per step, in arrival order.
        speeds: consumer speeds in weight units per second.

    Returns:
        A row: policy, median / p90 / max imbalance, median step time, ideal step time
        (total weight / total speed, median over steps) and the per-step imbalances.
    """
    if name == "fifo":
        busy_per_step = _simulate_fifo(weights, speeds)
    elif name in REFERENCES:
        busy_per_step = [REFERENCES[name](step, speeds) for step in weights]
    else:
        busy_per_step = _simulate_assigning(name, weights, speeds)
    imbalances = [_imbalance(b) for b in busy_per_step]
    step_times = [max(b) for b in busy_per_step]
    ideal = [sum(step) / sum(speeds) for step in weights]
    ordered = sorted(imbalances)
    return {
        "policy": name + (" (greedy)" if name == "fifo" else ""),
        "median_imbalance": statistics.median(imbalances),
        "p90_imbalance": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_imbalance": ordered[-1],
        "median_step_time": statistics.median(step_times),
        "ideal_step_time": statistics.median(ideal),
        "step_time_vs_ideal": statistics.median(t / i for t, i in zip(step_times, ideal)),
        "imbalances": imbalances,
    }


def run(
    quick: bool = False,
    *,
    seed: int = DEFAULT_SEED,
    steps: int | None = None,
    items: int = 256,
    sigma: float = 1.0,
) -> list[dict]:
    """Simulate every built-in policy on the same item weights.

    Args:
        quick: fewer steps (8 instead of 20).
        seed: seed of the weight generator.
        steps: number of steps (overrides ``quick``).
        items: items per step.
        sigma: log-normal sigma of the weights.

    Returns:
        One row per policy (see :func:`simulate`), each also carrying the setup
        (seed, steps, items, sigma, speeds) and ``meets_target``.
    """
    n_steps = steps if steps is not None else (8 if quick else 20)
    weights = make_steps(n_steps, items, seed, sigma)
    rows = []
    for name in (*POLICIES, *REFERENCES):
        row = simulate(name, weights, SPEEDS)
        row.update(
            seed=seed,
            steps=n_steps,
            items=items,
            sigma=sigma,
            speeds=list(SPEEDS),
            meets_target=row["median_imbalance"] <= TARGET_IMBALANCE,
        )
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    header = (
        f"{'policy':<24} {'median imb':>10} {'p90 imb':>8} {'max imb':>8} "
        f"{'step time':>10} {'ideal':>8} {'vs ideal':>8}  target"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['policy']:<24} {r['median_imbalance']:>9.1%} {r['p90_imbalance']:>8.1%} "
            f"{r['max_imbalance']:>8.1%} {r['median_step_time']:>9.2f}s "
            f"{r['ideal_step_time']:>7.2f}s {r['step_time_vs_ideal']:>7.3f}x  "
            f"{'<= 10% ok' if r['meets_target'] else '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps instead of 20")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--items", type=int, default=256)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = run(args.quick, seed=args.seed, steps=args.steps, items=args.items, sigma=args.sigma)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(
        f"Q3 balance simulation: speeds {r0['speeds']}, {r0['steps']} steps x {r0['items']} "
        f"items, log-normal weights sigma {r0['sigma']}, seed {r0['seed']}"
    )
    print("imbalance = (max busy - min busy) / mean busy per step; medians over steps")
    print("step 1 has no speed measurements yet, so performance_aware starts speed-blind (max imb)\n")
    print(format_table(rows))
    best = min((r for r in rows if r["policy"] not in REFERENCES), key=lambda r: r["median_imbalance"])
    verdict = "meets" if best["meets_target"] else "MISSES"
    print(
        f"\nbest: {best['policy']} at {best['median_imbalance']:.1%} median imbalance "
        f"({verdict} the Q3 target of <= {TARGET_IMBALANCE:.0%})"
    )
    return 0 if best["meets_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
