"""The demo's driver: starts the cluster, shows progress, prints the report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from ..control import client as control
from ..errors import RlinfError
from ..tools.top import RateTracker, format_bytes
from . import workers

__all__ = ["run"]

CHANNEL = "trajectories"
_SPARK = "▁▂▃▄▅▆▇█"


def _config(args: argparse.Namespace) -> dict[str, Any]:
    iterations = args.iterations if args.iterations is not None else (10 if args.quick else 60)
    return {
        **workers.DEFAULTS,
        "steps_per_iter": args.steps_per_iter, "envs": args.envs, "seed": args.seed,
        "iterations": iterations, "window": args.window,
        "target": args.target if args.target is not None else 475.0,
    }


def _check(args: argparse.Namespace) -> str | None:
    from .options import POLICIES

    if args.rollouts < 1 or args.learners < 1:
        return "--rollouts and --learners must be at least 1"
    if args.envs < 1 or args.steps_per_iter < 100:
        return "--envs must be at least 1 and --steps-per-iter at least 100"
    if args.iterations is not None and args.iterations < 1:
        return "--iterations must be at least 1"
    if args.policy.replace("-", "_") not in POLICIES:
        return f"unknown --policy {args.policy!r}; choose one of {', '.join(POLICIES)}"
    return None


class Display:
    """Live progress (rich) on a terminal, one plain line per iteration otherwise."""

    def __init__(self, cap: int, plain: bool) -> None:
        self.cap = cap
        self.plain = plain or not sys.stdout.isatty()
        self.episodes = 0
        self._progress = None
        if not self.plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]iteration"), MofNCompleteColumn(), BarColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"))
            self._task = self._progress.add_task("starting workers ...", total=cap)
            self._progress.start()

    def note(self, text: str) -> None:
        """A line printed once, above the live display."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)
        else:
            print(text, flush=True)

    def iteration(self, p: dict, traffic_rate: float) -> None:
        self.episodes += p["episodes"]
        eps_rate = self.episodes / p["time"] if p["time"] > 0 else 0.0
        text = (f"{eps_rate:6.1f} episodes/s  mean return {p['mean_return']:6.1f}  "
                f"recent {p['recent_mean']:6.1f}  traffic {format_bytes(traffic_rate)}/s")
        if self._progress is not None:
            self._progress.update(self._task, completed=p["iteration"], description=text)
        else:
            print(f"iteration {p['iteration']:3d}/{self.cap}  {text}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class Traffic:
    """Cluster-wide bytes sent per second, from the embedded manager's snapshots (the
    counters every worker reports with its heartbeats, the same data ``rlinf top`` shows)."""

    def __init__(self, manager) -> None:
        self._manager = manager
        self._tracker = RateTracker()

    def rate(self) -> float:
        if self._manager is None:
            return 0.0
        rates = self._tracker.update(self._manager.snapshot())
        return sum(r.bytes_out for r in rates.values())


async def _progress_loop(comm, learner0: str, display: Display, traffic: Traffic, timeout: float) -> list[dict]:
    history = []
    while True:
        p = await comm.recv(learner0, tag=workers.PROGRESS_TAG, timeout=timeout)
        history.append(p)
        display.iteration(p, traffic.rate())
        if p["last"]:
            return history


async def _train(progress: asyncio.Future, joined: asyncio.Future, timeout: float) -> list[dict]:
    """Wait for the learners' last progress report. The workers return only after the
    driver's finish message, so ``joined`` completing first means a worker failed: that
    ends the job at once, with the failing worker's own traceback."""
    done, _ = await asyncio.wait({progress, joined}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if not done:
        raise TimeoutError(f"the demo did not finish within {timeout:.0f} s")
    if joined in done:
        await joined   # raises WorkerFailedError with the remote traceback
    try:
        return await progress
    except RlinfError:
        await asyncio.wait({joined}, timeout=10)   # prefer the failing worker's error
        if joined.done() and not joined.cancelled() and joined.exception() is not None:
            raise joined.exception() from None
        raise


def _as_dict(obj: Any) -> Any:
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_as_dict(v) for v in obj]
    if hasattr(obj, "to_dict"):
        return _as_dict(obj.to_dict())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


async def _job(args: argparse.Namespace, cfg: dict, display: Display) -> dict:
    from ..launch.cluster import Cluster

    # Local worker deaths are seen at once (the manager watches their pids); the heartbeat
    # timeout only matters for stalls, and 2 busy cores can stall a process for seconds.
    os.environ.setdefault("RLINF_PEER_TIMEOUT", "10")
    t0 = time.perf_counter()
    learners = [f"learner:{i}" for i in range(args.learners)]
    rollouts = [f"rollout:{i}" for i in range(args.rollouts)]
    summary: dict[str, Any] = {"config": {**cfg, "rollouts": args.rollouts, "learners": args.learners,
                                          "policy": args.policy}}
    async with Cluster() as cluster, cluster.connect("driver:0") as comm:
        display.note(f"watch it live in another terminal: rlinf top --manager {cluster.manager_address} "
                     f"--token {cluster.token}")
        display.status("starting the channel and the workers ...")
        ch = await cluster.create_channel(CHANNEL, policy=args.policy.replace("-", "_"))
        lgroup, rgroup = await asyncio.gather(
            cluster.spawn(workers.learner_main, "learner", args.learners,
                          args=(cfg, learners, rollouts, CHANNEL, comm.address)),
            cluster.spawn(workers.rollout_main, "rollout", args.rollouts,
                          args=(cfg, learners[0], rollouts, CHANNEL, comm.address)),
        )
        t_ready = time.perf_counter()
        display.status("workers are loading torch and gymnasium ...")
        traffic = Traffic(cluster.manager)
        progress = asyncio.ensure_future(_progress_loop(comm, learners[0], display, traffic, args.timeout))
        joined = asyncio.ensure_future(asyncio.gather(lgroup.join(), rgroup.join()))
        try:
            history = await _train(progress, joined, args.timeout)
            t_trained = time.perf_counter()
            display.status("stopping ...")
            try:   # while the learners are still attached as consumers
                channel_stats = _as_dict(await ch.stats(timeout=10))
            except (RlinfError, TimeoutError) as exc:
                channel_stats = {"unavailable": str(exc)}
            for address in learners + rollouts:
                await comm.send(None, address, tag=workers.FINISH_TAG)
            learner_stats, rollout_stats = await asyncio.wait_for(joined, 60)
            await ch.close()
        finally:   # on any exit (failure, Ctrl-C): no task left behind, no unretrieved error
            for task in (progress, joined):
                task.cancel()
            await asyncio.gather(progress, joined, return_exceptions=True)
            display.close()
    t_end = time.perf_counter()
    # "training" is the learners' own clock from the first weights to the last update;
    # everything before it is start-up (processes, imports, environments, connections).
    training = history[-1]["time"] if history else 0.0
    summary.update(history=history, learners=learner_stats, rollouts=rollout_stats, channel=channel_stats,
                   timing={"startup": t_trained - t0 - training, "training": training,
                           "shutdown": t_end - t_trained, "total": t_end - t0,
                           "processes_ready": t_ready - t0})
    return summary


def _spark(values: list[float], width: int = 60) -> str:
    """A one-line bar chart of ``values`` on a 0-500 scale (averaged into ``width`` bins)."""
    if len(values) > width:
        bins = [values[len(values) * i // width:len(values) * (i + 1) // width] for i in range(width)]
        values = [sum(b) / len(b) for b in bins if b]
    top = max(500.0, *values) if values else 500.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * len(_SPARK)))] for v in values)


def _result(summary: dict) -> dict:
    """The headline numbers (also what ``--summary`` writes at the top level)."""
    history = summary["history"]
    means = [h["mean_return"] for h in history]
    k = max(1, min(3, len(means) // 3))
    last = history[-1] if history else {}
    return {
        "solved": bool(last.get("solved")),
        "iterations": len(history),
        "episodes": sum(h["episodes"] for h in history),
        "steps": sum(h["steps"] for h in history),
        "first_mean_return": means[0] if means else None,
        "last_mean_return": means[-1] if means else None,
        "first_iterations_mean": sum(means[:k]) / k if means else None,
        "last_iterations_mean": sum(means[-k:]) / k if means else None,
        "best_mean_return": max(means) if means else None,
        "recent_mean": last.get("recent_mean"),
        "seconds": summary["timing"]["total"],
    }


def report(summary: dict) -> None:
    """Print the final report."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, _width()), highlight=False)
    cfg = summary["config"]
    res = summary["result"]
    timing = summary["timing"]
    means = [h["mean_return"] for h in summary["history"]]
    console.print()
    console.print(f"[bold]rlinf demo[/] — CartPole-v1, {_n(cfg['rollouts'], 'rollout worker')} x "
                  f"{_n(cfg['envs'], 'env')}, {_n(cfg['learners'], 'learner')}, channel policy {cfg['policy']}, "
                  f"seed {cfg['seed']}")
    if res["solved"]:
        console.print(f"[green]solved[/]: mean return {res['recent_mean']:.1f} over the last {cfg['window']} "
                      f"episodes (target {cfg['target']:.0f}) after {res['iterations']} iterations")
    else:
        console.print(f"stopped at the iteration cap ({res['iterations']} iterations); mean return of the last "
                      f"{cfg['window']} episodes {res['recent_mean']:.1f} (target {cfg['target']:.0f})")
    console.print(f"time: {timing['total']:.1f} s = start-up {timing['startup']:.1f} s (processes, imports, "
                  f"environments) + training {timing['training']:.1f} s + shutdown {timing['shutdown']:.1f} s")
    train = max(timing["training"], 1e-9)
    console.print(f"episodes: {res['episodes']} ({res['episodes'] / train:.0f}/s), environment steps used: "
                  f"{res['steps']} ({res['steps'] / train:.0f}/s)")
    console.print(f"return per iteration: first {res['first_mean_return']:.1f} -> last {res['last_mean_return']:.1f} "
                  f"(best {res['best_mean_return']:.1f}; random policy ~22)")
    console.print(f"  {_spark(means)}  (scale 0-500)")

    # traffic per transport, summed over every worker's comm.stats()
    transports: dict[str, list[int]] = {}
    for w in summary["learners"] + summary["rollouts"]:
        for name, t in (w.get("comm") or {}).get("transports", {}).items():
            acc = transports.setdefault(name, [0, 0])
            acc[0] += t.get("msgs", 0)
            acc[1] += t.get("bytes", 0)
    console.print("traffic sent, by transport (sum of the workers' comm.stats()):")
    table = Table()
    table.add_column("transport")
    table.add_column("messages", justify="right")
    table.add_column("bytes", justify="right")
    for name, (msgs, nbytes) in sorted(transports.items()):
        table.add_row(name, f"{msgs:,}", format_bytes(nbytes))
    console.print(table)

    console.print("channel balance (what each learner took from the channel):")
    table = Table()
    for col in ("learner", "items", "weight (steps)", "share", "stale dropped", "waiting", "computing"):
        table.add_column(col, justify="left" if col == "learner" else "right")
    total = sum(w["weight"] for w in summary["learners"]) or 1
    for w in summary["learners"]:
        table.add_row(w["address"], str(w["items"]), str(w["weight"]), f"{w['weight'] / total:.1%}",
                      str(w["dropped"]), f"{w['wait_seconds']:.1f} s", f"{w['compute_seconds']:.1f} s")
    console.print(table)
    weights = [w["weight"] for w in summary["learners"]]
    if len(weights) > 1:
        mean = sum(weights) / len(weights)
        console.print(f"imbalance (max - min) / mean of the weight taken: {(max(weights) - min(weights)) / mean:.1%}")
    ch = summary.get("channel") or {}
    if ch.get("consumers"):
        console.print(f"channel {ch.get('name', '')!r} as its server saw it: {ch.get('policy', '?')} policy, "
                      f"{ch.get('put_count', 0)} items put, {ch.get('get_count', 0)} handed out, "
                      f"{ch.get('length', 0)} left in the queue:")
        table = Table()
        for col in ("consumer", "consumed", "weight", "busy (last 10 s)"):
            table.add_column(col, justify="left" if col == "consumer" else "right")
        for c in ch["consumers"]:
            table.add_row(str(c.get("name")), str(c.get("consumed_count")), f"{c.get('consumed_weight', 0):.0f}",
                          f"{c.get('busy_fraction', 0):.0%}")
        console.print(table)
    elif "unavailable" in ch:
        console.print(f"channel stats unavailable: {ch['unavailable']}")
    produced = ", ".join(f"{r['address']} {r['episodes']} episodes" for r in summary["rollouts"])
    console.print(f"rollout workers: {produced}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"rlinf demo: {problem}", file=sys.stderr)
        return 2
    missing = [m for m in ("torch", "gymnasium", "rich") if _missing(m)]
    if missing:
        print(f"rlinf demo needs {', '.join(missing)}: pip install 'aiorlinf[demo,torch]'", file=sys.stderr)
        return 2
    cfg = _config(args)
    display = Display(cfg["iterations"], args.plain)
    try:
        summary = control.run(_job(args, cfg, display))
    except KeyboardInterrupt:
        display.close()
        print("rlinf demo: interrupted; workers stopped", file=sys.stderr)
        return 130
    except (RlinfError, TimeoutError, OSError) as exc:
        display.close()
        print(f"rlinf demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        display.close()
    summary["result"] = _result(summary)
    report(summary)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(_as_dict({**summary["result"], "summary": summary}), f, indent=1)
    return 0


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
