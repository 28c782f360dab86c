"""Small messages between emulated nodes (issue 29, P1x and P2x).

Two network namespaces joined by a bridge (``tests/multinode/netns.py``). In one run,
between the same two namespaces: rlinf's 64 B round trip (p50, p99) and 1 KiB one-way
rate, over the TCP stream link (the default, ``RLINF_TCP_STREAM=1``; sealed, and unsealed
with ``RLINF_TCP_ENCRYPTION=0``) and over ZeroMQ with CURVE (``RLINF_TCP_STREAM=0``); beside them a raw uvloop TCP echo and raw
zmq.asyncio over TCP, plain and CURVE. Each row is the median over ``--repeats`` runs,
the rows interleaved. Targets (``../shared/BENCHMARKS.md``): P1x p50 <= 2x the raw
uvloop echo, encryption on; P2x >= 2x zmq.asyncio with CURVE.

Where the two ends run decides the raw echo's round trip on a VM: on two vCPUs each
wakeup crosses CPUs (an inter-processor interrupt, a hypervisor exit: ~80 us per round
trip on our 2-vCPU machines), on one vCPU it does not (~11 us), and an unpinned pair
lands on either, so unpinned runs are bimodal. ``--placement`` pins every program of
node 0 and of node 1 (``taskset``): ``split`` (node 0 on CPU 0, node 1 on CPU 1: two
machines' worth of CPUs) and ``shared`` (both on CPU 0), and ``free`` (unpinned); one
table per placement, the rows interleaved within it.

    python benchmarks/nodes_p2p.py [--repeats 3] [--rtts 2000] [--messages 20000]
                                   [--placement split,shared]

Needs root (network namespaces); exits 2 when emulated nodes cannot be built here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.multinode import netns  # noqa: E402

RAW_PORT = 7201


def _percentiles(rtts: list[float]) -> dict:
    rtts = sorted(rtts[len(rtts) // 10:])          # the first tenth warms up
    return {"p50_us": 1e6 * statistics.median(rtts), "p99_us": 1e6 * rtts[int(0.99 * (len(rtts) - 1))]}


# ----------------------------------------------------------------------------- rlinf agents


async def client(comm, ctl, peer: str, rtts: int, messages: int):
    """Node 0: ``rtts`` 64 B round trips with ``peer``, then ``messages`` x 1 KiB to it;
    the rate is what the peer measured."""
    ping = b"x" * 64
    await comm.send(ping, peer, timeout=60)
    await comm.recv(peer, timeout=60)                # connected both ways
    lat = []
    for _ in range(rtts):
        t = time.perf_counter()
        await comm.send(ping, peer)
        await comm.recv(peer)
        lat.append(time.perf_counter() - t)
    payload = b"y" * 1024
    for _ in range(messages):
        await comm.send(payload, peer)
    rate = await comm.recv(peer, timeout=120)
    link = comm._sessions.get(peer).outbox.link      # which link carried them (reported)
    return {**_percentiles(lat), "rate": rate, "link": f"{type(link).__name__} {link.endpoint}"}


async def server(comm, ctl, peer: str, rtts: int, messages: int):
    """Node 1: echo the round trips, then time the 1 KiB messages (first to last)."""
    for _ in range(rtts + 1):
        await comm.send(await comm.recv(peer, timeout=60), peer)
    await comm.recv(peer, timeout=60)
    t = time.perf_counter()
    for _ in range(messages - 1):
        await comm.recv(peer, timeout=60)
    await comm.send((messages - 1) / (time.perf_counter() - t), peer)
    return {}


def _rlinf(nodes: netns.Nodes, env: dict, rtts: int, messages: int) -> dict:
    module = "benchmarks.nodes_p2p"
    b = nodes.agent(1, f"{module}:server", "srv:0", peer="cli:0", rtts=rtts, messages=messages, env=env)
    a = nodes.agent(0, f"{module}:client", "cli:0", peer="srv:0", rtts=rtts, messages=messages, env=env)
    result = a.expect("result", timeout=180)
    b.expect("result", timeout=60)
    a.wait(60)
    b.wait(60)
    return result


# ----------------------------------------------------------------------------- raw baselines

_RAW = r'''
import asyncio, json, statistics, struct, sys, time, uvloop
KIND, ROLE, HOST, PORT, RTTS, MESSAGES = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
KEYS = sys.argv[7:]     # curve: server public, server secret

async def tcp_server():
    done = asyncio.get_running_loop().create_future()
    class Echo(asyncio.Protocol):         # echo 64 B pings, then count the 1 KiB messages
        def connection_made(self, t): self.t, self.n, self.start = t, 0, None
        def data_received(self, d):
            if self.n < 64 * (RTTS + 1):
                self.n += len(d); self.t.write(d); return
            if self.start is None: self.start = time.perf_counter()
            self.n += len(d)
            if self.n >= 64 * (RTTS + 1) + 1024 * MESSAGES:
                rate = (MESSAGES - 1) / (time.perf_counter() - self.start)
                self.t.write(json.dumps(rate).encode().ljust(64)); done.set_result(None)
    await asyncio.get_running_loop().create_server(Echo, HOST, PORT)
    print("listening", flush=True)
    await done
    await asyncio.sleep(0.2)

async def tcp_client():
    r, w = await asyncio.open_connection(HOST, PORT)
    ping, lat = bytes(64), []
    for _ in range(RTTS + 1):
        t = time.perf_counter(); w.write(ping); await r.readexactly(64); lat.append(time.perf_counter() - t)
    payload = bytes(1024)
    for _ in range(MESSAGES):
        w.write(payload)
        if w.transport.get_write_buffer_size() > 1 << 20: await w.drain()
    rate = json.loads((await r.readexactly(64)).decode())
    print("@@ " + json.dumps({"kind": "raw", "rtts": lat[1:], "rate": rate}), flush=True)

def zsock(ctx, curve_server):
    import zmq
    s = ctx.socket(zmq.DEALER)
    if KIND == "zmq-curve":
        if curve_server:
            s.curve_server, s.curve_publickey, s.curve_secretkey = True, KEYS[0].encode(), KEYS[1].encode()
        else:
            pub, sec = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = KEYS[0].encode(), pub, sec
    return s

async def zmq_server():
    import zmq.asyncio
    s = zsock(zmq.asyncio.Context(), True); s.bind(f"tcp://{HOST}:{PORT}")
    print("listening", flush=True)
    for _ in range(RTTS + 1):
        await s.send(await s.recv())
    await s.recv(); t = time.perf_counter()
    for _ in range(MESSAGES - 1):
        await s.recv()
    await s.send(json.dumps((MESSAGES - 1) / (time.perf_counter() - t)).encode())
    await asyncio.sleep(0.2)

async def zmq_client():
    import zmq.asyncio
    s = zsock(zmq.asyncio.Context(), False); s.connect(f"tcp://{HOST}:{PORT}")
    lat = []
    for _ in range(RTTS + 1):
        t = time.perf_counter(); await s.send(bytes(64)); await s.recv(); lat.append(time.perf_counter() - t)
    payload = bytes(1024)
    for _ in range(MESSAGES):
        await s.send(payload)
    rate = json.loads(await s.recv())
    print("@@ " + json.dumps({"kind": "raw", "rtts": lat[1:], "rate": rate}), flush=True)

main = {("tcp", "server"): tcp_server, ("tcp", "client"): tcp_client}.get((KIND, ROLE))
main = main or (zmq_server if ROLE == "server" else zmq_client)
uvloop.run(main())
'''


def _raw(nodes: netns.Nodes, kind: str, rtts: int, messages: int) -> dict:
    keys: list[str] = []
    if kind == "zmq-curve":
        import zmq

        keys = [k.decode() for k in zmq.curve_keypair()]
    host = nodes[1].address
    def argv(role: str) -> list[str]:
        return [sys.executable, "-c", _RAW, kind, role, host, str(RAW_PORT), str(rtts), str(messages), *keys]

    srv = nodes.spawn(1, argv("server"), name=f"{kind}-server")
    srv.expect_line("listening", timeout=30)
    cli = nodes.spawn(0, argv("client"), name=f"{kind}-client")
    got = cli.expect("raw", timeout=180)
    srv.wait(30)
    cli.wait(30)
    return {**_percentiles(got["rtts"]), "rate": got["rate"]}


_ROWS = [
    ("raw uvloop TCP echo", ("raw", "tcp")),
    ("raw zmq.asyncio TCP, plain", ("raw", "zmq-plain")),
    ("raw zmq.asyncio TCP, CURVE", ("raw", "zmq-curve")),
    ("rlinf TCP stream, sealed", ("rlinf", {"RLINF_TCP_STREAM": "1"})),
    ("rlinf TCP stream, unsealed", ("rlinf", {"RLINF_TCP_STREAM": "1", "RLINF_TCP_ENCRYPTION": "0"})),
    ("rlinf ZeroMQ CURVE", ("rlinf", {"RLINF_TCP_STREAM": "0"})),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rtts", type=int, default=2000, help="64 B round trips per run")
    parser.add_argument("--messages", type=int, default=20000, help="1 KiB messages per run")
    parser.add_argument("--placement", default="split,shared",
                        help=f"comma-separated, of {', '.join(_PLACEMENTS)} (see above)")
    args = parser.parse_args()
    placements = [p for p in args.placement.split(",") if p]
    unknown = sorted(set(placements) - set(_PLACEMENTS))
    if unknown:
        parser.error(f"unknown placement(s) {unknown}; choose from {', '.join(_PLACEMENTS)}")
    reason = netns.probe()
    if reason:
        print(f"skipped: {reason}")
        return 2
    if "split" in placements and len(os.sched_getaffinity(0)) < 2:
        print("placement 'split' skipped: fewer than 2 CPUs here")
        placements.remove("split")
    links: set[str] = set()
    with netns.Nodes(2) as nodes:
        nodes.start_manager(0)          # unpinned: it only answers lookups
        for placement in placements:
            nodes.cpus = dict(_PLACEMENTS[placement])
            _table(placement, _measure(nodes, args, links), args)
    print(json.dumps({"links": sorted(links)}))
    return 0


#: node index -> CPUs its measured programs are pinned to
_PLACEMENTS = {"split": {0: "0", 1: "1"}, "shared": {0: "0", 1: "0"}, "free": {}}


def _measure(nodes: netns.Nodes, args: argparse.Namespace, links: set[str]) -> dict[str, dict]:
    """Every row ``args.repeats`` times, interleaved: the medians per row."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in _ROWS}
    for _ in range(args.repeats):
        for name, (what, how) in _ROWS:
            if what == "raw":
                runs[name].append(_raw(nodes, how, args.rtts, args.messages))
            else:
                got = _rlinf(nodes, how, args.rtts, args.messages)
                links.add(f"{name}: {got['link'].split(':')[0]}")
                runs[name].append({k: got[k] for k in ("p50_us", "p99_us", "rate")})
    return {name: {k: statistics.median(r[k] for r in rs) for k in ("p50_us", "p99_us", "rate")}
            for name, rs in runs.items()}


def _table(placement: str, rows: dict[str, dict], args: argparse.Namespace) -> None:
    echo, curve = rows["raw uvloop TCP echo"], rows["raw zmq.asyncio TCP, CURVE"]
    where = {"split": "node 0 on CPU 0, node 1 on CPU 1", "shared": "both nodes on CPU 0",
             "free": "unpinned"}[placement]
    print(f"\nplacement {placement} ({where}): two namespaces over a bridge; medians of {args.repeats} runs "
          f"({args.rtts} round trips, {args.messages} x 1 KiB each)")
    print("| path | 64 B RTT p50 us | p99 us | p50 / raw echo | 1 KiB msgs/s | / zmq CURVE |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p50_us'] / echo['p50_us']:.2f}x | "
              f"{r['rate']:,.0f} | {r['rate'] / curve['rate']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
