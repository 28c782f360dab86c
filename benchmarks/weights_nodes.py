"""W2 on emulated nodes: a weight refresh to 3 other nodes x 2 pullers, link-bound.

Four emulated nodes (network namespaces on a bridge, ``tests/multinode/netns.py``), every
node's link limited to ``--rate-mbit`` both ways (``tc tbf``, ``Nodes.rate_limit``, with a
queue of ``--queue-ms``). Node 0 runs the manager and the publisher; nodes 1-3 run 2
pullers each. One refresh is timed from just before ``publish`` until the last of the 6
pullers' ``pull`` returned (the nodes share this machine's monotonic clock). Beside it,
in the same run, the baseline: one raw TCP transfer of the same bytes from node 0 to
node 1 (blocking sockets, ``sendall`` of a paged-in buffer, ``recv_into`` a paged-in
one, until the receiver's one-byte answer). Target (BENCHMARKS.md W2): the refresh
<= 1.5x the raw transfer. Also printed: the CPU seconds rlinf's 7 processes use per
refresh, and the raw ends per transfer.

Why a rate limit: over loopback every hop of every node costs the same 2 CPUs (kernel
copies, sealing), so 3 nodes' transfers can never fit in 1.5x of one; a cluster is bound
by its links instead. Why 200 Mbit/s by default: a raw transfer between two namespaces
reaches ~9 Gbit/s here unlimited (``--rate-mbit 0``), so it is link-bound at any of
200-1000 Mbit/s (it moves at 93-95% of the rate); but a refresh is 3 hops (every relay
receives and forwards at once) plus 6 local copies, ~1.6 CPU seconds per 64 MiB on
these 2 vCPUs shared with other engineers: at 1 Gbit/s the 3 hops need about 3 CPUs to
keep up, so the refresh measures the CPUs; at 200 Mbit/s they need about 0.6 and the
links bound it, as on a cluster. Why a 10 ms queue: a relay's link carries its inbound
TCP flow's ACKs behind its outbound data; in the harness's default 200 ms FIFO (a
bloated buffer; this kernel has no fq_codel) those ACKs wait up to 200 ms, and in a
trial at 500 Mbit/s the first relay received at ~220 Mbit/s (TCP's window over that
round trip).

    python benchmarks/weights_nodes.py [--mib 128] [--rate-mbit 200] [--rounds 3] [--queue-ms 10]

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
NODES, PER_NODE = 3, 2
RAW_PORT = 7201
_ENV = {"OMP_NUM_THREADS": "1", "RLINF_PEER_TIMEOUT": "10"}


def _cpu(procs: list[netns.NodeProcess]) -> float:
    """CPU seconds (user + system) the processes ``procs`` used so far."""
    total = 0
    for proc in procs:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])          # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


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


def _rlinf(nodes: netns.Nodes, nbytes: int, rounds: int, budget: float) -> tuple[list[float], float]:
    module = "benchmarks.weights_nodes"
    pub = nodes.agent(0, f"{module}:publisher", "trainer:0", nbytes=nbytes, rounds=rounds, env=_ENV)
    pub.expect("ready", timeout=120)
    pullers = [nodes.agent(1 + i // PER_NODE, f"{module}:puller", f"rollout:{i}", nbytes=nbytes, rounds=rounds,
                           env=_ENV) for i in range(NODES * PER_NODE)]
    for p in pullers:
        p.expect("ready", timeout=120)
    times, cpu = [], 0.0
    for version in range(1, rounds + 1):
        if version == WARMUP + 1:
            cpu = _cpu([pub, *pullers])
        pub.tell("go")
        start = pub.expect("start", timeout=budget)
        ends = [p.expect("pulled", timeout=budget) for p in pullers]
        assert all(e["version"] == version for e in ends), ends
        times.append(max(e["t"] for e in ends) - start["t0"])
    cpu = (_cpu([pub, *pullers]) - cpu) / (rounds - WARMUP)
    for p in pullers:
        p.tell("exit")
    results = [p.expect("result", timeout=60) for p in pullers]
    assert all(r["intact"] for r in results), results
    pub.tell("exit")
    print(pub.expect("result", timeout=60)["stats"])
    for p in [pub, *pullers]:
        p.wait(60)
    return times, cpu


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


def _raw(nodes: netns.Nodes, nbytes: int, rounds: int, budget: float) -> tuple[list[float], float]:
    host = nodes[1].address
    args = [host, str(RAW_PORT), str(nbytes), str(rounds)]
    sink = nodes.spawn(1, [sys.executable, "-c", _RAW, "sink", *args], name="raw-sink")
    sink.expect_line("listening", timeout=30)
    source = nodes.spawn(0, [sys.executable, "-c", _RAW, "source", *args], name="raw-source")
    times = source.expect("raw", timeout=budget * rounds)["times"]
    cpu = _cpu([sink, source]) / rounds          # with their start: an upper bound
    sink.wait(30)
    source.wait(30)
    return times, cpu


def measure(mib: int, rate_mbit: float, rounds: int, queue_ms: float) -> dict:
    nbytes = mib * MiB
    link_s = nbytes * 8 / (rate_mbit * 1e6) if rate_mbit else 0.5
    budget = 60 + 10 * link_s
    with netns.Nodes(1 + NODES) as nodes:
        nodes.start_manager(0)
        if rate_mbit:
            for i in range(1 + NODES):
                nodes.rate_limit(i, f"{int(rate_mbit)}mbit", latency=f"{queue_ms}ms")
        raw, raw_cpu = _raw(nodes, nbytes, rounds + WARMUP, budget)
        rl, rl_cpu = _rlinf(nodes, nbytes, rounds + WARMUP, budget)
    return {"raw": raw, "rlinf": rl, "nbytes": nbytes, "rate_mbit": rate_mbit, "cpu": (rl_cpu, raw_cpu)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="state dict size (default 128 MiB)")
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="each node's link (0: unlimited)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after 2 warm-up ones")
    parser.add_argument("--queue-ms", type=int, default=10, help="each link's queue (tbf latency), ms")
    args = parser.parse_args()
    reason = netns.probe()
    if reason:
        print(f"W2 on emulated nodes skipped: {reason}")
        return 2
    got = measure(args.mib, args.rate_mbit, args.rounds, args.queue_ms)
    raw, rl = statistics.median(got["raw"][WARMUP:]), statistics.median(got["rlinf"][WARMUP:])
    rate = (f"tbf {args.rate_mbit:.0f} Mbit/s per node link, queue {args.queue_ms} ms" if args.rate_mbit
            else "links unlimited")
    print(f"W2 on emulated nodes: {args.mib} MiB bf16 state dict, node 0 -> 3 nodes x 2 pullers, {rate}; "
          f"medians of {args.rounds} after {WARMUP} warm-up rounds")
    print(f"  raw rounds  {['%.3f' % t for t in got['raw']]}")
    print(f"  rlinf rounds {['%.3f' % t for t in got['rlinf']]}")
    print(f"{'rlinf refresh s':>16} {'raw TCP s':>10} {'ratio':>7} {'raw Gbit/s':>11} {'CPU s rlinf/raw':>16}  target")
    print(f"{rl:16.3f} {raw:10.3f} {rl / raw:6.2f}x {got['nbytes'] * 8 / raw / 1e9:11.2f} "
          f"{got['cpu'][0]:9.2f} / {got['cpu'][1]:4.2f}  <= 1.5x")
    print("  CPU s: user + system seconds of rlinf's 7 processes per timed refresh / of the raw sender and "
          "receiver per transfer, their start included (kernel work done in softirqs is not counted)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
