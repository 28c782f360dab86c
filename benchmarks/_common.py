"""Shared pieces of the benchmark scripts: the workloads, timing and the result table.

Every benchmark prints rlinf beside baselines measured in the same run, as medians over
repeats, with the ratio. ``Row`` is what each script's ``run(quick)`` returns, so
``rlinf bench`` can print one table for all of them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Row", "nested_object", "median_time", "print_rows", "machine", "baseline_context", "text_table",
           "round_trips", "free_port"]


def free_port() -> int:
    """A TCP port free on loopback now (for a torch.distributed baseline's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def round_trips(comm, peer: str, n: int) -> list[float]:
    """``n`` 64 B round trips with an echoing ``peer``: their times in seconds, sorted,
    the first tenth (warm-up) left out."""
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await comm.send(b"x" * 64, peer)
        await comm.recv(peer)
        lat.append(time.perf_counter() - t0)
    return sorted(lat[n // 10:])


@dataclass
class Row:
    """One line of a benchmark table.

    ``higher_is_better`` tells how to read ``ratio`` (always rlinf relative to the
    baseline, >1 meaning rlinf is better).
    """

    metric: str
    rlinf: float | None
    baseline: str
    baseline_value: float | None
    unit: str
    higher_is_better: bool = False
    target: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if not self.rlinf or not self.baseline_value:
            return None
        if self.higher_is_better:
            return self.rlinf / self.baseline_value
        return self.baseline_value / self.rlinf


def nested_object(total_bytes: int, *, torch_tensors: bool = True, seed: int = 0) -> dict:
    """BENCHMARKS.md's nested object: 10 float32 tensors of mixed sizes + scalars/strings."""
    rng = np.random.default_rng(seed)
    weights = np.array([1, 2, 3, 4, 6, 8, 10, 14, 20, 32], dtype=np.float64)
    sizes = (weights / weights.sum() * total_bytes / 4).astype(int)
    tensors = {}
    for i, n in enumerate(sizes):
        arr = rng.random(int(n), dtype=np.float32)
        if torch_tensors:
            import torch

            tensors[f"t{i}"] = torch.from_numpy(arr)
        else:
            tensors[f"t{i}"] = arr
    return {"step": 123, "reward": 0.5, "name": "rollout-batch", "tags": ["a", "b"],
            "tensors": tensors, "done": False}


def baseline_context(*preload: str):
    """The multiprocessing context for a benchmark's own baseline processes: a fork
    server that imports ``preload`` (e.g. ``"torch"``) once, so each baseline process
    starts in milliseconds instead of importing torch again (seconds on a small machine).
    Start-up is never inside a timed region; the measured code is the same as under
    spawn. (rlinf's own workers are started by ``rlinf.Cluster``, with spawn.)"""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "zmq", "msgpack", "rlinf.control.client", *preload])
    return ctx


def touch(obj) -> float:
    """Read every page of every array in ``obj`` (the receiver "uses" the data)."""
    total = 0.0
    if isinstance(obj, dict):
        for v in obj.values():
            total += touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            total += touch(v)
    elif hasattr(obj, "shape") and hasattr(obj, "dtype"):
        arr = obj.numpy() if hasattr(obj, "numpy") else obj
        flat = arr.reshape(-1).view(np.uint8)
        total += float(flat[::4096].sum()) if flat.size else 0.0
    return total


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> str:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0
    return f"{os.cpu_count()} CPUs, {mem:.0f} GiB"


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "skipped"
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.1f} us"
        return f"{value * 1e3:.2f} ms"
    if unit == "GB/s":
        return f"{value:.2f} GB/s"
    if unit == "msg/s":
        return f"{value / 1e3:.0f}k msg/s"
    return f"{value:.3g} {unit}"


def text_table(columns: list[tuple[str, str]], rows: list[dict]) -> str:
    """``rows`` as a fixed-width table: ``columns`` are (header, format) pairs, the format
    a ``str.format`` template of one row's fields, e.g. ``("vs sync", "{vs_sync:.2f}x")``;
    each column is as wide as its widest cell; text left-aligned, numbers right-aligned."""
    cells = [[template.format(**row) for _, template in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(columns)]
    text = [not any(ch.isdigit() for c in cells for ch in c[i][:1]) for i in range(len(columns))]

    def line(parts: list[str]) -> str:
        return " ".join(p.ljust(w) if left else p.rjust(w) for p, w, left in zip(parts, widths, text))
    header = line([h for h, _ in columns])
    return "\n".join([header, "-" * len(header), *(line(c) for c in cells)])


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n## {title}  ({machine()})")
    print("| metric | rlinf | baseline | baseline value | ratio (rlinf better >1) | target | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        print(f"| {r.metric} | {fmt(r.rlinf, r.unit)} | {r.baseline} | {fmt(r.baseline_value, r.unit)} | {ratio} "
              f"| {r.target} | {r.note} |")


def quick_main(doc: str, title: str, run: Callable[[bool], list[Row]]) -> None:
    """The command line of a benchmark whose only option is ``--quick``: run it and
    print its table (``doc``'s first line is the help text)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print_rows(title, run(parser.parse_args().quick))
