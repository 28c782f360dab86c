"""W2 on emulated nodes: a weight refresh to 3 other nodes x 2 pullers, link-bound.

Four emulated nodes (network namespaces on a bridge, ``tests/multinode/netns.py``), every
node's link limited to ``--rate-mbit`` both ways (``tc tbf``, as ``Nodes.rate_limit``
sets it). Node 0 runs the manager and the publisher; nodes 1-3 run 2 pullers each. One
refresh is timed from just before ``publish`` until the last of the 6 pullers' ``pull``
returned (the nodes share this machine's monotonic clock). Beside it, in the same run,
the baseline: one raw TCP transfer of the same bytes from node 0 to node 1 (blocking
sockets, ``sendall`` of a paged-in buffer, ``recv_into`` a paged-in one, until the
receiver's one-byte answer). Target (BENCHMARKS.md W2): the refresh <= 1.5x the raw
transfer.

Why a rate limit: over loopback every hop of every node costs the same 2 CPUs (kernel
copies, sealing), so 3 nodes' transfers can never fit in 1.5x of one; a cluster is bound
by its links instead. The default, 1000 Mbit/s, is far below what a raw transfer between
two namespaces reaches unlimited here (``--rate-mbit 0`` measures it: ~10 Gbit/s), so
the raw baseline is link-bound (it moves at ~95% of the rate).

    python benchmarks/weights_nodes.py [--mib 128] [--rate-mbit 1000] [--rounds 3]

Needs root (network namespaces); prints why and exits 2 when nodes cannot be built.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.multinode import netns  # noqa: E402

MiB = 1 << 20
WARMUP = 2
NODES, PER_NODE = int(os.environ.get("W2_NODES", 3)), int(os.environ.get("W2_PER_NODE", 2))
RAW_PORT = 7201
_ENV = {"OMP_NUM_THREADS": "1", "RLINF_PEER_TIMEOUT": "10"}


def _state(nbytes: int, fill: float | None = None) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from weights import make_state      # the W1 state dict shapes, scaled to nbytes

    return make_state(nbytes, fill)


# ----------------------------------------------------------------------------- rlinf agents
async def publisher(comm, ctl, nbytes: int, rounds: int):
    """Node 0: on each ``go``, publish the next version (``start`` says when it began)."""
    ws = await comm.weights("w2")
    state = _state(nbytes)
    ctl.emit("ready")
    for version in range(1, rounds + 1):
        await ctl.command("go", timeout=600)
        t0 = time.monotonic()
        await ws.publish(state, version, timeout=120)
        ctl.emit("start", version=version, t0=t0, published=time.monotonic())
    await ctl.command("exit", timeout=600)
    return {"stats": str(await ws.stats(timeout=30))}


async def puller(comm, ctl, nbytes: int, rounds: int):
    """Nodes 1-3: pull every version into the same preallocated tensors; ``pulled`` says
    when each pull returned and whether the last one holds the publisher's values."""
    ws = await comm.weights("w2")
    into = _state(nbytes, fill=0.0)
    ctl.emit("ready")
    version = 0
    for _ in range(rounds):
        version = await ws.pull(into, newer_than=version, timeout=300)
        ctl.emit("pulled", version=version, t=time.monotonic())
    intact = all(bool((t == 0.5).all()) for t in into.values())
    by_path = (await ws.stats(timeout=30)).this_bytes_by_path
    await ctl.command("exit", timeout=600)       # a relay's copy leaves with its process
    return {"intact": intact, "by_path": by_path}


def _rlinf(nodes: netns.Nodes, nbytes: int, rounds: int, budget: float) -> list[float]:
    module = "benchmarks.weights_nodes"
    pub = nodes.agent(0, f"{module}:publisher", "trainer:0", nbytes=nbytes, rounds=rounds, env=_ENV)
    pub.expect("ready", timeout=120)
    pullers = [nodes.agent(1 + i // PER_NODE, f"{module}:puller", f"rollout:{i}", nbytes=nbytes, rounds=rounds,
                           env=_ENV) for i in range(NODES * PER_NODE)]
    for p in pullers:
        p.expect("ready", timeout=120)
    times = []
    for version in range(1, rounds + 1):
        pub.tell("go")
        start = pub.expect("start", timeout=budget)
        ends = [p.expect("pulled", timeout=budget) for p in pullers]
        assert all(e["version"] == version for e in ends), ends
        times.append(max(e["t"] for e in ends) - start["t0"])
    for p in pullers:
        p.tell("exit")
    results = [p.expect("result", timeout=60) for p in pullers]
    assert all(r["intact"] for r in results), results
    pub.tell("exit")
    print(pub.expect("result", timeout=60)["stats"])
    for p in [pub, *pullers]:
        p.wait(60)
    return times


# ----------------------------------------------------------------------------- raw baseline
_RAW = r'''
import json, socket, sys, time
import numpy as np
ROLE, HOST, PORT, N, ROUNDS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
buf = np.ones(N, np.uint8)                       # paged in
if ROLE == "sink":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, PORT)); s.listen(1); print("listening", flush=True)
    c, _ = s.accept(); view = memoryview(buf)
    for _ in range(ROUNDS):
        got = 0
        while got < N:
            got += c.recv_into(view[got:], min(N - got, 1 << 22))
        c.sendall(b"k")
else:
    c = socket.create_connection((HOST, PORT)); times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter(); c.sendall(memoryview(buf)); c.recv(1); times.append(time.perf_counter() - t0)
    print("@@ " + json.dumps({"kind": "raw", "times": times}), flush=True)
'''


def _raw(nodes: netns.Nodes, nbytes: int, rounds: int, budget: float) -> list[float]:
    host = nodes[1].address
    args = [host, str(RAW_PORT), str(nbytes), str(rounds)]
    sink = nodes.spawn(1, [sys.executable, "-c", _RAW, "sink", *args], name="raw-sink")
    sink.expect_line("listening", timeout=30)
    source = nodes.spawn(0, [sys.executable, "-c", _RAW, "source", *args], name="raw-source")
    times = source.expect("raw", timeout=budget * rounds)["times"]
    sink.wait(30)
    source.wait(30)
    return times


def run(mib: int, rate_mbit: float, rounds: int, queue_ms: float) -> dict:
    nbytes = mib * MiB
    link_s = nbytes * 8 / (rate_mbit * 1e6) if rate_mbit else 0.5
    budget = 60 + 10 * link_s
    with netns.Nodes(1 + NODES) as nodes:
        nodes.start_manager(0)
        if rate_mbit:
            for i in range(1 + NODES):
                nodes.rate_limit(i, f"{int(rate_mbit)}mbit", latency=f"{queue_ms}ms")
        raw = _raw(nodes, nbytes, rounds + WARMUP, budget)
        rl = _rlinf(nodes, nbytes, rounds + WARMUP, budget)
    return {"raw": raw, "rlinf": rl, "nbytes": nbytes, "rate_mbit": rate_mbit}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="state dict size (default 128 MiB)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="each node's link (0: unlimited)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after 2 warm-up ones")
    parser.add_argument("--queue-ms", type=int, default=10, help="each link's queue (tbf latency), ms")
    args = parser.parse_args()
    reason = netns.probe()
    if reason:
        print(f"W2 on emulated nodes skipped: {reason}")
        return 2
    got = run(args.mib, args.rate_mbit, args.rounds, args.queue_ms)
    raw, rl = statistics.median(got["raw"][WARMUP:]), statistics.median(got["rlinf"][WARMUP:])
    rate = (f"tbf {args.rate_mbit:.0f} Mbit/s per node link, queue {args.queue_ms} ms" if args.rate_mbit
            else "links unlimited")
    print(f"W2 on emulated nodes: {args.mib} MiB bf16 state dict, node 0 -> 3 nodes x 2 pullers, {rate}; "
          f"medians of {args.rounds} after {WARMUP} warm-up rounds")
    print(f"  raw rounds  {['%.3f' % t for t in got['raw']]}")
    print(f"  rlinf rounds {['%.3f' % t for t in got['rlinf']]}")
    print(f"{'rlinf refresh s':>16} {'raw TCP s':>10} {'ratio':>7} {'raw Gbit/s':>11}  target")
    print(f"{rl:16.3f} {raw:10.3f} {rl / raw:6.2f}x {got['nbytes'] * 8 / raw / 1e9:11.2f}  <= 1.5x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
