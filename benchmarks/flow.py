"""Flow control (issue 24): a slow receiver's memory stays bounded.

F2: 4 senders x 20,000 x 8 KiB to one receiver that sleeps 1 ms (``asyncio.sleep``: its
loop keeps reading) per receive. Reported: the receiver's RSS growth (peak during the run
minus before), whether all 80,000 arrived in order per sender, and the wall time; with
rlinf's default window beside the same run with a window too large to matter (what
happened before flow control). Target: growth <= 100 MB with the default window.

    python benchmarks/flow.py [--quick]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, quick_main  # noqa: E402

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

SENDERS, MSG = 4, 8 << 10
UNBOUNDED = {"RLINF_WINDOW_BYTES": str(1 << 40), "RLINF_WINDOW_MSGS": str(1 << 40)}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _sender(comm, n: int) -> None:
    payload = bytes(MSG)
    await comm.recv("sink:0")                       # start together
    for i in range(n):
        await comm.send((i, payload), "sink:0")


async def _sink(comm, n: int) -> tuple[int, bool, float]:
    """Receive ``n`` messages from each sender, 1 ms per receive; (RSS growth, in order, s)."""
    senders = [f"src:{i}" for i in range(SENDERS)]
    before = peak = _rss()
    for s in senders:
        await comm.send("go", s)
    t0 = time.perf_counter()
    expected = dict.fromkeys(senders, 0)
    in_order = True
    for k in range(n * SENDERS):
        (i, _payload), src = await comm.recv_any()
        in_order = in_order and i == expected[src]
        expected[src] = i + 1
        await asyncio.sleep(0.001)                  # a slow consumer whose loop keeps reading
        if k % 200 == 0:
            peak = max(peak, _rss())
    return max(peak, _rss()) - before, in_order, time.perf_counter() - t0


async def _one(n: int, env: dict) -> tuple[int, bool, float]:
    async with rlinf.Cluster() as cluster:
        sink = await cluster.spawn(_sink, "sink", 1, args=(n,), env=env)
        await cluster.spawn(_sender, "src", SENDERS, args=(n,))
        (result,) = await sink.join(timeout=600)
        return result


def run(quick: bool = False) -> list[Row]:
    n = 2000 if quick else 20000
    bounded = run_loop(_one(n, {}))
    unbounded = run_loop(_one(n, UNBOUNDED))
    mb = 1 << 20
    note = (f"{SENDERS}x{n}x8KiB; in order: default window {bounded[1]}, unbounded {unbounded[1]}; "
            f"{bounded[2]:.0f} s vs {unbounded[2]:.0f} s")
    return [Row("F2 slow receiver, RSS growth", bounded[0] / mb, "no window (same run)", unbounded[0] / mb, "MB",
                target="<= 100 MB", note=note)]


if __name__ == "__main__":
    quick_main(__doc__, "Flow control", run)
