"""Module-level targets for the collective and resharding tests (the spawn context imports them).

Most scenarios are SPMD: every member, the test's driver included, runs the same
function, which checks its own results with plain asserts; a failing worker's
traceback reaches the test through ``group.join()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
# torch is imported here, at spawn time, on purpose: importing it lazily inside a running
# worker (the codec would, on the first tensor) holds the GIL for long enough on a loaded
# 2-core machine to delay heartbeats.
import torch

import rlinf
from rlinf.info import parse_address
from rlinf.collectives.reshard import reshard

T = 30.0   # timeout of every collective call in the scenarios


@dataclasses.dataclass
class Info:
    reward: np.ndarray
    name: str


def payload(address: str, big: bool = False) -> dict:
    """A nested object that depends on ``address``; ``big`` adds ~8 MiB (the topology path)."""
    seed = sum(address.encode()) % 97
    obj = {
        "who": address,
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t() + seed,     # non-contiguous
        "bf": torch.full((3,), seed, dtype=torch.bfloat16),
        "arr": np.arange(5, dtype=np.int64) * seed,
        "info": Info(np.array([seed / 2]), address),
        "tuple": (1, "x", None),
    }
    if big:   # 8 MiB + 4 KiB: three chunks of the cross-node chain
        obj["big"] = torch.arange(((8 << 20) + 4096) // 4, dtype=torch.float32) + seed
    return obj


def assert_same(a, b, path: str = "$") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, (path, a, b)


async def run(comm, scenario: str, *args):
    """The spawn target: run ``scenario`` (a name in this module) as this member."""
    return await globals()[scenario](comm, *args)


# -- every collective ----------------------------------------------------------------------
async def every_collective(comm, members: list[str]) -> str:
    g = comm.group(list(reversed(members)))
    assert g.members == sorted(members, key=parse_address)
    me, n, rank = comm.address, g.size, g.rank

    for root in g.members:                                  # small: direct
        got = await g.broadcast(payload(root) if me == root else None, root=root, timeout=T)
        assert_same(got, payload(root))
    for root in (g.members[0], g.members[-1]):              # large: topology-aware
        got = await g.broadcast(payload(root, big=True) if me == root else None, root=root, timeout=T)
        assert_same(got, payload(root, big=True))

    got = await g.gather(payload(me), root=n - 1, timeout=T)
    if rank == n - 1:
        assert len(got) == n
        for m, x in zip(g.members, got):
            assert_same(x, payload(m))
    else:
        assert got is None

    objs = [payload(m) for m in g.members] if rank == 0 else None
    assert_same(await g.scatter(objs, root=g.members[0], timeout=T), payload(me))

    for m, x in zip(g.members, await g.all_gather(payload(me), timeout=T)):
        assert_same(x, payload(m))

    got = await g.all_to_all([(me, m, torch.full((2,), rank)) for m in g.members], timeout=T)
    for i, (src, dst, t) in enumerate(got):
        assert (src, dst) == (g.members[i], me) and torch.equal(t, torch.full((2,), i))

    await g.barrier(timeout=T)

    x = np.arange(12, dtype=np.float64).reshape(3, 4) + rank
    before = x.copy()
    total = n * np.arange(12.0).reshape(3, 4) + n * (n - 1) / 2
    for op, expected in (("sum", total), ("mean", total / n), ("max", x - rank + n - 1), ("min", x - rank)):
        got = await g.all_reduce(x, op=op, timeout=T)
        assert type(got) is np.ndarray and got.dtype == x.dtype and got.shape == x.shape, op
        assert np.array_equal(got, expected), op
    assert np.array_equal(x, before)                       # not in place by default
    ints = np.array([rank, -rank], dtype=np.int32)
    assert np.array_equal(await g.all_reduce(ints, op="max", timeout=T), [n - 1, 0])
    assert np.array_equal(await g.all_reduce(ints, op="min", timeout=T), [0, -(n - 1)])
    big = torch.full((300_000,), float(rank + 1))          # 1.2 MB: reduce-scatter + all-gather
    same = await g.all_reduce(big, op="sum", inplace=True, timeout=T)
    assert same is big and torch.equal(big, torch.full((300_000,), n * (n + 1) / 2))
    half = torch.full((2, 3), rank + 0.5, dtype=torch.bfloat16)
    got = await g.all_reduce(half, op="max", timeout=T)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.full((2, 3), n - 0.5, dtype=torch.bfloat16))

    # async twins: started together (their order is fixed at the call), awaited backwards
    works = [
        g.async_broadcast("hi" if rank == 0 else None, root=0, timeout=T),
        g.async_gather(rank, root=0, timeout=T),
        g.async_scatter(list(range(n)) if rank == 0 else None, root=0, timeout=T),
        g.async_all_gather(me, timeout=T),
        g.async_all_to_all(list(range(n)), timeout=T),
        g.async_barrier(timeout=T),
        g.async_all_reduce(np.ones(3), timeout=T),
    ]
    results = [await w for w in reversed(works)][::-1]
    assert results[0] == "hi"
    assert results[1] == (list(range(n)) if rank == 0 else None)
    assert results[2] == rank and results[3] == g.members and results[4] == [rank] * n
    assert results[5] is None and np.array_equal(results[6], np.full(3, float(n)))
    assert all(w.done() for w in works)
    return g.id


# -- several groups at once ---------------------------------------------------------------
async def overlapping(comm, members: list[str], rounds: int = 5) -> int:
    """Groups over all members, the first two and the last two, used concurrently with
    each other and with point-to-point traffic; plus two Group objects of one group."""
    me = comm.address
    everyone = comm.group(members)
    first, last = sorted(members, key=parse_address)[:2], sorted(members, key=parse_address)[-2:]

    async def on_everyone():
        for r in range(rounds):
            assert await everyone.all_gather((me, r), timeout=T) == [(m, r) for m in everyone.members]

    async def on_first(g):
        for r in range(rounds):
            got = await g.all_reduce(np.full(4, g.rank + r, dtype=np.int64), timeout=T)
            assert np.array_equal(got, np.full(4, 1 + 2 * r))

    async def on_last(g):
        for r in range(rounds):
            root = g.members[r % 2]
            got = await g.broadcast((root, r) if me == root else None, root=root, timeout=T)
            assert got == (root, r)

    async def ring():
        i = everyone.rank
        nxt, prev = everyone.members[(i + 1) % everyone.size], everyone.members[i - 1]
        for r in range(rounds):
            await comm.send((me, r), nxt, tag=5, timeout=T)
            assert await comm.recv(prev, tag=5, timeout=T) == (prev, r)

    jobs = [on_everyone(), ring()]
    if me in first:
        jobs.append(on_first(comm.group(first)))
    if me in last:
        jobs.append(on_last(comm.group(last)))
    await asyncio.gather(*jobs)
    again, backwards = comm.group(members), comm.group(list(reversed(members)))
    assert again.id == everyone.id == backwards.id
    await again.barrier(timeout=T)        # shares the call numbering with `everyone`
    assert await backwards.all_gather(me, timeout=T) == everyone.members
    return len(jobs)


# -- mismatched calls ---------------------------------------------------------------------
async def mismatched(comm, members: list[str], my_root: str) -> list[str]:
    g = comm.group(members)
    outcomes = []

    async def attempt(coro):
        try:
            await coro
            outcomes.append("ok")
        except ValueError as exc:
            assert "mismatched" in str(exc) or "must" in str(exc), exc
            outcomes.append("ValueError")

    await attempt(g.broadcast("x" if comm.address == my_root else None, root=my_root, timeout=T))
    await g.barrier(timeout=T)                          # still in step after the failure
    await attempt(g.all_gather(1, timeout=T) if g.rank == 0 else g.barrier(timeout=T))
    shape = (3,) if g.rank == 0 else (4,)
    await attempt(g.all_reduce(np.zeros(shape), timeout=T))
    assert await g.all_gather(g.rank, timeout=T) == list(range(g.size))
    return outcomes


# -- failures -------------------------------------------------------------------------------
async def wait_for_victims(comm, first: list[str], second: list[str], victims: list[str]) -> list:
    """Wait for a broadcast from victims[0] (which never sends), then for an all_gather
    that needs victims[1] (which never calls): both are killed by the test."""
    out = []
    for members, start in ((first, lambda g: g.broadcast(None, root=victims[0], timeout=T)),
                           (second, lambda g: g.all_gather(comm.address, timeout=T))):
        await comm.send("ready", "driver:0", tag=8, timeout=T)
        try:
            await start(comm.group(members))
            out.append(("ok", time.time(), None))
        except rlinf.PeerLostError as exc:
            out.append(("lost", time.time(), exc.peer))
    return out


async def until_timeout(comm, members: list[str], ghost: str) -> list:
    """Collectives that wait for ``ghost``, which never joins: a timeout on every member."""
    g = comm.group(members)
    out = []
    for start in (lambda: g.barrier(timeout=1.0), lambda: g.broadcast(None, root=ghost, timeout=1.0)):
        t0 = time.monotonic()
        try:
            await start()
            out.append(("ok", 0.0))
        except rlinf.CommTimeoutError as exc:
            assert isinstance(exc, TimeoutError)
            out.append(("timeout", time.monotonic() - t0))
    return out


async def group_behaviour(comm, members: list[str]) -> list:
    """Three members: overlapping groups with p2p, then mismatched calls, then (the first
    two only, with a member that never joins) timeouts."""
    my_root = members[0] if comm.address == members[0] else members[1]     # two roots: a mismatch
    out = [await overlapping(comm, members), await mismatched(comm, members, my_root)]
    if comm.address in members[:2]:
        out.append(await until_timeout(comm, members[:2] + ["ghost:0"], "ghost:0"))
    return out


# -- resharding -------------------------------------------------------------------------------
#: (name, sources, destinations, shard sizes, dim) over driver:0 and rs:0..2
RESHARD_CASES = [
    ("4->2", ["rs:0", "driver:0", "rs:1", "rs:2"], ["rs:2", "rs:1"], [3, 0, 5, 2], 0),
    ("2->3", ["driver:0", "rs:2"], ["rs:2", "rs:0", "rs:1"], [4, 3], 1),
    ("3->3", ["rs:0", "rs:1", "rs:2"], ["rs:2", "rs:1", "rs:0"], [1, 6, 2], 0),
    ("2->3 short", ["rs:1", "driver:0"], ["rs:0", "driver:0", "rs:2"], [0, 2], -1),
]


def batch(lo: int, hi: int, dim: int) -> dict:
    """Rows ``lo:hi`` of the global batch; every value encodes its global row."""
    rows = np.arange(lo, hi)
    obj = {
        "obs": torch.tensor(rows, dtype=torch.float32)[:, None] * 10 + torch.arange(3),
        "act": rows.astype(np.int64),
        "nested": [torch.tensor(rows, dtype=torch.bfloat16)[:, None].repeat(1, 2)],
        "info": Info(rows / 2.0, "batch"),
        "meta": "constant",
    }
    if dim == 0:
        return obj

    def batch_axis_second(x):      # (b, ...) -> (2, b, ...): the batch on axis 1
        return torch.stack([x, -x]) if isinstance(x, torch.Tensor) else np.stack([x, -x])

    if dim == -1:                  # (b,) leaves only, batch last
        return {"act": rows.astype(np.int64)[None], "obs": torch.tensor(rows, dtype=torch.float64)}
    return {"obs": batch_axis_second(obj["obs"]), "act": batch_axis_second(obj["act"]),
            "nested": [batch_axis_second(obj["nested"][0])], "info": Info(np.stack([rows / 2.0] * 2), "batch"),
            "meta": "constant"}


async def reshard_cases(comm) -> list[str]:
    me, done = comm.address, []
    for name, src, dst, counts, dim in RESHARD_CASES:
        if me not in src and me not in dst:
            continue
        shard = None
        if me in src:
            i = src.index(me)
            offset = sum(counts[:i])
            shard = batch(offset, offset + counts[i], dim)
        if name == "4->2":          # the Communicator entry point, once
            async with asyncio.timeout(T):
                got = await comm.reshard(shard, src=src, dst=dst, dim=dim)
        else:
            got = await reshard(comm, shard, src=src, dst=dst, dim=dim, timeout=T)
        if me in dst:
            parts = np.array_split(np.arange(sum(counts)), len(dst))[dst.index(me)]
            lo = int(parts[0]) if len(parts) else 0
            assert_same(got, batch(lo, lo + len(parts), dim), f"{name}@{me}")
        else:
            assert got is None
        done.append(name)
    return done


async def gather_in_named_group(comm, members: list[str], name: str, then_wait: bool):
    """One all_gather in ``comm.group(members, name=name)``; then wait to be killed, or return it."""
    result = await comm.group(members, name=name).all_gather(comm.address, timeout=30)
    if then_wait:
        await comm.send("done", "driver:0", tag=9, timeout=30)
        await asyncio.Event().wait()
    return result
