"""Small messages overtake bulk ones (issue 24, H1) on a rate-limited link between
emulated nodes.

Node 1's link is a token bucket at 100 Mbit/s (``tc tbf``, as ``Nodes.rate_limit``
sets it). A worker there sends back-to-back 40 MiB messages on tag 0 to a worker on
node 2 and, meanwhile, a 64 B ping on tag 1 every 10 ms, which the other side echoes.
Reported: the ping's round trip (p50, p99, max) while transfers run, and the transfers'
rate as a share of the link's. Beside it, in the same run, the same traffic over two raw
TCP connections between the same namespaces (uvloop; one for the bulk bytes, one for the
pings): the floor the link's queue sets. Target: p99 <= 50 ms, transfers >= 85% of the
link rate.

    python benchmarks/overtake.py [--transfers 4] [--rate-mbit 100]

Needs root (network namespaces; see ``tests/multinode/netns.py``); exits 2 when
emulated nodes cannot be built here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from tests.multinode import netns  # noqa: E402

MiB = 1 << 20
BULK = 40 * MiB
PING_EVERY = 0.010
RAW_PORTS = (7101, 7102)


def _summary(rtts: list[float], nbytes: int, seconds: float, rate_mbit: float) -> dict:
    rtts = sorted(rtts)
    return {"pings": len(rtts),
            "p50_ms": 1e3 * statistics.median(rtts) if rtts else None,
            "p99_ms": 1e3 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))] if rtts else None,
            "max_ms": 1e3 * rtts[-1] if rtts else None,
            "link_share": nbytes * 8 / seconds / (rate_mbit * 1e6)}


async def _pinger(send_ping, recv_pong, done: asyncio.Event) -> list[float]:
    """Ping every PING_EVERY seconds until ``done``; the round trips (seconds)."""
    rtts = []
    while not done.is_set():
        t = time.perf_counter()
        await send_ping()
        await recv_pong()
        rtts.append(time.perf_counter() - t)
        try:
            await asyncio.wait_for(done.wait(), PING_EVERY)
        except TimeoutError:
            pass
    return rtts


# ----------------------------------------------------------------------------- rlinf agents


async def source(comm, ctl, peer: str, transfers: int, rate_mbit: float):
    """Node 1: ``transfers`` x 40 MiB on tag 0 to ``peer``, pinging on tag 1 meanwhile."""
    data = np.ones(BULK, dtype=np.uint8)
    await comm.send("ready", peer, tag=1, timeout=60)
    await comm.recv(peer, tag=1, timeout=60)                       # both sides connected
    done = asyncio.Event()

    async def bulk() -> float:
        t = time.perf_counter()
        for _ in range(transfers):
            await comm.send(data, peer, tag=0, timeout=120)
        await comm.recv(peer, tag=2, timeout=120)                  # the last one was received
        done.set()
        return time.perf_counter() - t

    ping = np.zeros(64, dtype=np.uint8)
    pings = asyncio.ensure_future(_pinger(lambda: comm.send(ping, peer, tag=1, timeout=30),
                                          lambda: comm.recv(peer, tag=1, timeout=30), done))
    seconds = await bulk()
    rtts = await pings
    await comm.send("bye", peer, tag=2, timeout=30)               # no ping in flight any more
    return _summary(rtts, transfers * BULK, seconds, rate_mbit)


async def sink(comm, ctl, peer: str, transfers: int):
    """Node 2: receive the transfers (tag 0), echo pings (tag 1)."""
    await comm.recv(peer, tag=1, timeout=60)
    await comm.send("ready", peer, tag=1, timeout=60)

    async def echo() -> None:
        while True:
            await comm.send(await comm.recv(peer, tag=1), peer, tag=1, timeout=30)

    echoer = asyncio.ensure_future(echo())
    for _ in range(transfers):
        got = await comm.recv(peer, tag=0, timeout=120)
        assert got.nbytes == BULK
    await comm.send("done", peer, tag=2, timeout=30)
    await comm.recv(peer, tag=2, timeout=60)
    echoer.cancel()
    return {}


# ----------------------------------------------------------------------------- raw baseline

_RAW = r'''
import asyncio, json, statistics, sys, time, uvloop
BULK, PING_EVERY = {bulk}, {ping_every}
PORTS, ROLE, HOST, TRANSFERS = {ports}, sys.argv[1], sys.argv[2], int(sys.argv[3])

async def server():
    done = asyncio.get_running_loop().create_future()
    async def on_bulk(r, w):
        left = BULK * TRANSFERS
        while left:
            left -= len(await r.read(1 << 20))
        w.write(b"k"); await w.drain()
    async def on_ping(r, w):
        while (b := await r.read(64)):
            w.write(b)
        done.set_result(None)
    s1 = await asyncio.start_server(on_bulk, HOST, PORTS[0])
    s2 = await asyncio.start_server(on_ping, HOST, PORTS[1])
    print("listening", flush=True)
    await done

async def client():
    br, bw = await asyncio.open_connection(HOST, PORTS[0])
    pr, pw = await asyncio.open_connection(HOST, PORTS[1])
    data, fin, rtts = bytes(BULK), asyncio.Event(), []
    async def pings():
        while not fin.is_set():
            t = time.perf_counter(); pw.write(bytes(64)); await pr.readexactly(64)
            rtts.append(time.perf_counter() - t)
            try: await asyncio.wait_for(fin.wait(), PING_EVERY)
            except TimeoutError: pass
    p = asyncio.ensure_future(pings())
    t = time.perf_counter()
    for _ in range(TRANSFERS):
        bw.write(data); await bw.drain()
    await br.readexactly(1); seconds = time.perf_counter() - t; fin.set(); await p; pw.close()
    print("@@ " + json.dumps({{"kind": "raw", "rtts": rtts, "seconds": seconds}}), flush=True)

uvloop.run(server() if ROLE == "server" else client())
'''


def _raw(nodes: netns.Nodes, transfers: int, rate_mbit: float) -> dict:
    code = _RAW.format(bulk=BULK, ping_every=PING_EVERY, ports=RAW_PORTS)
    host = nodes[2].address
    server = nodes.spawn(2, [sys.executable, "-c", code, "server", host, str(transfers)], name="raw-server")
    server.expect_line("listening", timeout=30)
    client = nodes.spawn(1, [sys.executable, "-c", code, "client", host, str(transfers)], name="raw-client")
    got = client.expect("raw", timeout=60 + transfers * BULK * 8 / (rate_mbit * 1e6) * 3)
    server.wait(30)
    client.wait(30)
    return _summary(got["rtts"], transfers * BULK, got["seconds"], rate_mbit)


def _rlinf(nodes: netns.Nodes, transfers: int, rate_mbit: float) -> dict:
    module = "benchmarks.overtake"
    a = nodes.agent(1, f"{module}:source", "src:0", peer="dst:0", transfers=transfers, rate_mbit=rate_mbit)
    b = nodes.agent(2, f"{module}:sink", "dst:0", peer="src:0", transfers=transfers)
    budget = 90 + transfers * BULK * 8 / (rate_mbit * 1e6) * 3
    result = a.expect("result", timeout=budget)
    b.expect("result", timeout=60)
    a.wait(60)
    b.wait(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=4, help="40 MiB transfers per run (default 4)")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    reason = netns.probe()
    if reason:
        print(f"skipped: {reason}")
        return 2
    rows = []
    with netns.Nodes(3) as nodes:
        nodes.start_manager(0)
        nodes.rate_limit(1, f"{int(args.rate_mbit)}mbit")
        for _ in range(args.repeats):
            rows.append(("raw TCP (two connections)", _raw(nodes, args.transfers, args.rate_mbit)))
            rows.append(("rlinf (tags 0 and 1, one peer)", _rlinf(nodes, args.transfers, args.rate_mbit)))
    print(f"H1: 64 B ping every {PING_EVERY * 1e3:.0f} ms during {args.transfers} x 40 MiB back to back, "
          f"tbf {args.rate_mbit:.0f} Mbit/s (burst 64kb, latency 200ms)")
    print(f"{'path':34} {'pings':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'link share':>11}")
    for name, r in rows:
        def f(v):
            return f"{v:8.1f}" if v is not None else "       -"
        print(f"{name:34} {r['pings']:6d} {f(r['p50_ms'])} {f(r['p99_ms'])} {f(r['max_ms'])} "
              f"{100 * r['link_share']:10.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
