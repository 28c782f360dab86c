"""Same-node shared memory between real processes: routing, views, lifetimes, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys

import numpy as np
import pytest
import torch

import rlinf
from rlinf.util.procs import process_gone
from rlinf.transports import shm

from .same import assert_same
from .wait import until
from . import workers_shm

pytestmark = pytest.mark.multiproc


def _segments(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"rlinf-{pid}-"))


def _nested(scale: int = 1) -> dict:
    rng = np.random.default_rng(7)
    return {
        "step": 3, "name": "batch", "done": [False, True],
        "tensors": {
            "big": torch.from_numpy(rng.random(500_000 * scale, dtype=np.float32)),
            "obs": torch.arange(60_000, dtype=torch.float32).reshape(300, 200).t(),   # non-contiguous
            "bf": torch.ones(10_000, dtype=torch.bfloat16),
            "tiny": torch.zeros(3),
            "empty": torch.empty(0),
        },
        "actions": rng.integers(0, 10, 200_000),
        "raw": bytes(range(256)) * 40,
    }


async def test_large_nested_objects_go_through_shm_both_ways(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.echo, "echo", 1, args=("driver:0", 3))
        obj = _nested()
        for _ in range(3):
            await driver.send(obj, "echo:0")
            back = await driver.recv("echo:0")
            assert_same(obj, back)
        back["tensors"]["big"][0] = -1.0          # views are writable
        back["actions"][:] = 0
        assert driver.stats().transports["shm"].msgs == 3
        await driver.send("done", "echo:0", tag=99)
        [worker] = await group.join()
        assert worker["shm_msgs"] == 3            # and the echo went back through shm too
        assert worker["created"] <= 2 < worker["exports"]   # slots are reused, not made per message


async def test_stats_count_bytes_through_memory_apart_from_bytes_through_sockets(cluster, driver):
    """Issue 28 (6): ``bytes_out``/``bytes_in`` are what crossed a socket; the payload of
    a message in shared memory counts as ``shared_out``/``shared_in`` and under "shm"."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.echo, "echo", 1, args=("driver:0", 1))
        obj = {"tensors": {"big": torch.ones(1 << 20)}}          # 4 MiB
        await driver.send(obj, "echo:0")
        await driver.recv("echo:0")
        peer = driver.stats().peers["echo:0"]
        assert peer.shared_out == peer.shared_in == 4 << 20, peer
        assert peer.bytes_out < 4096 and peer.bytes_in < 4096, peer     # descriptors and headers
        assert driver.stats().transports["shm"].bytes == 4 << 20
        assert driver.stats().shared_out == 4 << 20
        await driver.send("done", "echo:0", tag=99)
        await group.join()


async def test_small_messages_stay_inline(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.echo, "echo", 1, args=("driver:0", 1))
        small = {"tensors": {"big": torch.ones(100)}}
        await driver.send(small, "echo:0")
        assert_same(small, await driver.recv("echo:0"))
        assert "shm" not in driver.stats().transports
        await driver.send("done", "echo:0", tag=99)
        assert (await group.join())[0]["shm_msgs"] == 0


async def test_no_slot_reuse_while_a_view_lives(cluster, driver):
    """Keep a view of message 0; twenty more messages recycle the sender's slots; the
    kept view's data never changes."""
    n, nbytes = 21, 1 << 20
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.send_fills, "filler", 1, args=("driver:0", n, nbytes))
        kept = await driver.recv("filler:0")
        assert kept["i"] == 0
        await driver.send(0, "filler:0", tag=1)
        for i in range(1, n):
            obj = await driver.recv("filler:0")
            assert obj["i"] == i and obj["x"][0] == i and obj["x"][-1] == i
            del obj                                # released: its slot may be reused
            await driver.send(i, "filler:0", tag=1)
        state = await driver.recv("filler:0", tag=2)
        assert np.all(kept["x"] == 0), "a slot was rewritten while a view of it was alive"
        assert state["shm_msgs"] == n
        assert state["created"] <= 3, state         # the other slots were recycled many times
        assert state["busy"] >= 1                   # ours is still held
        del kept
        await driver.send("bye", "filler:0", tag=3)
        assert await group.join() == ["bye"]


async def test_a_sender_ahead_of_its_reader_waits_for_slots_instead_of_growing(cluster, driver):
    """A reader that consumes slower than its sender sends: the sender's sends wait once
    the reader holds a window of slots, so the pool stays at about that many segments
    instead of a new one per message."""
    from rlinf.transports.shm._session import WINDOW_SLOTS

    n = 4 * WINDOW_SLOTS
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.consume, "consumer", 1, args=("driver:0", n))
        msg = {"x": np.ones(256 << 10, np.float32)}      # 1 MiB: shared memory
        await driver.send(msg, "consumer:0")
        assert await driver.recv("consumer:0", tag=2) == "ready"
        for _ in range(n):
            await driver.send(msg, "consumer:0")
            assert driver._lifecycle.shm.pool.held("consumer:0")[0] <= WINDOW_SLOTS
        await group.join()
        assert driver._lifecycle.shm.pool.created <= WINDOW_SLOTS + 2


async def test_a_reader_that_keeps_its_views_does_not_block_its_sender(cluster, driver):
    """A reader that keeps every message (a queue, say): past the window the sender
    waits once, for a short while, then sends on; nothing is lost, and the slots come
    back when the reader drops its views."""
    from rlinf.transports.shm._session import WINDOW_SLOTS

    n = WINDOW_SLOTS + 20
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.keep_all, "keeper", 1, args=("driver:0", n))
        msg = {"x": np.ones(256 << 10, np.float32)}
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(n):
            await driver.send(msg, "keeper:0")
        assert loop.time() - start < 10            # not one stall per message
        assert await driver.recv("keeper:0", tag=2) == n
        assert driver._lifecycle.shm.pool.held("keeper:0")[0] == n
        await driver.send("drop", "keeper:0", tag=3)
        assert await driver.recv("keeper:0", tag=2) == "dropped"
        await until(lambda: driver._lifecycle.shm.pool.held("keeper:0") == (0, 0), what="the slots to come back")
        await driver.send("bye", "keeper:0", tag=4)
        await group.join()


async def test_a_reply_carries_the_release_of_what_it_answers(cluster, driver):
    """A reader that drops a message and then replies returns the slot in the same
    frame set as the reply, ahead of it: once the reply is here the slot is free (no
    separate release message, and no wait for one)."""
    n = 5
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.drop_and_ack, "acker", 1, args=("driver:0", n))
        for i in range(n):
            await driver.send({"x": np.ones(256 << 10, np.float32), "i": i}, "acker:0")
            assert driver._lifecycle.shm.pool.held("acker:0") == (1, 1 << 20)
            assert await driver.recv("acker:0", tag=1) == i
            assert driver._lifecycle.shm.pool.held("acker:0") == (0, 0)
        await group.join()
        assert driver._lifecycle.shm.pool.created == 1       # the one slot, released each time, serves every message


async def test_a_small_slot_comes_back_right_after_the_reply_a_large_one_in_it(cluster, driver):
    """A release of less than AHEAD_BYTES is not carried in the reply's frame set (it
    would add to the reply's latency on both sides) but sent in a frame set of its own
    right after it; a large one travels ahead of the reply, so the next message reuses
    that slot instead of taking a second one."""
    from rlinf.core import wire
    from rlinf.transports.shm._session import AHEAD_BYTES

    frame_sets = []
    deliver = driver._receive._deliver

    def record(inflow, entries, frames, packed):     # each frame set with messages, in order
        frame_sets.append([(e.kind, e.tag) for e in entries])
        deliver(inflow, entries, frames, packed)

    driver._receive._deliver = record
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.drop_and_ack, "acker", 1, args=("driver:0", 6))
        for i, nbytes in enumerate([AHEAD_BYTES // 4] * 3 + [AHEAD_BYTES] * 3):
            frame_sets.clear()
            await driver.send({"x": np.ones(nbytes, np.uint8), "i": i}, "acker:0")
            assert await driver.recv("acker:0", tag=1) == i
            await until(lambda: driver._lifecycle.shm.pool.held("acker:0") == (0, 0), what="the slot to come back")
            if i == 0:
                continue       # the first also tells that the segment was mapped
            if nbytes < AHEAD_BYTES:
                assert frame_sets[-2:] == [[(wire.USER, 1)], [(wire.SYSTEM, "shm")]], frame_sets
            else:
                assert [(wire.SYSTEM, "shm"), (wire.USER, 1)] in frame_sets, frame_sets
        await group.join()
    assert driver._lifecycle.shm.pool.created <= 3, driver._lifecycle.shm.pool     # two small slots at most, one large


async def test_copy_out_option_releases_the_slot_at_once(cluster):
    async with asyncio.timeout(60):
        comm = await cluster.connect("copier:0", shm_views=False).start()
        try:
            group = await cluster.spawn(workers_shm.send_fills, "filler", 1, args=("copier:0", 3, 4 << 20))
            held = []
            for i in range(3):
                obj = await comm.recv("filler:0")
                assert obj["x"][0] == i
                obj["x"][:10] = 99                 # owned and writable
                held.append(obj)                   # kept: yet the sender's slot is free
                await comm.send(i, "filler:0", tag=1)
            state = await comm.recv("filler:0", tag=2)
            assert state["shm_msgs"] == 3 and state["busy"] == 0 and state["created"] == 1
            await comm.send("bye", "filler:0", tag=3)
            await group.join()
        finally:
            await comm.aclose()


async def test_copy_out_by_environment(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.echo, "echo", 1, args=("driver:0", 1),
                                    env={"RLINF_SHM_VIEWS": "0"})
        obj = _nested()
        await driver.send(obj, "echo:0")
        assert_same(obj, await driver.recv("echo:0"))
        await driver.send("done", "echo:0", tag=99)
        assert (await group.join())[0]["shm_msgs"] == 1


async def test_cap_reached_falls_back_to_zeromq(cluster, driver):
    """With a 3 MiB cap one 2 MiB slot fits; while the driver holds it, the next
    messages go inline over ZeroMQ instead of failing."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.send_fills, "filler", 1, args=("driver:0", 4, 2 << 20),
                                    env={"RLINF_SHM_CAP": "3M"})
        held = []
        for i in range(4):
            obj = await driver.recv("filler:0")
            assert obj["i"] == i and np.all(obj["x"] == i)
            held.append(obj)
            await driver.send(i, "filler:0", tag=1)
        state = await driver.recv("filler:0", tag=2)
        assert state["shm_msgs"] == 1 and state["fallbacks"] == 3 and state["zmq_msgs"] >= 3
        await driver.send("bye", "filler:0", tag=3)
        await group.join()


async def test_kill_sender_leaves_no_segment(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.send_and_wait, "sender", 1, args=("driver:0", 8 << 20))
        obj = await driver.recv("sender:0")
        state = await driver.recv("sender:0", tag=6)
        pid = group.pids[0]
        assert state["segments"] and _segments(pid) == state["segments"]
        await group.kill()
        await until(lambda: not _segments(pid), what="the dead sender's segments to be swept")
        assert float(obj["x"].sum()) == (8 << 20) // 4    # our mapping outlives the file


async def test_kill_receiver_retires_its_slots(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.hold, "holder", 1, args=("driver:0",))
        await driver.send({"x": np.ones(1 << 20)}, "holder:0")
        assert await driver.recv("holder:0", tag=5) == ("holding", float(1 << 20))
        pool = driver._lifecycle.shm.pool
        [held] = [name for name in pool.segment_names() if name in pool._busy]
        await group.kill()
        await until(lambda: pool.busy == 0, what="the lost reader's slot to be retired")
        assert held not in os.listdir("/dev/shm")    # retired slots are unlinked, never reused


async def test_kill_sender_and_receiver_leaves_no_segment(cluster, driver):
    async with asyncio.timeout(60):
        receiver = await cluster.spawn(workers_shm.hold, "holder", 1, args=("sender:0",))
        sender = await cluster.spawn(workers_shm.send_and_wait, "sender", 1, args=("holder:0", 8 << 20))
        state = await driver.recv("sender:0", tag=6)
        pids = sender.pids + receiver.pids
        assert _segments(pids[0]) == state["segments"] != []
        await asyncio.gather(sender.kill(), receiver.kill())
        await until(lambda: not any(_segments(p) for p in pids), what="the manager's sweep")


async def test_multicast_to_three_readers(cluster, driver):
    """One slot, three copy-on-write readers: a reader's writes stay its own, and the
    slot's next use shows fresh data even to the reader that wrote."""
    readers = ["r:0", "r:1", "r:2"]
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.multicast_reader, "r", 3, args=("driver:0",))
        pool = driver._lifecycle.shm.pool
        for round_, value in enumerate((1.0, 2.0)):
            exports = pool.exports
            obj = {"x": torch.full((1 << 20,), value)}
            await driver.internal.multicast(obj, readers, "mc")
            assert pool.exports == exports + 1                 # copied once for all three
            assert [await driver.recv(r, tag=10) for r in readers] == [value] * 3
            await driver.send("write", "r:0", tag=11)
            assert await driver.recv("r:0", tag=12) == -1.0
            for r in readers[1:]:
                await driver.send("check", r, tag=11)
                assert await driver.recv(r, tag=12) == value   # r:0's writes are not visible
            assert float(obj["x"].mean()) == value
            for r in readers:
                await driver.send("next", r, tag=13)
            await until(lambda: pool.busy == 0, what="all three readers to release the slot")
        assert driver.stats().transports["shm"].msgs == 6
        assert pool.created == 1
        assert await group.join() == ["done"] * 3


async def test_multicast_mixes_paths(cluster, driver):
    """Same-node readers share a slot; another "node" and the sender itself get copies."""
    async with asyncio.timeout(60):
        near = await cluster.spawn(workers_shm.multicast_reader, "near", 1, args=("driver:0",))
        far = await cluster.spawn(workers_shm.multicast_reader, "far", 1, args=("driver:0",),
                                  env={"RLINF_NODE_ID": "another-node"})
        for value in (3.0, 4.0):
            await driver.internal.multicast({"x": torch.full((1 << 18,), value)}, ["near:0", "far:0", "driver:0"], "mc")
            assert (await driver.internal.recv("driver:0", "mc"))["x"][0] == value
            for peer in ("near:0", "far:0"):
                assert await driver.recv(peer, tag=10) == value
                await driver.send("check", peer, tag=11)
                assert await driver.recv(peer, tag=12) == value
                await driver.send("next", peer, tag=13)
        stats = driver.stats().transports
        assert stats["shm"].msgs == 2 and stats["tcp_stream"].msgs >= 2     # (the copy to the other node)
        assert await near.join() == ["done"] and await far.join() == ["done"]


async def test_bad_slot_descriptor_is_a_decode_error(cluster, driver):
    """A peer describing a segment that is not its own fails that receive with
    DecodeError; one naming a segment that does not exist (any more: its sender took it
    back, as it does from a receiver it took for lost) with PeerLostError, the message
    lost; the receiver keeps serving."""
    import zmq

    small = f"rlinf-{os.getpid()}-ff-00-999998"    # a segment too small for the slot it names
    async with asyncio.timeout(30):
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        try:
            s.linger = 0
            s.routing_id = b"evil:0|i1"
            rlinf.control.security.ClusterKeys(cluster.token).secure_client(s, encrypt=False)
            s.connect(driver.info.endpoints["ipc"])
            header, _ = rlinf.codec.encode(np.zeros(100))
            with open(os.path.join("/dev/shm", small), "wb") as f:
                f.write(b"x" * 64)
            for seq, (name, error) in enumerate(((small, rlinf.DecodeError),
                                                 (f"rlinf-{os.getpid()}-ff-00-999999", rlinf.PeerLostError))):
                slot = [name, 0, 1 << 20, 1, False]
                s.send_multipart([rlinf.core.wire.pack_header("evil:0", "i1", [[0, 0, header, [-800], slot]], True,
                                                              epoch=1, seq=seq), b""])
                with pytest.raises(error):
                    await driver.recv("evil:0", timeout=10)
            await driver.send("ok", "driver:0")
            assert await driver.recv("driver:0") == "ok"
        finally:
            s.close(0)
            ctx.term()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", small))


@pytest.mark.parametrize("orders", ["read", "write"])
async def test_a_forwarded_view_is_relayed_by_reference_not_copied(cluster, driver, orders):
    """driver -> relay:0 -> sink:0 on one node: relay:0 forwards the views it received as
    references to the driver's slot (no copy, no slot of its own); sink:0 maps it
    copy-on-write; the driver's slot is free again once sink:0 dropped its views."""
    n, nbytes = 4, 3 << 20
    async with asyncio.timeout(90):
        relay = await cluster.spawn(workers_shm.relayer, "relay", 1, args=("driver:0", "sink:0", n))
        sink = await cluster.spawn(workers_shm.relay_sink, "sink", 1, args=("relay:0", n, orders))
        for i in range(n):
            await driver.send({"x": np.full(nbytes, i + 1, np.uint8), "i": i}, "relay:0")
            total, index = await driver.recv("sink:0", tag=20)
            assert (total, index) == (7.0 * (i + 1), i)
        await until(lambda: driver._lifecycle.shm.pool.busy == 0, what="the driver's slots to come back")
        await driver.send(None, "sink:0", tag=22)
        seen = (await sink.join(timeout=60))[0]
        state = (await relay.join(timeout=60))[0]
    assert state["exports"] == 0 and state["created"] == 0, state      # nothing copied by the relay
    assert state["relay_holds"] == 0
    assert all(m and all(name.startswith(f"rlinf-{relay.pids[0]}-") for name in m) for _, _, m in seen), seen
    assert driver._lifecycle.shm.pool.exports == n



async def test_a_relayed_item_survives_its_producers_death(cluster, driver):
    """A producer killed (and swept) after its message reached the relaying process:
    the relay still delivers the bytes (its own mapping outlives the file)."""
    async with asyncio.timeout(90):
        relay = await cluster.spawn(workers_shm.relayer, "relay", 1, args=("prod:0", "driver:0", 1, True))
        producer = await cluster.spawn(workers_shm.send_and_wait, "prod", 1, args=("relay:0", 2 << 20))
        await driver.recv("prod:0", tag=6)
        await driver.recv("relay:0", tag=24)     # the relay holds the producer's message
        pid = producer.pids[0]
        await producer.kill(0)
        await until(lambda: not _segments(pid), what="the producer's segments to be swept")
        await driver.send("go", "relay:0", tag=23)
        obj = await driver.recv("relay:0")
        assert obj["x"].shape == (512 << 10,) and bool((obj["x"] == 1).all())
        del obj
        await driver.send(None, "relay:0", tag=21)
        state = (await relay.join(timeout=60))[0]
    assert state["relay_holds"] == 0


async def test_a_pre_shared_tensor_is_passed_by_handle(cluster, driver):
    """A tensor already in shared memory (``share_memory_()``) is not copied: no slot is
    used, the receiver maps the sender's file once (the same address on every send) and
    a write by either side is seen by the other; the sender's holds end once mapped."""
    n = 3
    async with asyncio.timeout(90):
        t = torch.zeros(1 << 20)
        t.share_memory_()
        peer = await cluster.spawn(workers_shm.shared_tensor_peer, "peer", 1, args=("driver:0", n))
        addresses = set()
        for i in range(n):
            t[1] = float(i + 10)        # a write after share_memory_: the receiver sees it
            await driver.send({"t": t, "i": i, "small": torch.ones(4)}, "peer:0")
            seen, address, index = await driver.recv("peer:0", tag=30)
            assert (seen, index) == (i + 10, i)
            addresses.add(address)
            assert await driver.recv("peer:0", tag=31) == "wrote"
            assert float(t[0]) == i + 1   # the receiver's write, in our tensor
        state = (await peer.join(timeout=60))[0]
    assert len(addresses) == 1               # mapped once, then served from the cache
    # only the small tensor went through a slot (the smallest size class), never the 4 MiB
    # one; at most two such slots: a small slot's release comes right after the reply
    # (not in its frame set), so the next send may take a second one
    assert driver._lifecycle.shm.pool.mapped <= 2 * shm.MIN_SLOT, driver._lifecycle.shm.pool
    assert driver.stats().transports["shm"].msgs == n
    assert driver._lifecycle.shm.relay.fds.holds == 0
    assert state["fd_maps"] == 1


async def test_pre_shared_tensors_are_copied_when_handles_are_off(cluster, monkeypatch):
    """``RLINF_SHM_FD=0``: a pre-shared tensor travels through a slot like any other."""
    monkeypatch.setenv("RLINF_SHM_FD", "0")
    async with asyncio.timeout(90):
        async with cluster.connect("sender:0") as sender:
            t = torch.zeros(1 << 20)
            t.share_memory_()
            peer = await cluster.spawn(workers_shm.shared_tensor_peer, "peer", 1, args=("sender:0", 1))
            await sender.send({"t": t, "i": 0}, "peer:0")
            assert (await sender.recv("peer:0", tag=30))[0] == 0.0
            assert await sender.recv("peer:0", tag=31) == "wrote"
            assert float(t[0]) == 0.0             # the receiver wrote to its own copy
            assert sender._lifecycle.shm.pool.exports == 1
            await peer.join(timeout=60)


_WHOLE_JOB = """
import asyncio, json, os
import numpy as np
import rlinf
from rlinf.control.client import run
from tests.integration import workers_shm

async def main():
    async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as comm:
        group = await cluster.spawn(workers_shm.hold, "holder", 1, args=("driver:0",))
        await comm.send({"x": np.ones(1 << 20)}, "holder:0", timeout=60)
        await comm.recv("holder:0", tag=5, timeout=60)
        print(json.dumps([os.getpid(), *group.pids]), flush=True)
        await asyncio.Event().wait()

run(main())
"""


def _leftovers(pid: int) -> list[str]:
    from rlinf.transports.zeromq import ipc_dirs_of

    return _segments(pid) + ipc_dirs_of(pid)


async def test_a_job_killed_whole_is_cleaned_up_by_the_next_start():
    """Driver, embedded manager and worker killed at once: no one is left to notice, so
    their segments and socket directories stay until rlinf next starts on this machine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    job = await asyncio.create_subprocess_exec(sys.executable, "-c", _WHOLE_JOB, cwd=root,
                                               stdout=asyncio.subprocess.PIPE, start_new_session=True)
    pids: list[int] = []
    try:
        async with asyncio.timeout(120):
            pids = json.loads(await job.stdout.readline())
            assert len(pids) == 2 and _segments(pids[0]) and all(_leftovers(p) for p in pids)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            await job.wait()
            await until(lambda: process_gone(pids[1]), what="the worker to die")
            assert all(_leftovers(p) for p in pids)          # no one noticed
            async with rlinf.Manager():
                pass
            assert not any(_leftovers(p) for p in pids)
    finally:
        for pid in pids:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        if job.returncode is None:
            job.kill()
            await job.wait()


async def test_a_relayed_view_keeps_its_bytes_when_the_forwarder_reuses_its_buffer(cluster, driver):
    """relay:0 forwards the views it got (by reference to the driver's slot), then writes
    into them: send had returned. What the driver received must not change."""
    async with asyncio.timeout(60):
        relay = await cluster.spawn(workers_shm.forward_then_overwrite, "relay", 1, args=("driver:0", "driver:0"))
        await driver.send({"x": np.ones(4 << 20, np.uint8)}, "relay:0")
        got = await driver.recv("relay:0")
        assert got["x"].sum() == 4 << 20
        await driver.send("got it", "relay:0", tag=7)
        assert await driver.recv("relay:0", tag=8) == "overwrote"
        assert got["x"].sum() == 4 << 20
        await relay.join(timeout=30)


async def test_a_relayed_slot_is_not_rewritten_while_a_departed_live_reader_holds_it(cluster):
    """c:0 closes its communicator but keeps (and its process keeps running with) a view
    it got through relay:0: the producer's slot must never be rewritten under it."""
    nbytes = 4 << 20
    async with asyncio.timeout(90), cluster.connect("ctl:0") as ctl:
        relay = await cluster.spawn(workers_shm.forward_each, "relay", 1, args=("c:0", "ctl:0"))
        producer = await cluster.spawn(workers_shm.produce_on_command, "prod", 1, args=("ctl:0", "relay:0", nbytes))
        consumer = await cluster.connect("c:0").start()
        await ctl.send(1, "prod:0", tag=71)
        await ctl.recv("prod:0", tag=72)
        got = await consumer.recv("relay:0", timeout=30)
        assert await ctl.recv("relay:0", tag=70) == "sent"
        await consumer.aclose()                  # leaves, still holding `got`
        await ctl.send(2, "prod:0", tag=71)      # the next item: relay:0 can no longer forward it
        await ctl.recv("prod:0", tag=72)
        assert await ctl.recv("relay:0", tag=70) == "lost"
        await ctl.send(None, "prod:0", tag=71)
        assert await producer.join(timeout=30) == [2]      # a new slot: the held one stays busy
        assert int(got["x"][0]) == 1 and got["x"].sum() == nbytes
        await ctl.send("stop", "relay:0")
        await relay.join(timeout=30)


async def test_the_next_message_in_a_relayed_slot_is_readable_after_its_sender_closed(cluster, driver):
    """A relaying process that made its mapping of a slot copy-on-write must keep a
    mapping of that segment: the sender counts on a reader that said it mapped a segment
    keeping it, and unlinks the file when it closes. The next message in the same slot,
    sent just before closing, was dropped ("cannot open shared-memory segment")."""
    nbytes = 4 << 20
    async with asyncio.timeout(60):
        relay = await cluster.spawn(workers_shm.forward_each, "relay", 1, args=("driver:0", "driver:0"))
        async with cluster.connect("prod:0") as producer:
            await producer.send({"x": np.full(nbytes, 1, np.uint8)}, "relay:0")
            first = await driver.recv("relay:0")
            assert first["x"][0] == 1 and await driver.recv("relay:0", tag=70) == "sent"
            del first
            gc.collect()
            await until(lambda: producer._lifecycle.shm.pool.busy == 0, what="the producer's slot to come back")
            await producer.send({"x": np.full(nbytes, 2, np.uint8)}, "relay:0")   # the same slot
            assert producer._lifecycle.shm.pool.created == 1
        second = await driver.recv("relay:0", timeout=20)                  # the producer has closed
        assert second["x"][0] == 2 and second["x"].sum() == 2 * nbytes
        await driver.send("stop", "relay:0")
        await relay.join(timeout=30)
