"""Same-node transfer benchmarks (BENCHMARKS.md S1-S3), rlinf beside baselines in one run.

    python benchmarks/transfer.py [--quick]

The workload is BENCHMARKS.md's nested object (10 float32 tensors of mixed sizes plus
scalars and strings) at ~40 MiB and ~400 KiB, sent between two processes on this
machine. The receiver rebuilds it and touches every page, then acks; one transfer is
timed from the send call to the ack (median over repeats, after a warm-up). At 400 KiB
the per-message cost is also measured streamed (200 messages back to back, one ack at
the end), which is how small batches flow in a pipeline. The 400 KiB rows of rlinf, raw
pyzmq and the floor are measured in alternating rounds (``ROUNDS``, each in new processes)
and report the median over rounds; the note gives each method's range over the rounds.

At 40 MiB, memcpy runs right before each rlinf transfer (``_paired_rounds``), so both are
measured with the caches a 40 MiB transfer leaves (cold) and in the same phase of this
VM's speed; the rows with views and with owned copies run in ``ROUNDS`` rounds (new
processes each) and report the medians over rounds, their notes the range of the
per-round ratios and the ratio against a memcpy repeated alone (partly in cache).

Rows: memcpy of the payload into memory already paged in (the limit), rlinf with views
(the default), rlinf sending tensors already in shared memory (``share_memory_()``: by
handle, no copy; against the torch.multiprocessing queue given the same tensors), rlinf
where the receiver owns a copy (``shm_views=False``: pulled from the sender's memory,
and with ``RLINF_SHM_PULL=0`` through a slot), rlinf with
its large copies on the loop instead of an executor (``RLINF_SHM_OFFLOAD``), raw pyzmq
multipart over ipc (msgpack header + raw frames, ``copy=False``; the receiver rebuilds
the same dict of torch tensors over the frames, without copying), at 400 KiB a
minimal hand-written shared-memory loop (``_shm_floor.py``: the limit at that size, as
memcpy is at 40 MiB; its note gives its own time against raw pyzmq), a
torch.multiprocessing Queue with tensors already shared and with fresh tensors, and
torch.distributed gloo send/recv per tensor.

``--quick`` (what ``rlinf bench --quick`` and the test suite run) takes fewer repeats and
sends numpy arrays instead of torch tensors to rlinf's and raw pyzmq's receivers, so
those receivers need not import torch (seconds per process on a small machine); the
torch.multiprocessing and gloo baselines keep torch tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _shm_floor  # noqa: E402
from _common import Row, baseline_context, free_port, nested_object, print_rows, touch  # noqa: E402

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402

ctx = baseline_context("torch")
# A loaded 2-core machine can starve a heartbeat thread for over the 2.5 s default.
os.environ.setdefault("RLINF_PEER_TIMEOUT", "10")
SIZES = {"40 MiB": 40 << 20, "400 KiB": 400 << 10}
STREAM = 200
#: Rounds of the 400 KiB rows (rlinf, raw pyzmq and the floor alternate; see ``_rounds``).
ROUNDS, ROUNDS_QUICK = 5, 1
#: Untimed transfers before the 40 MiB ones: the first few run slower (a copy-out
#: receiver also agrees to pull only after its first message).
WARMUP = 5


def _tensors(obj: dict) -> list:
    return list(obj["tensors"].values())


# ----------------------------------------------------------------------------- memcpy
def _memcpy_op(total: int):
    """One memcpy of the payload into memory already paged in, then a touch of every
    page (what the receiver does): a function that does it and returns its time."""
    src = [t.numpy() for t in _tensors(nested_object(total))]
    dst = [np.ones_like(a) for a in src]          # paged in

    def once() -> float:
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            np.copyto(d, s)
        touch(dst)
        return time.perf_counter() - t0
    return once


def _memcpy(total: int, reps: int) -> float:
    once = _memcpy_op(total)
    return statistics.median([once() for _ in range(reps + 1)][1:])


# ----------------------------------------------------------------------------- rlinf
async def _rl_sink(comm, n: int, stream: int):
    for _ in range(n):
        obj = await comm.recv("driver:0")
        touch(obj)
        del obj
        await comm.send(b"ok", "driver:0", tag=1)
    for _ in range(2 if stream else 0):     # a warm-up stream, then the timed one
        for _ in range(stream):
            obj = await comm.recv("driver:0")
            touch(obj)
            del obj
        await comm.send(b"ok", "driver:0", tag=1)


async def _rlinf(total: int, reps: int, stream: int, env: dict, torch_tensors: bool = True,
                 shared: bool = False, paired=None, warmup: int = 1) -> tuple[float, float | None, float | None]:
    """rlinf's one-at-a-time median (after ``warmup`` transfers), its streamed time per
    message, and, with ``paired`` (a function timing one run of a baseline), the median
    of that baseline run just before each timed transfer (both see the same phases of
    this VM's speed)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)            # the driver (sender) reads RLINF_SHM_OFFLOAD at start
    try:
        async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
            obj = nested_object(total, torch_tensors=torch_tensors)
            for t in _tensors(obj) if shared else ():
                t.share_memory_()     # passed by handle: no copy
            await cluster.spawn(_rl_sink, "sink", 1, args=(reps + warmup, stream), env=env)
            times, baseline = [], []
            for _ in range(reps + warmup):
                if paired is not None:
                    baseline.append(paired())
                t0 = time.perf_counter()
                await comm.send(obj, "sink:0")
                await comm.recv("sink:0", tag=1)
                times.append(time.perf_counter() - t0)
            streamed = None
            for _ in range(2 if stream else 0):     # the pool grows to its working size once
                t0 = time.perf_counter()
                for _ in range(stream):
                    await comm.send(obj, "sink:0")
                await comm.recv("sink:0", tag=1)
                streamed = (time.perf_counter() - t0) / stream
            # in a slot, or pulled from our memory: every timed one (a warm-up sent before
            # the sink's registration reached us goes through the socket: the route is not known yet)
            paths = comm.stats().transports
            assert sum(paths[p].msgs for p in ("shm", "pull") if p in paths) >= reps, \
                "rlinf did not use shared memory"
            return (statistics.median(times[warmup:]), streamed,
                    statistics.median(baseline[warmup:]) if baseline else None)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- raw pyzmq
def _zmq_sink(endpoint: str, n: int, stream: int, torch_tensors: bool = True) -> None:
    if torch_tensors:
        from torch import from_numpy
    else:
        from_numpy = np.asarray

    s = zmq.Context().socket(zmq.DEALER)
    s.connect(endpoint)

    def one() -> None:   # rebuild the same object rlinf delivers: a dict of torch tensors
        frames = s.recv_multipart(copy=False)
        meta = msgpack.unpackb(frames[0].bytes)
        tensors = {name: from_numpy(np.frombuffer(f.buffer, np.float32).reshape(shape))
                   for f, name, shape in zip(frames[1:], meta["names"], meta["shapes"])}
        obj = {k: v for k, v in meta.items() if k not in ("names", "shapes")}
        obj["tensors"] = tensors
        touch(obj)

    for _ in range(n):
        one()
        s.send(b"ok")
    for _ in range(2 if stream else 0):
        for _ in range(stream):
            one()
        s.send(b"ok")


def _raw_zmq(total: int, reps: int, stream: int, torch_tensors: bool = True) -> tuple[float, float | None]:
    obj = nested_object(total, torch_tensors=torch_tensors)
    arrays = [np.asarray(t) for t in _tensors(obj)]
    d = tempfile.mkdtemp(prefix="rlinf-bench-")
    endpoint = f"ipc://{d}/s"
    s = zmq.Context().socket(zmq.DEALER)
    s.bind(endpoint)
    p = ctx.Process(target=_zmq_sink, args=(endpoint, reps + 1, stream, torch_tensors))
    p.start()
    header = {k: v for k, v in obj.items() if k != "tensors"}
    header.update(names=list(obj["tensors"]), shapes=[a.shape for a in arrays])

    def send() -> None:
        s.send_multipart([msgpack.packb(header), *arrays], copy=False)

    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        send()
        s.recv()
        times.append(time.perf_counter() - t0)
    streamed = None
    for _ in range(2 if stream else 0):
        t0 = time.perf_counter()
        for _ in range(stream):
            send()
        s.recv()
        streamed = (time.perf_counter() - t0) / stream
    p.join()
    os.unlink(f"{d}/s")
    os.rmdir(d)
    return statistics.median(times[1:]), streamed


# ----------------------------------------------------------------------------- torch.mp Queue
def _queue_sink(q, acks, n: int) -> None:
    for _ in range(n):
        obj = q.get()
        touch(obj)
        del obj
        acks.put(b"ok")


def _torch_queue(total: int, reps: int, shared: bool) -> float:
    import torch.multiprocessing as tmp

    tctx = tmp.get_context(ctx.get_start_method())
    q, acks = tctx.Queue(), tctx.Queue()
    p = tctx.Process(target=_queue_sink, args=(q, acks, reps + 1))
    p.start()
    if shared:
        obj = nested_object(total)
        for t in _tensors(obj):
            t.share_memory_()
        objs = [obj] * (reps + 1)
    else:    # a put moves a tensor into shared memory (a copy): each rep needs new ones
        objs = [nested_object(total, seed=i) for i in range(reps + 1)]
    times = []
    for obj in objs:
        t0 = time.perf_counter()
        q.put(obj)
        acks.get()
        times.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(times[1:])


# ----------------------------------------------------------------------------- gloo
def _gloo_rank1(port: int, total: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    bufs = [torch.empty_like(t) for t in _tensors(nested_object(total))]
    ack = torch.zeros(1)
    for _ in range(n):
        for b in bufs:
            dist.recv(b, 0)
        touch(bufs)
        dist.send(ack, 0)
    dist.destroy_process_group()


def _gloo(total: int, reps: int) -> float:
    import torch
    import torch.distributed as dist

    port = free_port()
    p = ctx.Process(target=_gloo_rank1, args=(port, total, reps + 1))
    p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    tensors = _tensors(nested_object(total))
    ack = torch.zeros(1)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for t in tensors:
            dist.send(t, 1)
        dist.recv(ack, 1)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    p.join()
    return statistics.median(times[1:])


# ----------------------------------------------------------------------------- rounds
def _rounds(total: int, reps: int, stream: int, torch_tensors: bool, n: int) -> dict[str, list[tuple]]:
    """``n`` rounds of rlinf (views), raw pyzmq and the floor, each round in a new pair of
    processes and in a rotated order: ``{method: [(one at a time, streamed), ...]}``.

    This VM runs everything up to ~1.8x slower for seconds at a time (the host throttles
    its vCPUs), so methods measured once each, one after the other, can land in
    different phases and their ratio says more about the phases than the methods.
    Alternating rounds expose every method to the same mix of phases."""
    methods = {
        "rlinf": lambda: run_loop(_rlinf(total, reps, stream, {}, torch_tensors))[:2],
        "raw": lambda: _raw_zmq(total, reps, stream, torch_tensors),
        "floor": lambda: _shm_floor.run(ctx, total, reps, stream, torch_tensors),
    }
    names = list(methods)
    out: dict[str, list[tuple]] = {k: [] for k in names}
    for r in range(n):
        for k in names[r % 3:] + names[:r % 3]:
            out[k].append(methods[k]())
    return out


def _paired_rounds(total: int, reps: int, torch_tensors: bool, warmup: int, n: int) -> dict[str, tuple]:
    """``n`` rounds of rlinf with views, with owned copies (pulled) and with owned copies
    through a slot (``RLINF_SHM_PULL=0``), each transfer right after a memcpy of the same
    size: ``{method: (rlinf, memcpy, note)}``, the medians over rounds of the per-round
    medians, and the range of the per-round ratios.

    The memcpy before each transfer runs with the caches as a transfer leaves them (cold:
    the payload and slot are larger than the L3 cache), at the ~21 GB/s of BENCHMARKS.md's
    reference; a memcpy repeated alone keeps part of its 80 MiB in the 32 MiB L3 cache and
    runs ~15% faster (its time is in the S1 row's note). Rounds spread each method over
    more of this VM's speed phases (see :func:`_rounds`)."""
    envs = {"views": {}, "copy": {"RLINF_SHM_VIEWS": "0"},
            "slot": {"RLINF_SHM_VIEWS": "0", "RLINF_SHM_PULL": "0"}}
    once = _memcpy_op(total)
    got: dict[str, list[tuple]] = {k: [] for k in envs}
    for _ in range(n):
        for k, env in envs.items():
            t, _, base = run_loop(_rlinf(total, reps, 0, env, torch_tensors, paired=once, warmup=warmup))
            got[k].append((t, base))
    out = {}
    for k, results in got.items():
        ratios = [base / t for t, base in results]
        out[k] = (statistics.median(t for t, _ in results), statistics.median(b for _, b in results),
                  f"rounds: {min(ratios):.2f}-{max(ratios):.2f}x")
    return out


def _medians(results: list[tuple]) -> tuple[float, float | None]:
    """The median over rounds of each of ``(one at a time, streamed)``."""
    streamed = [s for _, s in results if s is not None]
    return statistics.median(t for t, _ in results), statistics.median(streamed) if streamed else None


def _spread(results: list[tuple], i: int) -> str:
    values = [r[i] for r in results if r[i] is not None]
    return f"{min(values) * 1e6:.0f}-{max(values) * 1e6:.0f} us" if values else "-"


# ----------------------------------------------------------------------------- table
def run(quick: bool = False, sizes: list[str] | None = None) -> list[Row]:
    rows = []
    for label, total in SIZES.items():
        if sizes and label not in sizes:
            continue
        small = total < (1 << 20)
        reps = (8 if quick else 100) if small else (3 if quick else 30)
        stream = (STREAM // 10 if quick else STREAM) if small else 0
        torch_tensors = not quick
        memcpy = _memcpy(total, reps)
        if small:   # rlinf, raw pyzmq and the floor in alternating rounds: see _rounds
            rounds = _rounds(total, reps, stream, torch_tensors, ROUNDS_QUICK if quick else ROUNDS)
            (views, views_stream), (raw, raw_stream), (floor, floor_stream) = (
                _medians(rounds[k]) for k in ("rlinf", "raw", "floor"))
            copy, _, _ = run_loop(_rlinf(total, reps, 0, {"RLINF_SHM_VIEWS": "0"}, torch_tensors))
        else:   # each transfer right after a memcpy, in rounds: see _paired_rounds
            warmup = 2 if quick else WARMUP
            paired = _paired_rounds(total, reps, torch_tensors, warmup, ROUNDS_QUICK if quick else ROUNDS)
            (views, memcpy_views, views_note), (copy, memcpy_copy, copy_note), (by_slot, memcpy_slot, slot_note) = (
                paired[k] for k in ("views", "copy", "slot"))
            raw, raw_stream = _raw_zmq(total, reps, stream, torch_tensors)
        shared_q = _torch_queue(total, reps, shared=True)
        fresh_q = _torch_queue(total, reps, shared=False)
        gloo = _gloo(total, reps)
        if small:
            spread = ", ".join(f"{k} {_spread(rounds[k], 0)}" for k in ("rlinf", "raw", "floor"))
            spread_stream = ", ".join(f"{k} {_spread(rounds[k], 1)}" for k in ("rlinf", "raw", "floor"))
            rows += [
                Row(f"S3 {label} views, one at a time", views, "raw pyzmq multipart ipc", raw, "s",
                    target=">= 2x (<= 0.5x time)", note=f"rounds: {spread}"),
                Row(f"S3 {label} views, streamed ({stream})", views_stream, "raw pyzmq multipart ipc", raw_stream, "s",
                    target=">= 2x (<= 0.5x time)", note=f"rounds: {spread_stream}"),
                Row(f"{label} views, one at a time", views, "hand-written shm loop (floor)", floor, "s",
                    note=f"floor takes {floor / raw:.2f}x raw pyzmq's time"),
                Row(f"{label} views, streamed ({stream})", views_stream, "hand-written shm loop (floor)", floor_stream,
                    "s", note=f"floor takes {floor_stream / raw_stream:.2f}x raw pyzmq's time"),
                Row(f"{label} views", views, "memcpy", memcpy, "s"),
                Row(f"{label} views", views, "torch.mp Queue, pre-shared", shared_q, "s"),
                Row(f"{label} views", views, "torch.mp Queue, fresh", fresh_q, "s"),
                Row(f"{label} views", views, "gloo send/recv per tensor", gloo, "s"),
                Row(f"{label} receiver owns a copy", copy, "raw pyzmq multipart ipc", raw, "s"),
            ]
        else:
            on_loop, _, _ = run_loop(_rlinf(total, reps, 0, {"RLINF_SHM_OFFLOAD": "1T"}, torch_tensors,
                                            warmup=warmup))
            by_handle, _, _ = run_loop(_rlinf(total, reps, 0, {}, True, shared=True, warmup=warmup))
            rows += [
                Row(f"S1 {label} views", views, "memcpy, each before a transfer", memcpy_views, "s",
                    target=">= 0.75x", note=f"{views_note}; memcpy alone: {memcpy * 1e3:.2f} ms "
                                            f"({memcpy / views:.2f}x)"),
                Row(f"S1 {label} pre-shared tensors, by handle", by_handle, "torch.mp Queue, pre-shared", shared_q,
                    "s", target=">= 2.5x"),
                Row(f"{label} views", views, "torch.mp Queue, pre-shared", shared_q, "s"),
                Row(f"S1 {label} views", views, "raw pyzmq multipart ipc", raw, "s", target=">= 3x"),
                Row(f"{label} views", views, "torch.mp Queue, fresh", fresh_q, "s"),
                Row(f"{label} views", views, "gloo send/recv per tensor", gloo, "s"),
                Row(f"S2 {label} receiver owns a copy", copy, "memcpy, each before a transfer", memcpy_copy, "s",
                    target=">= 0.4x", note=f"{copy_note}; pulled from the sender's memory: one copy "
                                           f"({memcpy / copy:.2f}x memcpy alone)"),
                Row(f"{label} receiver owns a copy, through a slot", by_slot, "memcpy, each before a transfer",
                    memcpy_slot, "s", note=f"{slot_note}; RLINF_SHM_PULL=0: two copies"),
                Row(f"{label} views, copy on the loop", on_loop, "rlinf views (executor copy)", views, "s",
                    note="RLINF_SHM_OFFLOAD=1T"),
            ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", action="append", choices=list(SIZES), help="only this size (repeatable)")
    args = parser.parse_args()
    print_rows("Same-node transfer (S1-S3)", run(args.quick, args.size))


if __name__ == "__main__":
    main()
