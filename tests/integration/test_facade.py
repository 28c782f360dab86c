"""rlinf.init(): the torch.distributed-style facade, in processes started like torchrun's.

Each rank runs :func:`_torch_program` (or :func:`_numpy_program`) in a fresh interpreter
with the environment a launcher sets, checks every call against expected tensors, and
prints ``OK <rank>``; the test checks every rank did.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import pytest

import rlinf
from rlinf import sync as facade
from rlinf.config import LaunchEnv, Settings

pytestmark = pytest.mark.multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the rank programs (run in subprocesses) -------------------------------------------
def _expect(error, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except error as exc:
        for word in words:
            assert word in str(exc), (word, str(exc))
        return
    raise AssertionError(f"{fn.__name__} did not raise {error.__name__}")


def _torch_program() -> None:
    import torch
    import torch.distributed as dist

    comm = facade.init()
    rank, world = comm.rank, comm.world_size
    assert (world, comm.get_rank(), comm.get_world_size()) == (3, rank, 3)
    assert comm.address == f"rank:{rank}" and int(os.environ["RANK"]) == rank
    right, left = (rank + 1) % world, (rank - 1) % world

    # send / recv into the given tensor (a ring; isend so nobody waits on a full pipe)
    inbox = torch.zeros(2, 3)
    request = comm.isend(torch.full((2, 3), float(rank)), right)
    assert comm.recv(inbox, left) == left
    request.wait(30)
    assert torch.equal(inbox, torch.full((2, 3), float(left)))
    # large, non-contiguous target, from any source
    big = torch.zeros(512, 1024).t()                       # 2 MiB, a transposed view
    if rank == 1:
        comm.send(torch.arange(512 * 1024, dtype=torch.float32).reshape(1024, 512), 2)
    if rank == 2:
        assert comm.recv(big) == 1 and big.is_contiguous() is False
        assert torch.equal(big, torch.arange(512 * 1024, dtype=torch.float32).reshape(1024, 512))
    # a mismatched receive raises, naming the sender and both shapes
    if rank == 0:
        comm.send(torch.ones(3), 1, tag=7)
    if rank == 1:
        _expect(ValueError, ["rank 0", "[3]", "[4]"], comm.recv, torch.zeros(4), 0, tag=7)

    # broadcast, in place (root= and torch's src=)
    t = torch.arange(5.0) * 7 if rank == 1 else torch.zeros(5)
    comm.broadcast(t, root=1)
    assert torch.equal(t, torch.arange(5.0) * 7)
    b = torch.full((3,), 9, dtype=torch.bfloat16) if rank == 2 else torch.zeros(3, dtype=torch.bfloat16)
    comm.broadcast(b, src=2)
    assert torch.equal(b, torch.full((3,), 9, dtype=torch.bfloat16))

    # all_reduce with every op, str and torch ReduceOp
    def reduced(op, values, dtype=torch.float32):
        x = torch.tensor(values[rank], dtype=dtype)
        comm.all_reduce(x, op=op)
        return x.tolist() if dtype != torch.float32 else [round(v, 5) for v in x.tolist()]

    vals = [[1.0, -2.0], [3.0, 5.0], [2.0, 0.5]]
    assert reduced("sum", vals) == [6.0, 3.5]
    assert reduced(dist.ReduceOp.SUM, vals) == [6.0, 3.5]
    assert reduced(comm.ReduceOp.MAX, vals) == [3.0, 5.0]
    assert reduced("min", vals) == [1.0, -2.0]
    assert reduced("product", vals) == [6.0, -5.0]
    assert reduced("avg", vals) == [2.0, round(3.5 / 3, 5)]
    assert reduced("sum", [[1], [2], [3]], torch.int64) == [6]
    x = torch.ones(1000, 300) * (rank + 1)                  # large: reduced off the loop
    comm.all_reduce(x)
    assert torch.equal(x, torch.full((1000, 300), 6.0))
    # a shape mismatch on one rank raises on every rank, and nothing hangs
    bad = torch.zeros(4 if rank == 2 else 3)
    _expect(ValueError, ["mismatched collective calls", "all_reduce", "shape=(4,)" if rank != 2 else "shape=(3,)"],
            comm.all_reduce, bad)
    _expect(TypeError, ["floating"], comm.all_reduce, torch.ones(2, dtype=torch.int32), op="avg")
    badp = torch.ones(4 if rank == 2 else 3)
    _expect(ValueError, ["rank 2", "[4]", "[3]"], comm.all_reduce, badp, op="product")

    # a parameter (requires_grad) is reduced in place, as torch.distributed does it
    weight = torch.nn.Parameter(torch.ones(3) * (rank + 1))
    comm.all_reduce(weight)
    assert weight.tolist() == [6.0] * 3 and weight.requires_grad
    # gather at dst
    out = [torch.zeros(2) for _ in range(world)] if rank == 2 else [None, []][rank]   # [] too, as torch takes
    comm.gather(torch.full((2,), rank * 10.0), out, dst=2)
    if rank == 2:
        assert [o.tolist() for o in out] == [[0.0, 0.0], [10.0, 10.0], [20.0, 20.0]]
    else:
        _expect(ValueError, ["gather_list"], comm.gather, torch.zeros(2), [torch.zeros(2)] * 3, dst=2)

    # all_to_all with a different size per pair
    inputs = [torch.full((j + 1,), 100.0 * rank + j) for j in range(world)]
    outputs = [torch.zeros(rank + 1) for _ in range(world)]
    comm.all_to_all(outputs, inputs)
    assert [o.tolist() for o in outputs] == [[100.0 * i + rank] * (rank + 1) for i in range(world)]
    _expect(ValueError, ["3 tensors"], comm.all_to_all, outputs[:2], inputs)

    # barrier: rank 1 sends only after it; rank 0 sees nothing before entering it
    if rank == 0:
        fut = asyncio.run_coroutine_threadsafe(comm.communicator.recv("rank:1", tag=8, timeout=0.5), comm._loop)
        _expect(rlinf.CommTimeoutError, [], fut.result)
    comm.barrier()
    if rank == 1:
        comm.send(torch.ones(1), 0, tag=8)
    if rank == 0:
        one = torch.zeros(1)
        comm.recv(one, 1, tag=8)
        assert one.item() == 1.0

    # called in different orders: a clear error on every rank, nobody hangs
    if rank == 0:
        _expect(ValueError, ["mismatched collective calls", "broadcast", "barrier"], comm.broadcast,
                torch.zeros(1), root=0)
    else:
        _expect(ValueError, ["mismatched collective calls", "broadcast", "barrier"], comm.barrier)

    _expect(RuntimeError, ["already called"], facade.init)
    facade.shutdown()
    facade.shutdown()                                      # idempotent
    _expect(rlinf.ClosedError, [], comm.barrier)
    print(f"OK {rank}", flush=True)


def _numpy_program() -> None:
    """Joins through RLINF_MANAGER / RLINF_TOKEN / RLINF_ADDRESS (no torch imported)."""
    import numpy as np

    with facade.init(timeout=30) as comm:
        rank = comm.rank
        assert comm.address == f"np:{rank}" and comm.world_size == 2
        x = np.arange(4, dtype=np.float64) * (rank + 1)
        comm.all_reduce(x)
        assert x.tolist() == [0.0, 3.0, 6.0, 9.0]
        if rank == 0:
            comm.send(np.full(3, 5, dtype=np.int16), 1)
        else:
            got = np.zeros(3, dtype=np.int16)
            assert comm.recv(got, 0) == 0 and got.tolist() == [5, 5, 5]
        comm.barrier()
        # a timeout on one rank is a CommTimeoutError on the others too (was "cancelled")
        quick_env = {**os.environ, "RLINF_ADDRESS": f"quick:{rank}"}
        with facade.SyncCommunicator(quick_env, timeout=1.0) as quick:
            flag = np.zeros(1)
            if rank == 1:
                _expect(rlinf.CommTimeoutError, ["did not complete within 1.0 s"], quick.barrier)
                comm.send(np.ones(1), 0, tag=9)        # rank 0 calls only now
            else:
                comm.recv(flag, 1, tag=9)
                _expect(rlinf.CommTimeoutError, ["barrier", "quick:1"], quick.barrier)
            comm.barrier()
    assert "torch" not in sys.modules
    print(f"OK {rank}", flush=True)


def _host_dies_program() -> None:
    """Rank 0 (it runs the manager too) is killed after a barrier: rank 1's collective
    fails with PeerLostError instead of waiting for ever (nobody else reports losses)."""
    import time

    import numpy as np

    comm = facade.init()
    comm.barrier()
    if comm.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    _expect(rlinf.PeerLostError, ["rank:0"], comm.all_reduce, np.ones(4, np.float32))
    assert time.monotonic() - started < 10
    print(f"OK {comm.rank}", flush=True)
    os._exit(0)        # the manager's rank is gone: nothing to shut down with


# -- helpers ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run_ranks(program: str, envs: list[dict[str, str]], timeout: float, killed: tuple[int, ...] = ()) -> None:
    """Start one interpreter per env running ``program``; all must print OK <rank>, but
    the ``killed`` ranks, which must die of SIGKILL.

    On timeout every rank dumps its threads' stacks (faulthandler, SIGUSR1) into the
    failure message before it is killed.
    """
    code = ("import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
            f"from tests.integration.test_facade import {program}; {program}()")
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for env in envs]
    outputs: list[list[str]] = [[] for _ in procs]

    async def collect(p, lines):
        async for line in p.stdout:
            lines.append(line.decode(errors="replace"))

    readers = [asyncio.create_task(collect(p, out)) for p, out in zip(procs, outputs)]
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(p.wait() for p in procs))
            await asyncio.gather(*readers)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGUSR1)
        await asyncio.wait(readers, timeout=3)      # let the stack dumps arrive
        raise AssertionError("ranks did not finish:\n" + "\n".join(
            f"--- rank {r} ---\n{''.join(out)}" for r, out in enumerate(outputs))) from None
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        for task in readers:
            task.cancel()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        text = "".join(out)
        if rank in killed:
            assert p.returncode == -signal.SIGKILL, f"rank {rank} was not killed:\n{text}"
            continue
        assert p.returncode == 0 and f"OK {rank}" in text, f"rank {rank} failed:\n{text}"


# -- tests -----------------------------------------------------------------------------
async def test_three_ranks_started_like_torchrun():
    port = str(_free_port())
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(3)]
    for env in envs:
        for key in ("RLINF_MANAGER", "RLINF_TOKEN", "RLINF_ADDRESS", "TORCHELASTIC_USE_AGENT_STORE"):
            env[key] = ""
    await _run_ranks("_torch_program", envs, timeout=100)


async def test_the_death_of_the_rank_that_runs_the_manager_fails_the_others_fast():
    port = str(_free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "RLINF_MANAGER": "", "RLINF_TOKEN": "", "RLINF_ADDRESS": "", "TORCHELASTIC_USE_AGENT_STORE": ""}
            for r in range(2)]
    await _run_ranks("_host_dies_program", envs, timeout=60, killed=(0,))


async def test_join_an_existing_manager_by_rlinf_env(cluster):
    envs = [{"RLINF_MANAGER": cluster.manager_address, "RLINF_TOKEN": cluster.token,
             "RLINF_ADDRESS": f"np:{r}", "WORLD_SIZE": "2", "RANK": ""} for r in range(2)]   # "" = unset
    await _run_ranks("_numpy_program", envs, timeout=60)


def _rendezvous(env: dict[str, str]) -> dict:
    """What ``SyncCommunicator(env)`` resolves ``env`` to."""
    return facade._rendezvous(Settings.from_env(env), LaunchEnv.from_env(env))


@pytest.mark.parametrize("env, words", [
    ({}, ["RANK"]),
    ({"RANK": "0"}, ["WORLD_SIZE"]),
    ({"RANK": "3", "WORLD_SIZE": "3"}, ["WORLD_SIZE > rank"]),
    ({"RANK": "x", "WORLD_SIZE": "3"}, ["RANK='x'", "not a whole number"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "port"}, ["MASTER_PORT='port'"]),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_ADDR"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "RLINF_MANAGER": "tcp://h:1"}, ["RLINF_TOKEN"]),
    ({"RLINF_ADDRESS": "t:1", "RANK": "0", "WORLD_SIZE": "2"}, ["disagrees"]),
    ({"RLINF_ADDRESS": "nope", "WORLD_SIZE": "2"}, ["group:rank"]),
    # IPv6 got as far as binding, then blamed the port
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "29500"}, ["IPv6", "IPv4"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "[fe80::1]", "MASTER_PORT": "29500"}, ["IPv6"]),
])
def test_environment_errors(env, words):
    with pytest.raises(ValueError) as info:
        _rendezvous(env)
    for word in words:
        assert word in str(info.value)


def test_rendezvous_choices():
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    plain = _rendezvous(base)
    assert plain["manager"] == "tcp://10.0.0.5:29500" and plain["host"] is None and len(plain["token"]) == 64
    assert plain["manager_host"] == "rank:0"        # its death is reported without the manager
    assert _rendezvous(base)["token"] == plain["token"]                       # same on every rank
    assert _rendezvous({**base, "MASTER_PORT": "29501"})["token"] != plain["token"]
    assert _rendezvous({**base, "RANK": "0"})["host"] == "tcp://10.0.0.5:29500"
    assert _rendezvous({**base, "RANK": "0", "MASTER_ADDR": "node7"})["host"] == "tcp://0.0.0.0:29500"
    assert _rendezvous({**base, "RLINF_TOKEN": "s3cret"})["token"] == "s3cret"
    elastic = _rendezvous({**base, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                                  "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "localhost"})
    assert elastic["store"] == ("localhost", 29500, "rlinf/abc/0/rank/manager")
    assert elastic["host"] == "tcp://127.0.0.1:0" and elastic["manager"] is None
    joined = _rendezvous({**base, "RLINF_MANAGER": "tcp://m:1", "RLINF_TOKEN": "t",
                                 "RLINF_ADDRESS": "trainer:1"})
    assert (joined["manager"], joined["prefix"], joined["rank"]) == ("tcp://m:1", "trainer", 1)
    assert joined.get("manager_host") is None       # no rank runs that manager


def test_init_arguments():
    with pytest.raises(ValueError, match="auto"):
        rlinf.sync.init(backend="nccl")
    facade.shutdown()                                      # nothing to shut down: no-op
