"""CUDA IPC between two processes of this node (issue #9): the transport is chosen,
ordering with the sender's stream, no slot rewritten while a view lives or while the
receiver's queued work still reads it, no device-memory growth over 10,000 messages,
and a receiver killed mid-stream."""

from __future__ import annotations

import asyncio
import os

import pytest

import rlinf
from rlinf.transports.cuda import ipc as cuda_ipc

from . import workers_gpu

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.multiproc


async def _recv(driver, src: str, group, **kwargs):
    """``driver.recv``; when the worker is gone instead, its own error (with its traceback)."""
    try:
        return await driver.recv(src, **kwargs)
    except rlinf.PeerLostError:
        await group.join(timeout=30)
        raise


def _sent_by(comm, transport: str) -> int:
    stats = comm.stats().transports.get(transport)
    return 0 if stats is None else stats.msgs


async def test_gpu_buffers_go_by_cuda_ipc(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.gpu_echo, "c", 1, args=("driver:0", 3))
        for step in range(3):
            obj = {"x": torch.full((1 << 20,), float(step), device="cuda"), "cpu": torch.ones(4),
                   "bf": torch.randn(333, device="cuda").to(torch.bfloat16),
                   "nc": torch.arange(64.0, device="cuda").reshape(8, 8).t()}
            await driver.send(obj, "c:0")
            reply = await _recv(driver, "c:0", group)
            assert reply["devices"] == ["cpu", "cuda:0"]
            for key in obj:
                assert torch.equal(reply["obj"][key], obj[key]), key
        assert _sent_by(driver, "cuda_ipc") == 3
        assert await group.join() == [0]


async def test_send_follows_the_senders_stream(cluster, driver):
    """Work queued before send (a slow kernel, then a fill) is what arrives, with no
    host synchronisation by the sender."""
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.gpu_echo, "o", 1, args=("driver:0", 5))
        t = torch.zeros(4 << 20, device="cuda")
        for step in range(1, 6):
            torch.cuda._sleep(20_000_000)
            t.fill_(float(step))
            await driver.send(t, "o:0")      # then t is rewritten at once, on the same stream
            t.fill_(-1.0)
            reply = await _recv(driver, "o:0", group)
            assert bool((reply["obj"] == step).all()), step
        await group.join()


async def test_no_slot_rewritten_while_a_view_lives(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.hold_and_check, "h", 1, args=("driver:0", 20))
        t = torch.empty(1 << 20, device="cuda")
        for step in range(20):
            t.fill_(float(step))
            await driver.send(t, "h:0")
        report = await _recv(driver, "h:0", group)
        assert report == {"kept": 0.0, "now": 0.0, "all_equal": True}
        assert driver._gpu.session.sender.busy_bytes("h:0") > 0     # the kept view holds its slot
        await driver.send(None, "h:0", tag=9)
        await group.join()


async def test_slot_not_rewritten_before_the_receivers_queued_reads(cluster, driver):
    async with asyncio.timeout(180):
        n = 8
        group = await cluster.spawn(workers_gpu.slow_reader, "r", 1, args=("driver:0", n))
        t = torch.empty(1 << 20, device="cuda")
        for step in range(n):
            t.fill_(float(step + 1))
            await driver.send(t, "r:0")
        sums = await _recv(driver, "r:0", group)
        assert sums == [float((step + 1) * (1 << 20)) for step in range(n)]
        await group.join()


async def test_no_device_memory_growth_over_10000_messages(cluster, driver):
    async with asyncio.timeout(300):
        n, every = 10_000, 500
        group = await cluster.spawn(workers_gpu.drain_and_report, "m", 1, args=("driver:0", n, every))
        t = torch.randn(1024, device="cuda")
        acked, marks = 0, []
        for i in range(n):
            await driver.send(t, "m:0")
            if i + 1 - acked > 2 * every:      # a window: never more than 2 * every in flight
                acked = await _recv(driver, "m:0", group, tag=1)
            if i + 1 in (every, n):
                torch.cuda.synchronize()
                marks.append(torch.cuda.memory_allocated())
        while acked < n:
            acked = await _recv(driver, "m:0", group, tag=1)
        report = await _recv(driver, "m:0", group, tag=2)
        assert marks[1] == marks[0], marks                 # the sender's slots did not grow
        assert driver._gpu.session is not None and len(driver._gpu.session.sender._slots) <= 2 * cuda_ipc.WINDOW_SLOTS
        assert report["allocated"] == 0                     # the receiver allocates nothing
        await driver.send(None, "m:0", tag=3)
        await group.join()


async def test_receiver_killed_mid_stream(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.hold_and_check, "k", 1, args=("driver:0", 10_000))
        t = torch.randn(16 << 20, device="cuda")        # 64 MiB per message
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        gone = asyncio.Event()
        driver.on_peer_gone(lambda address, _inc: address == "k:0" and gone.set())   # after its slots went
        await driver.send(t, "k:0")
        os.kill(group.pids[0], 9)
        with pytest.raises(rlinf.PeerLostError):
            for _ in range(10_000):
                await driver.send(t, "k:0", timeout=60)
        await gone.wait()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()      # its references were released: torch frees the slots now
        assert torch.cuda.memory_allocated() <= base


async def test_sender_killed_fails_the_receive_and_forgets_its_slots(cluster, driver):
    async with asyncio.timeout(120):
        group = await cluster.spawn(workers_gpu.send_then_wait, "s", 1, args=("driver:0",))
        t = await _recv(driver, "s:0", group)
        assert bool((t == 3.0).all())
        assert any(key[0] == "s:0" for key in driver._gpu.session.reader._mapped)
        pending = driver.async_recv("s:0")
        os.kill(group.pids[0], 9)
        with pytest.raises(rlinf.PeerLostError):
            await pending
        assert not any(key[0] == "s:0" for key in driver._gpu.session.reader._mapped)
        del t


async def test_cupy_arrays_arrive_as_cupy_arrays(cluster, driver):
    cp = pytest.importorskip("cupy")
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.gpu_types, "y", 1, args=("driver:0",))
        obj = {"cp": cp.arange(100_000, dtype=cp.float32), "t": torch.ones(10, device="cuda")}
        await driver.send(obj, "y:0")
        types = await _recv(driver, "y:0", group)
        assert types == {"cp": ["cupy", "<CUDA Device 0>"], "t": ["torch", "cuda:0"]}
        back = await _recv(driver, "y:0", group)
        assert bool((back["cp"] == obj["cp"]).all()) and torch.equal(back["t"], obj["t"])
        await group.join()


async def test_owned_copies_with_shm_views_off(cluster, driver):
    async with asyncio.timeout(180):
        group = await cluster.spawn(workers_gpu.hold_and_check, "v", 1, args=("driver:0", 5),
                                    env={"RLINF_SHM_VIEWS": "0"})
        t = torch.empty(1 << 20, device="cuda")
        for step in range(5):
            t.fill_(float(step))
            await driver.send(t, "v:0")
        report = await _recv(driver, "v:0", group)
        assert report["all_equal"] and report["kept"] == 0.0
        assert driver._gpu.session.sender.busy_bytes("v:0") == 0    # copies out: no slot is held
        await driver.send(None, "v:0", tag=9)
        await group.join()
