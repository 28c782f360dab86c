"""Point-to-point benchmarks (BENCHMARKS.md P1-P4), rlinf beside raw pyzmq in one run.

    python benchmarks/p2p.py [--quick]

P1: 64 B round trip p50/p99 — rlinf vs blocking pyzmq vs zmq.asyncio on uvloop, and
    vs a Ray actor call (``ray.get(actor.echo.remote(payload))``, a private local Ray)
    when ray is installed (full runs only: starting Ray costs seconds).
P2: 1 KiB one-way message rate — rlinf vs zmq.asyncio PUSH/PULL.
P3: 40 MiB nested 10-tensor object over TCP (different RLINF_NODE_IDs) vs pyzmq
    multipart (msgpack header + raw frames), receiver touches every page, acks.
P4: one 128 MiB tensor over TCP vs one raw pyzmq frame.
TCP rows are measured with encryption (the default: CURVE on ZeroMQ, AEGIS-256 on
bulk streams) and with RLINF_TCP_ENCRYPTION=0 (PLAIN authentication, the raw baseline's conditions).

``--quick`` (what ``rlinf bench --quick`` and the test suite run) takes fewer messages
and repeats, and sends numpy arrays instead of torch tensors in P3/P4 (the raw baseline's
payload), so rlinf's receivers need not import torch (seconds per process on a small
machine).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import shutil
import tempfile
import time

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, baseline_context, nested_object, quick_main, round_trips, touch  # noqa: E402

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

ctx = baseline_context()


# ----------------------------------------------------------------------------- rlinf side
async def _rl_echo(comm, n):
    peer = "driver:0"
    for _ in range(n):
        await comm.send(await comm.recv(peer), peer)


async def _rl_flood(comm, n, size):
    payload = b"x" * size
    await comm.recv("driver:0")          # start signal
    for _ in range(n):
        await comm.send(payload, "driver:0")


async def _rl_sink(comm, n):
    for _ in range(n):
        obj = await comm.recv("driver:0")
        touch(obj)
        del obj
        await comm.send(b"ok", "driver:0", tag=1)


async def _rlinf_p2p(quick: bool, encrypt: bool) -> dict[str, float]:
    out = {}
    env_tcp = {"RLINF_NODE_ID": "bench-node-b", "RLINF_TCP_ENCRYPTION": "1" if encrypt else "0"}
    os.environ["RLINF_TCP_ENCRYPTION"] = "1" if encrypt else "0"
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        if encrypt:   # same-node rows once
            n = 1000 if quick else 20000
            await cluster.spawn(_rl_echo, "echo", 1, args=(n,))
            lat = await round_trips(comm, "echo:0", n)
            out["rtt_p50"], out["rtt_p99"] = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
            m = 10000 if quick else 200000
            await cluster.spawn(_rl_flood, "flood", 1, args=(m, 1024))
            await comm.send("go", "flood:0")
            t0 = time.perf_counter()
            for _ in range(m):
                await comm.recv("flood:0")
            out["rate"] = m / (time.perf_counter() - t0)
        reps = 2 if quick else 7
        nested = nested_object(40 << 20, torch_tensors=not quick)
        if quick:
            big = np.ones((128 << 20) // 4, dtype=np.float32)
        else:
            import torch

            big = torch.ones((128 << 20) // 4)
        for name, obj in (("nested", nested), ("big", big)):
            group = await cluster.spawn(_rl_sink, f"sink-{name}", 1, args=(reps + 1,), env=env_tcp)
            dst = group.addresses[0]
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                await comm.send(obj, dst)
                await comm.recv(dst, tag=1)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times[1:])
    return out


# ----------------------------------------------------------------------------- raw baselines
def _ipc_dir() -> str:
    """A private directory for a baseline's socket file, removed when the run ends."""
    d = tempfile.mkdtemp(prefix="rlinf-bench-")
    _DIRS.append(d)
    return d


_DIRS: list[str] = []


def _raw_echo_blocking(endpoint, n):
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(endpoint)
    for _ in range(n):
        s.send(s.recv())


def _raw_rtt_blocking(n) -> list[float]:
    d = _ipc_dir()
    ep = f"ipc://{d}/rtt"
    s = zmq.Context().socket(zmq.DEALER)
    s.bind(ep)
    p = ctx.Process(target=_raw_echo_blocking, args=(ep, n))
    p.start()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.send(b"x" * 64)
        s.recv()
        lat.append(time.perf_counter() - t0)
    p.join()
    return sorted(lat[n // 10:])


def _raw_echo_async(endpoint, n):
    import zmq.asyncio

    async def main():
        s = zmq.asyncio.Context().socket(zmq.DEALER)
        s.connect(endpoint)
        for _ in range(n):
            await s.send(await s.recv())
    run_loop(main())


async def _raw_rtt_async(n) -> list[float]:
    import zmq.asyncio

    d = _ipc_dir()
    ep = f"ipc://{d}/rtt"
    s = zmq.asyncio.Context().socket(zmq.DEALER)
    s.bind(ep)
    p = ctx.Process(target=_raw_echo_async, args=(ep, n))
    p.start()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await s.send(b"x" * 64)
        await s.recv()
        lat.append(time.perf_counter() - t0)
    p.join()
    return sorted(lat[n // 10:])


def _raw_push(endpoint, n, size):
    import zmq.asyncio

    async def main():
        s = zmq.asyncio.Context().socket(zmq.PUSH)
        s.connect(endpoint)
        payload = b"x" * size
        for _ in range(n):
            await s.send(payload)
        await asyncio.sleep(0.5)
    run_loop(main())


async def _raw_rate_async(n) -> float:
    import zmq.asyncio

    d = _ipc_dir()
    ep = f"ipc://{d}/rate"
    s = zmq.asyncio.Context().socket(zmq.PULL)
    s.bind(ep)
    p = ctx.Process(target=_raw_push, args=(ep, n, 1024))
    p.start()
    await s.recv()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        await s.recv()
    rate = (n - 1) / (time.perf_counter() - t0)
    p.join()
    return rate


def _raw_sink(endpoint, n):
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(endpoint)
    for _ in range(n):
        frames = s.recv_multipart(copy=False)
        meta = msgpack.unpackb(frames[0].bytes)
        arrays = [np.frombuffer(f.buffer, dtype=np.float32) for f in frames[1:]]
        touch(arrays)
        assert len(arrays) == len(meta["shapes"])
        del arrays, frames
        s.send(b"ok")


def _raw_tcp(obj_arrays: list[np.ndarray], reps: int) -> float:
    s = zmq.Context().socket(zmq.DEALER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    p = ctx.Process(target=_raw_sink, args=(f"tcp://127.0.0.1:{port}", reps + 1))
    p.start()
    header = msgpack.packb({"shapes": [a.shape for a in obj_arrays]})
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        s.send_multipart([header, *obj_arrays], copy=False)
        s.recv()
        times.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(times[1:])


def _ray_rtt(n: int) -> list[float] | None:
    """Sorted round trips of a 64 B argument through a Ray actor call (None without ray)."""
    try:
        import ray
    except ImportError:
        return None

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, x):
            return x

    # a private local instance: never a Ray cluster that happens to run on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = Echo.remote()
        payload = b"x" * 64
        for _ in range(200):
            ray.get(actor.echo.remote(payload))
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            ray.get(actor.echo.remote(payload))
            lat.append(time.perf_counter() - t0)
        return sorted(lat)
    finally:
        ray.shutdown()


def run(quick: bool = False) -> list[Row]:
    try:
        return _run(quick)
    finally:
        for d in _DIRS:
            shutil.rmtree(d, ignore_errors=True)


def _run(quick: bool) -> list[Row]:
    n = 1000 if quick else 20000
    reps = 2 if quick else 7
    rl = run_loop(_rlinf_p2p(quick, encrypt=True))
    rl_plain = run_loop(_rlinf_p2p(quick, encrypt=False))
    blocking = _raw_rtt_blocking(n)
    asyncio_lat = run_loop(_raw_rtt_async(n))
    rate = run_loop(_raw_rate_async(10000 if quick else 200000))
    ray_lat = None if quick else _ray_rtt(5000)
    nested = nested_object(40 << 20, torch_tensors=False)
    nested_arrays = list(nested["tensors"].values())
    raw_nested = _raw_tcp(nested_arrays, reps)
    raw_big = _raw_tcp([np.ones((128 << 20) // 4, dtype=np.float32)], reps)
    p50 = lambda lat: lat[len(lat) // 2]  # noqa: E731
    ray_rows = [] if ray_lat is None else [
        Row("P1 64 B round trip p50", rl["rtt_p50"], "Ray actor call", p50(ray_lat), "s", target=">= 4x")]
    return [
        Row("P1 64 B round trip p50", rl["rtt_p50"], "zmq.asyncio+uvloop", p50(asyncio_lat), "s", target=">= 1.0x"),
        *ray_rows,
        Row("P1 64 B round trip p50", rl["rtt_p50"], "blocking pyzmq", p50(blocking), "s"),
        Row("P1 64 B round trip p99", rl["rtt_p99"], "zmq.asyncio+uvloop", asyncio_lat[int(len(asyncio_lat) * .99)], "s"),
        Row("P2 1 KiB one-way rate", rl["rate"], "zmq.asyncio PUSH/PULL", rate, "msg/s", True, ">= 2x"),
        Row("P3 40 MiB nested, TCP (encrypted)", rl["nested"], "pyzmq multipart tcp", raw_nested, "s", target=">= 0.9x"),
        Row("P3 40 MiB nested, TCP (PLAIN)", rl_plain["nested"], "pyzmq multipart tcp", raw_nested, "s", target=">= 0.9x"),
        Row("P4 128 MiB tensor, TCP (encrypted)", rl["big"], "one pyzmq frame tcp", raw_big, "s", target=">= 1.5x"),
        Row("P4 128 MiB tensor, TCP (PLAIN)", rl_plain["big"], "one pyzmq frame tcp", raw_big, "s", target=">= 1.5x"),
    ]


def main() -> None:
    quick_main(__doc__, "Point-to-point (P1-P4)", run)


if __name__ == "__main__":
    main()
