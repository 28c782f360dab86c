"""Manager restarts, hostile frames, and the TCP path between "nodes"."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
import zmq

import rlinf

from . import workers
from .same import assert_same
from .wait import until

pytestmark = pytest.mark.multiproc


async def _recv_until(comm, src, expected, timeout=10):
    async with asyncio.timeout(timeout):
        while True:
            obj = await comm.recv(src)
            if obj == expected:
                return


async def test_manager_restart_keeps_peers_talking_and_rebuilds_roster():
    async with asyncio.timeout(60):
        manager = await rlinf.Manager("tcp://127.0.0.1:0").start()
        address, token = manager.address, manager.token
        async with rlinf.connect("a:0", manager=address, token=token) as a, \
                rlinf.connect("b:0", manager=address, token=token) as b:
            await a.send("before", "b:0")
            assert await b.recv("a:0") == "before"
            await manager.close()
            # Known peers keep talking while the manager is down.
            await a.send("during", "b:0")
            assert await b.recv("a:0", timeout=5) == "during"
            # A new manager at the same address: workers re-register by themselves.
            manager = await rlinf.Manager(address, token=token).start()
            try:
                await until(lambda: {w.address for w in manager.roster()} == {"a:0", "b:0"}, timeout=30,
                            what="both workers to re-register")
                await b.send("after", "a:0")
                assert await a.recv("b:0", timeout=5) == "after"
            finally:
                await manager.close()


_PEER = """
import asyncio, sys
import rlinf
from rlinf.control.client import run

async def main():
    async with rlinf.connect("b:0", manager=sys.argv[1], token=sys.argv[2]) as b:
        await b.send("ready", "a:0")
        await asyncio.Event().wait()

run(main())
"""


async def test_while_the_manager_is_down_a_dead_peer_of_this_machine_is_still_reported():
    """Nobody reports losses while the manager is down: a peer process of this machine
    that dies then is judged by its pid, and what waits on it fails instead of hanging."""
    async with asyncio.timeout(60):
        manager = await rlinf.Manager("tcp://127.0.0.1:0").start()
        peer = None
        try:
            async with rlinf.connect("a:0", manager=manager.address, token=manager.token) as a:
                peer = await asyncio.create_subprocess_exec(sys.executable, "-c", _PEER, manager.address,
                                                            manager.token)
                assert await a.recv("b:0", timeout=30) == "ready"
                await manager.close()
                os.kill(peer.pid, signal.SIGKILL)
                await peer.wait()
                started = time.monotonic()
                with pytest.raises(rlinf.PeerLostError, match="b:0"):
                    await a.recv("b:0", timeout=20)
                assert time.monotonic() - started < 10
        finally:
            await manager.close()
            if peer is not None and peer.returncode is None:
                peer.kill()
                await peer.wait()


async def test_garbage_on_data_and_control_endpoints_is_survived(cluster, driver):
    """Random and truncated frames, from an authenticated and an unauthenticated socket."""
    async with asyncio.timeout(60):
        rng = np.random.default_rng(1234)
        print("seed 1234")
        ctx = zmq.Context()
        socks = []
        try:
            endpoints = [driver.info.endpoints["tcp"], driver.info.endpoints["ipc"], cluster.manager_address]
            for endpoint in endpoints:
                # An outsider without the token (its handshake is refused) ...
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                s.connect(endpoint)
                socks.append(s)
                # ... and an insider that knows the token but speaks garbage.
                t = ctx.socket(zmq.DEALER)
                t.linger = 0
                t.routing_id = b"x:0|fake"
                encrypt = endpoint.startswith("tcp://")
                rlinf.control.security.ClusterKeys(cluster.token).secure_client(t, encrypt=encrypt)
                t.connect(endpoint)
                socks.append(t)
            def throw(s, frames):
                try:   # an outsider's DEALER never completes its handshake: don't block on it
                    s.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass

            for s in socks:
                for _ in range(30):
                    n = int(rng.integers(1, 4))
                    throw(s, [rng.bytes(int(rng.integers(0, 300))) for _ in range(n)])
                throw(s, [rlinf.core.wire.pack_header("x:0", "fake", [[0, 0, b"", [5]]])])           # count mismatch
                throw(s, [rlinf.core.wire.pack_header("x:0", "fake", [[0, 0, b"\x93", []]])[:-3]])   # truncated
            # The worker and the manager still serve real peers.
            group = await cluster.spawn(workers.echo, "echo", 1, args=("driver:0", 1))
            await driver.send({"still": "alive"}, "echo:0")
            assert await driver.recv("echo:0") == {"still": "alive"}
            assert await group.join() == [1]
            assert driver.stats().dropped_frames > 0      # the insider's garbage did arrive
        finally:
            for s in socks:
                s.close(0)
            ctx.term()


async def test_insider_garbage_codec_payload_raises_decode_error(driver, cluster):
    """A well-framed message whose codec header is garbage fails the recv, not the worker."""
    async with asyncio.timeout(30):
        ctx = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.routing_id = b"evil:0|i1"
            rlinf.control.security.ClusterKeys(cluster.token).secure_client(s, encrypt=False)
            s.connect(driver.info.endpoints["ipc"])
            s.send_multipart([rlinf.core.wire.pack_header("evil:0", "i1", [[0, 0, b"\xc1garbage", []]])])
            with pytest.raises(rlinf.DecodeError):
                await driver.recv("evil:0", timeout=10)
            await driver.send("ok", "driver:0")
            assert await driver.recv("driver:0") == "ok"
        finally:
            s.close(0)
            ctx.term()


@pytest.mark.parametrize("encrypt", ["1", "0"])
async def test_large_payloads_to_another_node_take_the_bulk_stream_in_order(cluster, monkeypatch, encrypt):
    """Across "nodes", payloads >= 1 MiB go over the bulk TCP stream (sealed by default),
    small ones over the TCP stream link; interleaved on one tag, they arrive in call order, intact,
    both ways."""
    monkeypatch.setenv("RLINF_TCP_ENCRYPTION", encrypt)
    async with asyncio.timeout(90):
        async with cluster.connect("near:0") as near:
            group = await cluster.spawn(workers.echo, "far", 1, args=("near:0", 6),
                                        env={"RLINF_NODE_ID": "another-node", "RLINF_TCP_ENCRYPTION": encrypt})
            sent = []
            for i in range(6):
                obj = {"i": i, "x": np.full((3 << 20) if i % 2 == 0 else 10, i, np.uint8),
                       "t": torch.arange(300_000 * (i % 2 == 0), dtype=torch.float32)}
                sent.append(obj)
                await near.send(obj, "far:0")
            link = near._sessions.get("far:0").outbox._bulk_link     # now: it goes once "far" leaves
            assert link.encrypted == (encrypt == "1")
            for obj in sent:
                back = await near.recv("far:0")
                assert back["i"] == obj["i"]
                assert_same(obj, back)
            stats = near.stats().transports
            assert stats["bulk"].msgs == 3 and stats["tcp_stream"].msgs >= 3, stats
            assert await group.join() == [6]


async def test_a_peer_without_bulk_gets_large_payloads_through_zeromq(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.echo, "far", 1, args=("driver:0", 1),
                                    env={"RLINF_NODE_ID": "another-node", "RLINF_DISABLE_TRANSPORTS": "bulk"})
        far = next(p for p in await driver.peers() if p.address == "far:0")
        assert "bulk" not in far.endpoints and "bulk" not in far.transports
        payload = {"x": np.arange(1 << 20, dtype=np.float32)}
        await driver.send(payload, "far:0")
        assert np.array_equal((await driver.recv("far:0"))["x"], payload["x"])
        assert "bulk" not in driver.stats().transports
        assert await group.join() == [1]


async def test_two_nodes_use_tcp(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.echo, "far", 1, args=("driver:0", 1),
                                    env={"RLINF_NODE_ID": "another-node"})
        far = next(p for p in await driver.peers() if p.address == "far:0")
        assert far.node_id == "another-node" != driver.info.node_id
        payload = {"x": np.arange(1 << 20, dtype=np.float32)}      # 4 MiB: large, chunk-free
        await driver.send(payload, "far:0")
        assert driver._sessions.get("far:0").outbox.link.endpoint.startswith("tcp://")
        back = await driver.recv("far:0")
        assert np.array_equal(back["x"], payload["x"])
        assert await group.join() == [1]


async def test_stats_and_repr(cluster, driver):
    async with asyncio.timeout(30):
        group = await cluster.spawn(workers.echo, "e", 1, args=("driver:0", 3))
        for i in range(3):
            await driver.send(b"x" * 100, "e:0")
            await driver.recv("e:0")
        stats = driver.stats()
        assert stats.peers["e:0"].msgs_out == 3 and stats.peers["e:0"].msgs_in == 3
        assert stats.peers["e:0"].bytes_out >= 300
        link = "stream" if "stream" in driver.info.transports else "zmq"    # this node's data link
        assert stats.transports[link].msgs >= 3 and stats.transports[link].bytes >= 300
        assert "driver:0" in repr(driver) and "peers=" in repr(driver)
        assert "e:0" in str(stats)
        await group.join()


async def test_large_message_is_chunked_and_reassembled(driver):
    async with asyncio.timeout(30):
        big = np.arange((40 << 20) // 8, dtype=np.int64)      # 40 MiB: 3 frames of <= 16 MiB
        await driver.send(big, "driver:0")
        back = await driver.recv("driver:0")
        assert np.array_equal(back, big)


async def test_dead_incarnations_remembered_are_bounded(driver, monkeypatch):
    """Each death of a peer restarted under one name left an entry for good: a long-lived
    driver grew by one per restart. The newest are kept (their late frames are dropped)."""
    from rlinf.core import _peer
    from rlinf.info import MembershipEvent

    monkeypatch.setattr(_peer, "DEAD_KEPT", 3)
    for i in range(5):
        driver._membership.on_event(MembershipEvent("lost", "ghost:0", f"inc{i}"))
    assert list(driver._dead) == [("ghost:0", f"inc{i}") for i in (2, 3, 4)]
    with pytest.raises(rlinf.PeerLostError):
        await driver.recv("ghost:0", timeout=5)


async def test_the_state_kept_per_departed_peer_is_bounded(driver, monkeypatch):
    """Each peer a long-lived worker ever sent to kept an outbox (with a 256 KiB msgpack
    buffer of its own) and a mailbox entry for good: ~270 KiB per peer that came and
    went. Outboxes now share one header packer, and only the newest departed peers are
    remembered (a send or receive to them fails at once)."""
    from rlinf.core import _mailbox as mailbox_module
    from rlinf.core import _peer
    from rlinf.info import MembershipEvent

    monkeypatch.setattr(_peer, "DEAD_KEPT", 3)
    monkeypatch.setattr(mailbox_module, "LOST_KEPT", 3)
    async with asyncio.timeout(30):
        for i in range(6):
            work = driver.async_send("hello", f"gone{i}:0")   # a session, waiting for the peer
            driver._membership.on_event(MembershipEvent("lost", f"gone{i}:0", ""))
            with pytest.raises(rlinf.PeerLostError):
                await work
        assert all(session.outbox._header is driver._header for session in driver._sessions)
        assert sorted(s.address for s in driver._sessions if s.address.startswith("gone")) == [
            "gone3:0", "gone4:0", "gone5:0"]
        assert list(driver._mailbox._lost) == ["gone3:0", "gone4:0", "gone5:0"]
        with pytest.raises(rlinf.PeerLostError):
            await driver.send("again", "gone5:0", timeout=5)
        with pytest.raises(rlinf.PeerLostError):
            await driver.recv("gone5:0", timeout=5)
