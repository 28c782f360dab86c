"""Weight store benchmarks (BENCHMARKS.md W1-W3), rlinf beside gloo, the copy floor and raw TCP in one run.

    python benchmarks/weights.py [--quick] [--gib 1.0]

W1: a bf16 state dict shaped like a ~0.5B-parameter transformer (hidden 896, MLP 4864,
    vocabulary scaled with the size: a few hundred tensors; ~1 GiB by default) goes
    from 1 publisher to 3 pullers on this machine, pulled into preallocated tensors.
    One refresh is timed in the publisher (the driver) from the start of ``publish``
    until all 3 pullers said their ``pull(newer_than=...)`` returned. Beside it, in the
    same run: gloo (4 processes, loopback TCP) broadcasting one flat buffer of the same
    bytes, and broadcasting tensor by tensor (each timed broadcast + barrier at rank
    0); and the copy floor: one memcpy of the bytes (the capture, split across 2
    threads) followed by 3 copies of them run at once in 3 threads (the pullers'
    copies), as concurrently as the cores allow, all into memory already paged in; and
    Ray when installed: ``ray.put`` of the state dict (its tensors as numpy arrays, which
    Ray stores without pickling and hands out zero-copy), then 3 actors ``ray.get`` it
    and copy it into their preallocated tensors, timed from the put until all 3 copied.
W2 (loopback, CPU-bound): the same state dict (a quarter of W1's size: 6 pullers hold a
    copy each) from the publisher's node to 3 other emulated nodes (``RLINF_NODE_ID``)
    with 2 pullers each, beside one raw TCP transfer of the same bytes between two
    processes (loopback). Every hop here costs the same 2 CPUs (kernel copies, sealing),
    so 3 nodes' transfers cannot fit in 1.5x one: W2's target is measured on emulated
    nodes with rate-limited links, ``benchmarks/weights_nodes.py``.
W3: 2 pullers pull a 4 MiB tree 500 times each while the publisher publishes 200
    versions back to back (every tensor of version v filled with v): torn reads = pulls
    whose tensors hold anything but the version the pull returned.

Medians over the timed rounds, after two warm-up rounds (the first two publishes create
the two shared-memory buckets that later versions reuse; the first pulls map them).
``--quick`` (``rlinf bench --quick``) runs 64 MiB, 3 timed rounds (8 otherwise), and W3
with 100 pulls against 40 publishes. rlinf's workers run with ``OMP_NUM_THREADS=1``:
torch's OpenMP threads spin while they wait, which starves 4 busy processes on 2 CPUs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, baseline_context, free_port, print_rows  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rlinf  # noqa: E402
from rlinf.control.client import run as run_loop  # noqa: E402
from rlinf.util.copier import copy_bytes  # noqa: E402

ctx = baseline_context("torch", "torch.distributed")
os.environ.setdefault("RLINF_PEER_TIMEOUT", "10")    # a loaded 2-vCPU VM can starve a heartbeat
PULLERS = 3
WARMUP = 2
_ONE = {"OMP_NUM_THREADS": "1"}     # torch's spinning OpenMP threads starve 4 busy processes on 2 CPUs


def state_dict_shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen2-0.5B-like state dict (bf16) of about ``total_bytes``:
    24 layers of attention (with biases) and MLP, and an embedding sized to fill the rest
    (at least one layer)."""
    hidden, mlp, kv = 896, 4864, 128
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.q_proj.bias", (hidden,)),
             ("self_attn.k_proj.weight", (kv, hidden)), ("self_attn.k_proj.bias", (kv,)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.v_proj.bias", (kv,)),
             ("self_attn.o_proj.weight", (hidden, hidden)), ("mlp.gate_proj.weight", (mlp, hidden)),
             ("mlp.up_proj.weight", (mlp, hidden)), ("mlp.down_proj.weight", (hidden, mlp)),
             ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    per_layer = 2 * sum(int(np.prod(s)) for _, s in layer)
    layers = max(1, min(24, int(total_bytes * 0.73) // per_layer))
    vocab = max(1024, (total_bytes - layers * per_layer) // (2 * hidden))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    shapes += [(f"model.layers.{i}.{name}", shape) for i in range(layers) for name, shape in layer]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


def make_state(total_bytes: int, fill: float | None = None) -> dict:
    import torch

    out = {}
    for name, shape in state_dict_shapes(total_bytes):
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.fill_(0.5 if fill is None else fill)     # pages faulted in, like a live model's
        out[name] = t
    return out


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ----------------------------------------------------------------------------- rlinf
async def _puller(comm, total: int, rounds: int, name: str = "bench") -> None:
    ws = await comm.weights(name)
    into = make_state(total, fill=0.0)
    version = 0
    for _ in range(rounds):
        version = await ws.pull(into, newer_than=version, timeout=300)
        await comm.send(version, "driver:0", timeout=60)


async def _w1_rlinf(total: int, rounds: int) -> tuple[float, int, int]:
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        ws = await comm.weights("bench")
        state = make_state(total)
        pullers = await cluster.spawn(_puller, "puller", PULLERS, args=(total, rounds), env=_ONE)
        times = []
        try:
            for version in range(1, rounds + 1):
                t0 = time.perf_counter()
                await ws.publish(state, version)
                for address in pullers.addresses:
                    assert await comm.recv(address, timeout=300) == version
                times.append(time.perf_counter() - t0)
        finally:
            await pullers.join(timeout=120)
        return statistics.median(times[WARMUP:]), len(state), nbytes(state)


async def _w2_rlinf(total: int, rounds: int) -> float:
    """W2: the publisher (this process) on a node of its own, 3 other emulated nodes
    (``RLINF_NODE_ID``) with 2 pullers each; one refresh = publish until all 6 pulled."""
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        ws = await comm.weights("w2")
        state = make_state(total)
        groups = [await cluster.spawn(_puller, f"node{i}", 2, args=(total, rounds, "w2"),
                                      env={**_ONE, "RLINF_NODE_ID": f"w2-node-{i}"}) for i in range(3)]
        addresses = [a for g in groups for a in g.addresses]
        times = []
        try:
            for version in range(1, rounds + 1):
                t0 = time.perf_counter()
                await ws.publish(state, version)
                for address in addresses:
                    assert await comm.recv(address, timeout=300) == version
                times.append(time.perf_counter() - t0)
        finally:
            for g in groups:
                await g.join(timeout=120)
        return statistics.median(times[WARMUP:])


def _raw_sink(port: int, total: int, rounds: int) -> None:
    buf = bytearray(total)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(rounds):
            got = 0
            while got < total:
                got += s.recv_into(view[got:], min(total - got, 1 << 22))
            s.sendall(b"k")


def _raw_socket(total: int, rounds: int) -> float:
    """One TCP transfer of ``total`` bytes between two processes (loopback), from a
    buffer paged in to one paged in, until the receiver's one-byte answer; median s."""
    src = np.ones(total, np.uint8)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        proc = ctx.Process(target=_raw_sink, args=(server.getsockname()[1], total, rounds))
        proc.start()
        conn, _ = server.accept()
        times = []
        with conn:
            for _ in range(rounds):
                t0 = time.perf_counter()
                conn.sendall(memoryview(src))
                conn.recv(1)
                times.append(time.perf_counter() - t0)
        proc.join(60)
    return statistics.median(times[WARMUP:])


async def _w3_publisher(comm, versions: int) -> int:
    ws = await comm.weights("race")
    tree = _flat(0)
    await ws.publish(tree, 0)
    await comm.send("ready", "driver:0", timeout=60)
    await comm.recv("driver:0", timeout=60)
    for v in range(1, versions + 1):
        for t in tree.values():
            t.fill(float(v))
        await ws.publish(tree, v)
    await comm.send(versions, "driver:0", timeout=60)
    await comm.recv("driver:0", timeout=300)      # the data lives here: stay until the pulls are done
    return versions


def _flat(v: float) -> dict:
    return {f"t{i}": np.full(1 << 17, v, np.float32) for i in range(8)}      # 8 x 512 KiB


async def _w3_puller(comm, pulls: int) -> tuple[int, int]:
    ws = await comm.weights("race")
    into = _flat(-1)
    await ws.pull(into, timeout=60)
    await comm.send("ready", "driver:0", timeout=60)
    torn, seen = 0, set()
    for _ in range(pulls):
        v = await ws.pull(into, timeout=60)
        seen.add(v)
        torn += any(not (a == v).all() for a in into.values())
    return torn, len(seen)


async def _w3(pulls: int, versions: int) -> tuple[int, int, int]:
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        pub = await cluster.spawn(_w3_publisher, "pub", args=(versions,), env=_ONE)
        await comm.recv("pub:0", timeout=60)
        readers = await cluster.spawn(_w3_puller, "reader", 2, args=(pulls // 2,), env=_ONE)
        for address in readers.addresses:
            await comm.recv(address, timeout=60)
        await comm.send("go", "pub:0")
        await comm.recv("pub:0", timeout=300)
        results = await readers.join(timeout=300)
        await comm.send("done", "pub:0")
        await pub.join(timeout=60)
        return sum(t for t, _ in results), sum(pulls // 2 for _ in results), max(s for _, s in results)


# ----------------------------------------------------------------------------- gloo
def _gloo_member(rank: int, port: int, total: int, rounds: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PULLERS + 1)
    try:
        state = make_state(total, fill=None if rank == 0 else 0.0)
        found = {}
        for name in ("per_tensor", "flat"):
            if name == "flat":      # one model's worth of memory per process at a time
                size = nbytes(state)
                del state
                flat = torch.full((size,), 1 if rank == 0 else 0, dtype=torch.uint8)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                if name == "flat":
                    dist.broadcast(flat, src=0)
                else:
                    for t in state.values():
                        dist.broadcast(t, src=0)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            found[name] = statistics.median(times[WARMUP:])
        if rank == 0:
            results.put(found)
    finally:
        dist.destroy_process_group()



def _gloo(total: int, rounds: int) -> dict[str, float]:
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_member, args=(r, port, total, rounds, results)) for r in range(PULLERS + 1)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=900)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- Ray
def _ray(total: int, rounds: int) -> float | None:
    """``ray.put`` + ``ray.get`` in 3 actors copying into their own tensors (median
    seconds), or None when Ray is not installed."""
    try:
        import ray
    except ImportError:
        return None
    import torch

    @ray.remote(num_cpus=0)
    class Puller:
        def __init__(self, shapes: list) -> None:      # (not make_state: Ray's workers lack this module)
            torch.set_num_threads(1)
            self.into = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}

        def pull(self, refs: list) -> bool:
            arrays = ray.get(refs[0])       # zero-copy views of the object store
            with torch.no_grad():
                for k, a in arrays.items():
                    self.into[k].view(torch.int16).copy_(torch.from_numpy(a))
            return True

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=3 * total,
             runtime_env={"env_vars": dict(_ONE)})
    try:
        actors = [Puller.remote(state_dict_shapes(total)) for _ in range(PULLERS)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        state = {k: t.view(torch.int16).numpy() for k, t in make_state(total).items()}
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            ref = ray.put(state)
            ray.get([a.pull.remote([ref]) for a in actors])
            times.append(time.perf_counter() - t0)
            del ref
        return statistics.median(times[WARMUP:])
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- the floor
def _at_once(pairs: list) -> None:
    threads = [threading.Thread(target=copy_bytes, args=pair) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _floor(total: int, rounds: int) -> float:
    """The capture (one memcpy, split across the CPUs) then the pullers' copies (3
    threads at once), all into memory already paged in, each copy rlinf's fastest
    (:func:`rlinf.util.copier.copy_bytes`: streamed past the cache where it can be);
    median seconds."""
    src = np.full(total, 1, np.uint8)
    bucket = np.zeros(total, np.uint8)
    dsts = [np.zeros(total, np.uint8) for _ in range(PULLERS)]
    half = total // 2
    capture = [(bucket[:half], src[:half]), (bucket[half:], src[half:])]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _at_once(capture)
        _at_once([(d, bucket) for d in dsts])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def run(quick: bool = False, gib: float | None = None) -> list[Row]:
    total = int((1 / 16 if quick else (gib or 1.0)) * (1 << 30))
    rounds = WARMUP + (3 if quick else 8)
    rl, tensors, size = run_loop(_w1_rlinf(total, rounds))
    floor = _floor(size, rounds)
    gloo = _gloo(total, rounds)
    ray_s = _ray(total, rounds)
    torn, pulls, seen = run_loop(_w3(100 if quick else 1000, 40 if quick else 200))
    w2_total = total if quick else total // 4
    w2 = run_loop(_w2_rlinf(w2_total, rounds))
    raw = _raw_socket(w2_total, rounds)
    label = f"W1 refresh {size / 2**30:.2f} GiB bf16 ({tensors} tensors), 1 -> 3 pullers"
    return [
        Row(label, rl, "gloo broadcast, one flat buffer", gloo["flat"], "s", target=">= 4x"),
        Row(label, rl, "gloo broadcast per tensor", gloo["per_tensor"], "s", target=">= 4x"),
        Row(label, rl, "copy floor (capture + 3 copies at once)", floor, "s", target="the real target",
            note="ratio < 1: how close to the floor"),
        *([Row(label, rl, "Ray: ray.put + ray.get in 3 actors", ray_s, "s")] if ray_s is not None else []),
        Row(f"W2 loopback (CPU-bound) {w2_total / 2**20:.0f} MiB, 3 emulated nodes x 2 pullers", w2,
            "one raw TCP transfer (loopback)", raw, "s", target="<= 1.5x on links: weights_nodes.py",
            note="a chain of 3 relays streaming 8 MiB chunks, local pullers copying as they land"),
        Row("W3 torn reads", float(torn), f"{pulls} pulls racing {40 if quick else 200} publishes", 0.0, "count",
            target="0", note=f"{seen} distinct versions seen by one puller"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gib", type=float, default=None, help="W1's state dict size in GiB (default 1)")
    args = parser.parse_args()
    print_rows("Weight store (W1-W3)", run(args.quick, args.gib))


if __name__ == "__main__":
    main()
