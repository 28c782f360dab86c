"""GPU transfer benchmark (BENCHMARKS.md G1-G2), rlinf beside its baselines in one run.

    python benchmarks/gpu.py [--quick]

For 1 MiB, 64 MiB and 512 MiB float32 CUDA tensors between two processes on one GPU:

* device-to-device copy in one process (the limit);
* rlinf (CUDA IPC): `comm.send(tensor)` → the receiver gets a CUDA tensor and acks: the
  first send (slot set-up), one at a time (send + ack round trip), and streamed (several
  sends back to back, one ack: the steady-state bandwidth);
* rlinf staged through host memory (`RLINF_DISABLE_TRANSPORTS=cuda_ipc`), streamed;
* torch.multiprocessing Queue passing the CUDA tensor (CUDA IPC handles), receiver
  reads it and acks;

plus the per-message time of a small (4 KiB) CUDA tensor (G2). NCCL rows need two GPUs
and are reported as skipped with one.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, print_rows  # noqa: E402

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

SIZES = {"1 MiB": 1 << 20, "64 MiB": 64 << 20, "512 MiB": 512 << 20}
#: Messages per streamed round (sent back to back, one ack): steady-state bandwidth.
STREAM = {"1 MiB": 50, "64 MiB": 20, "512 MiB": 6}
CPU_4K = 4096 + 4     # a 4 KiB CPU tensor's row (G2's baseline: the same round trip without a GPU)


def _d2d(nbytes: int, reps: int) -> float:
    import torch

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


async def _rl_sink(comm, rounds, k):
    """Receive ``k`` tensors per round, wait until their data is here, ack the round."""
    import torch

    for _ in range(rounds):
        for _ in range(k):
            t = await comm.recv("driver:0")
            assert t.is_cuda or t.numel() == CPU_4K // 4
        torch.cuda.current_stream().synchronize()
        del t
        await comm.send(b"ok", "driver:0", tag=1)


async def _rlinf(reps: int, env: dict | None = None, sizes: dict | None = None) -> dict[str, tuple]:
    """Per size: (first send, steady round trip, streamed per message) in seconds."""
    import torch

    out = {}
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        cases = sizes if sizes is not None else {**SIZES, "4 KiB": 4096, "4 KiB cpu": CPU_4K}
        for name, nbytes in cases.items():
            n = reps * 20 if nbytes <= CPU_4K else reps
            k = STREAM.get(name, 0)
            group = await cluster.spawn(_rl_sink_mixed, f"sink{nbytes}", 1, args=(n + 1, k), env=env)
            t = torch.randn(nbytes // 4, device="cuda" if nbytes != CPU_4K else "cpu")
            times = []
            for _ in range(n + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await comm.send(t, group.addresses[0])
                await comm.recv(group.addresses[0], tag=1)
                times.append(time.perf_counter() - t0)
            streamed = []
            for _ in range(2 if k else 0):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(k):
                    await comm.send(t, group.addresses[0])
                await comm.recv(group.addresses[0], tag=1)
                streamed.append((time.perf_counter() - t0) / k)
            out[name] = (times[0], statistics.median(times[1:]), min(streamed) if streamed else None)
            await group.join()
    return out


async def _rl_sink_mixed(comm, n, k):
    """``n`` rounds of one message, then (``k`` > 0) two rounds of ``k``."""
    await _rl_sink(comm, n, 1)
    if k:
        await _rl_sink(comm, 2, k)


def _mp_consumer(q, acks, n):
    import torch

    for _ in range(n):
        t = q.get()
        torch.cuda.current_stream().synchronize()
        float(t[-1])
        del t
        acks.put(1)


def _torch_mp(nbytes: int, reps: int) -> float:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_mp_consumer, args=(q, acks, reps + 1))
    p.start()
    times = []
    for _ in range(reps + 1):
        t = torch.randn(nbytes // 4, device="cuda")   # a fresh tensor each time, as in a real pipeline
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        q.put(t)
        acks.get()
        times.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(times[1:])


def run(quick: bool = False) -> list[Row]:
    """The G1/G2 rows.

    Raises:
        unittest.SkipTest: no CUDA device (``rlinf bench`` shows the script as skipped).
    """
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):   # (dxg: WSL) no torch import
        raise unittest.SkipTest("no CUDA device")
    import torch

    if not torch.cuda.is_available():
        raise unittest.SkipTest("no CUDA device usable by torch")
    reps = 3 if quick else 7
    rl = run_loop(_rlinf(reps))
    staged = run_loop(_rlinf(reps, env={"RLINF_DISABLE_TRANSPORTS": "cuda_ipc,nccl"}, sizes=SIZES))
    rows = []
    for name, nbytes in SIZES.items():
        d2d = nbytes / _d2d(nbytes, reps) / 1e9
        first, steady, streamed = rl[name]
        tmp = nbytes / _torch_mp(nbytes, reps) / 1e9
        rows.append(Row(f"G1 {name} streamed", nbytes / streamed / 1e9, "device-to-device copy", d2d, "GB/s", True,
                        ">= 0.8x", note=f"{STREAM[name]} sends, one ack"))
        rows.append(Row(f"G1 {name} one at a time", nbytes / steady / 1e9, "device-to-device copy", d2d, "GB/s", True,
                        note="send + ack round trip"))
        rows.append(Row(f"G1 {name} one at a time", nbytes / steady / 1e9, "torch.mp Queue (CUDA IPC)", tmp, "GB/s",
                        True, note="fresh tensor per message"))
        s_first, s_steady, s_streamed = staged[name]
        rows.append(Row(f"G1 {name} streamed", nbytes / streamed / 1e9, "rlinf staged (host)",
                        nbytes / s_streamed / 1e9, "GB/s", True, note="RLINF_DISABLE_TRANSPORTS=cuda_ipc"))
        rows.append(Row(f"G1 {name} first send", first, "-", None, "s", note="setup: slot, share, open"))
    rows.append(Row("G2 4 KiB CUDA tensor round trip", rl["4 KiB"][1], "4 KiB CPU tensor round trip",
                    rl["4 KiB cpu"][1], "s", target="<= 100 us", note="send + ack"))
    count = torch.cuda.device_count()
    rows.append(Row("NCCL send/recv", None, "torch NCCL", None, "GB/s", True,
                    note="skipped: needs 2 GPUs" if count < 2 else "not implemented"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    try:
        rows = run(args.quick)
    except unittest.SkipTest as exc:
        print(f"skipped: {exc}")
        return
    import torch

    print_rows(f"GPU transfers on {torch.cuda.get_device_name(0)}", rows)


if __name__ == "__main__":
    main()
