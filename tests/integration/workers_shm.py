"""Module-level worker targets for the shared-memory integration tests."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

import rlinf


def shm_state(comm) -> dict:
    """What a test needs to know about a communicator's shared memory."""
    pool = comm._lifecycle.shm.pool
    stats = comm.stats().transports
    return {"busy": pool.busy, "created": pool.created, "exports": pool.exports, "fallbacks": pool.fallbacks,
            "segments": pool.segment_names(), "shm_msgs": _msgs(stats, "shm", "pull"),   # in a slot, or pulled
            "zmq_msgs": _msgs(stats, "zmq", "stream")}                                 # inline, on the data link


def _msgs(stats: dict, *paths: str) -> int:
    return sum(stats[p].msgs for p in paths if p in stats)


async def echo(comm, peer: str, n: int):
    """Receive ``n`` messages from ``peer``, check they are writable, send each back;
    then, once ``peer`` says it got them all (tag 99), report our shared-memory state."""
    for _ in range(n):
        obj = await comm.recv(peer, timeout=60)
        obj["tensors"]["big"][0] += 0           # writable (raises on a read-only view)
        await comm.send(obj, peer, timeout=60)
    await comm.recv(peer, tag=99, timeout=60)
    return shm_state(comm)


async def send_fills(comm, dst: str, n: int, nbytes: int):
    """Send ``n`` arrays filled with 0..n-1 to ``dst``, each after ``dst`` acked the last."""
    for i in range(n):
        await comm.send({"x": np.full(nbytes, i % 256, np.uint8), "i": i}, dst, timeout=60)
        assert await comm.recv(dst, tag=1, timeout=60) == i
    await comm.send(shm_state(comm), dst, tag=2, timeout=60)
    return await comm.recv(dst, tag=3, timeout=60)


async def hold(comm, src: str):
    """Receive one message from ``src``, keep it, tell ``src``, wait to be killed."""
    obj = await comm.recv(src, timeout=60)
    await comm.send(("holding", float(obj["x"].sum())), src, tag=5, timeout=60)
    await asyncio.Event().wait()


async def send_and_wait(comm, dst: str, nbytes: int):
    """Send a large message to ``dst``, report our segments to the driver, wait to be killed."""
    await comm.send({"x": torch.ones(nbytes // 4)}, dst, timeout=60)
    await comm.send(shm_state(comm), "driver:0", tag=6, timeout=60)
    await asyncio.Event().wait()


async def multicast_reader(comm, root: str):
    """Two rounds of: receive a multicast, follow the root's orders, report what we see."""
    for _ in range(2):
        obj = await comm.internal.recv(root, "mc", timeout=60)
        arr = obj["x"]
        await comm.send(float(arr.mean()), root, tag=10, timeout=60)
        order = await comm.recv(root, tag=11, timeout=60)
        if order == "write":
            arr[:] = -1.0                      # our private copy only
        await comm.send(float(arr.mean()), root, tag=12, timeout=60)
        del obj, arr
        await comm.recv(root, tag=13, timeout=60)
    return "done"


async def relayer(comm, src: str, dst: str, n: int, wait_go: bool = False):
    """Forward ``n`` messages from ``src`` to ``dst`` (by reference, when it can), each
    after telling the driver it has it (tag 24) and the driver's go (tag 23) if
    ``wait_go``; then report our shared-memory state
    once ``dst`` says it is done (tag 21)."""
    for _ in range(n):
        obj = await comm.recv(src, timeout=60)
        if wait_go:
            await comm.send("got it", "driver:0", tag=24, timeout=60)
            await comm.recv("driver:0", tag=23, timeout=60)
        await comm.send(obj, dst, timeout=60)
        del obj
    await comm.recv(dst, tag=21, timeout=60)
    return {**shm_state(comm), "relay_holds": comm._lifecycle.shm.relay.holds}


async def relay_sink(comm, src: str, n: int, orders: str):
    """Receive ``n`` relayed messages; per message, report the segments its views are
    from, the values it sees, and (orders "write") scribble over its own copy."""
    seen = []
    for _ in range(n):
        obj = await comm.recv(src, timeout=60)
        mapped = sorted(comm._lifecycle.shm.reader._private)
        seen.append((float(obj["x"][:7].astype(np.float64).sum()), int(obj["i"]), mapped))
        if orders == "write":
            obj["x"][:] = 255                   # copy-on-write: the producer's bytes stay
        await comm.send(seen[-1][:2], "driver:0", tag=20, timeout=60)
        del obj
    await comm.recv("driver:0", tag=22, timeout=60)
    await comm.send(None, src, tag=21, timeout=60)
    return seen


async def shared_tensor_peer(comm, src: str, n: int):
    """Receive ``n`` messages holding a tensor from ``src``; after each, report what the
    tensor shows and where its memory is, then add 1 to its element 0 (a write ``src``
    sees when the tensor was passed by handle) and say so."""
    for _ in range(n):
        obj = await comm.recv(src, timeout=60)
        t = obj["t"]
        await comm.send((float(t[1]), t.data_ptr(), obj["i"]), src, tag=30, timeout=60)
        t[0] += 1
        del obj, t
        await comm.send("wrote", src, tag=31, timeout=60)
    return {**shm_state(comm), "fd_maps": len(comm._lifecycle.shm.fd_maps._maps)}


async def consume(comm, src: str, n: int):
    """Receive one message from ``src`` and say so (tag 2), then receive ``n`` more,
    reading each and dropping it."""
    await comm.recv(src, timeout=60)
    await comm.send("ready", src, tag=2, timeout=60)
    for _ in range(n):
        obj = await comm.recv(src, timeout=60)
        assert float(obj["x"][-1]) == 1.0
        del obj


async def keep_all(comm, src: str, n: int):
    """Receive ``n`` messages from ``src`` and keep them all; report (tag 2), drop them
    when ``src`` says so (tag 3), report again."""
    kept = [await comm.recv(src, timeout=60) for _ in range(n)]
    await comm.send(len(kept), src, tag=2, timeout=60)
    await comm.recv(src, tag=3, timeout=60)
    kept.clear()
    await comm.send("dropped", src, tag=2, timeout=60)
    await comm.recv(src, tag=4, timeout=60)


async def drop_and_ack(comm, src: str, n: int):
    """``n`` times: receive a message from ``src``, drop it, ack with its ``"i"`` (tag 1)."""
    for _ in range(n):
        obj = await comm.recv(src, timeout=60)
        i = obj["i"]
        del obj
        await comm.send(i, src, tag=1, timeout=60)


async def forward_then_overwrite(comm, src: str, dst: str):
    """Receive one message from ``src``, forward it to ``dst``, then (once ``dst`` has it)
    overwrite the received array: ``send`` returned, so its buffers may be reused."""
    obj = await comm.recv(src, timeout=30)
    await comm.send(obj, dst, timeout=30)
    await comm.recv(dst, tag=7, timeout=30)
    obj["x"][:] = 7
    await comm.send("overwrote", dst, tag=8, timeout=30)


async def forward_each(comm, dst: str, ctl: str):
    """Forward every message to ``dst`` until "stop"; tell ``ctl`` how each forward went."""
    while True:
        obj, _src = await comm.recv_any(timeout=60)
        if obj == "stop":
            return
        try:
            await comm.send(obj, dst, timeout=10)
            outcome = "sent"
        except rlinf.PeerLostError:
            outcome = "lost"
        del obj
        await comm.send(outcome, ctl, tag=70, timeout=10)


async def produce_on_command(comm, ctl: str, dst: str, nbytes: int):
    """Send an array of ``nbytes`` filled with each value ``ctl`` sends (tag 71) to ``dst``."""
    while (value := await comm.recv(ctl, tag=71, timeout=60)) is not None:
        await comm.send({"x": np.full(nbytes, value, np.uint8)}, dst, timeout=30)
        await comm.send("sent", ctl, tag=72, timeout=30)
    return comm._lifecycle.shm.pool.created


def pull_state(comm) -> dict:
    """What a test needs to know about a communicator's pulls."""
    pull = comm._lifecycle.pull
    return {"offered": pull.offered, "pulled": pull.pulled, "held": len(pull._held), "sources": pull.report()["sources"]}


async def pulled_by(comm, peer: str) -> None:
    """Wait until ``peer`` (a copy-out receiver that got a message of ours through a
    slot) has agreed to pull our large messages."""
    from .wait import until

    incarnation = comm._roster[peer].incarnation
    await until(lambda: comm._lifecycle.pull.agreed(peer, incarnation), what=f"{peer} to agree to pull")


async def send_reused(comm, dst: str, n: int, nbytes: int):
    """Send ``n`` messages to ``dst`` from ONE buffer, refilled as soon as each send
    returned (a send returns when its buffers may be reused): the first through a slot,
    the others pulled once ``dst`` agreed (``pulls``; else through slots too). Return our
    pulls and how many sends still held their buffers when they returned."""
    buf = np.zeros(nbytes, np.uint8)
    held_after_send = 0
    for i in range(n):
        buf[:] = i
        await comm.send({"x": buf, "i": i}, dst, timeout=60)
        held_after_send += len(comm._lifecycle.pull._held)
        buf[:] = 255                         # the receiver must never see this
        if i == 0:
            assert await comm.recv(dst, tag=1, timeout=60) == "first"
            if comm._lifecycle.pull.threshold:
                await pulled_by(comm, dst)
    assert await comm.recv(dst, tag=1, timeout=60) == "checked"
    return {**pull_state(comm), "held_after_send": held_after_send}


async def check_fills(comm, src: str, n: int):
    """Receive ``n`` messages from ``src`` (ack the first) and check each is all ``i``;
    keep them; then say so and report our pulls."""
    kept = []
    for i in range(n):
        obj = await comm.recv(src, timeout=60)
        assert obj["i"] == i and bool(np.all(obj["x"] == i)), f"message {i} changed after its send returned"
        kept.append(obj)
        if i == 0:
            await comm.send("first", src, tag=1, timeout=60)
    await comm.send("checked", src, tag=1, timeout=60)
    return pull_state(comm)


async def swap(comm, n: int, nbytes: int):
    """For ranks 0 and 1 of one group: two exchanges (the second through slots: the first
    goes inline when the other is not in our roster yet), then, once the other agreed to
    pull, ``n`` times: send a large array to the other, THEN receive one from it (both
    send first: a send must not wait for the other's receive)."""
    name, rank = comm.address.split(":")
    peer = f"{name}:{1 - int(rank)}"
    for _ in range(2):
        await comm.send({"x": np.zeros(nbytes, np.uint8)}, peer, timeout=30)
        await comm.recv(peer, timeout=30)
    await pulled_by(comm, peer)
    for i in range(n):
        await comm.send({"x": np.full(nbytes, i, np.uint8)}, peer, timeout=30)
        obj = await comm.recv(peer, timeout=30)
        assert bool(np.all(obj["x"] == i))
    return pull_state(comm)


async def pull_then_freeze(comm, src: str):
    """Receive one message from ``src`` (through a slot: we ask to pull from then on),
    wait for its "freeze" (tag 1), say "frozen" (tag 2), then block our event loop until
    killed: what ``src`` sends next is never read."""
    await comm.recv(src, timeout=60)
    await comm.recv(src, tag=1, timeout=60)
    await comm.send("frozen", src, tag=2, timeout=60)
    await asyncio.sleep(0)        # one loop turn: the reply's frame set goes out (Outbox.put)
    import threading
    threading.Event().wait()      # the loop is blocked on purpose, until we are killed


async def pull_sender(comm, dst: str, ctl: str, nbytes: int):
    """Send one message to ``dst`` through a slot, wait until ``dst`` agreed to pull, tell
    ``ctl`` (tag 40); on its word (tag 41) start a pulled send, say so (tag 42) and wait
    to be killed."""
    await comm.send({"x": np.zeros(nbytes, np.uint8)}, dst, timeout=30)
    await pulled_by(comm, dst)
    await comm.send("agreed", ctl, tag=40, timeout=30)
    await comm.recv(ctl, tag=41, timeout=30)
    comm.async_send({"x": np.full(nbytes, 7, np.uint8)}, dst)      # its read never ends: we die first
    await comm.send(comm._lifecycle.pull.offered, ctl, tag=42, timeout=30)
    await asyncio.Event().wait()


async def frozen_puller(comm, src: str, ctl: str, go: str):
    """Receive ``src``'s first message (we then agree to pull from it); on ``ctl``'s word
    (tag 1) say "frozen" (tag 2) and block our loop until a byte comes through the FIFO
    ``go`` (the test's gate: what arrives meanwhile waits in the socket); then receive
    ``src``'s next message and report how that went."""
    import os

    await comm.recv(src, timeout=30)
    await comm.recv(ctl, tag=1, timeout=30)
    await comm.send("frozen", ctl, tag=2, timeout=30)
    await asyncio.sleep(0)        # one loop turn: the reply's frame set goes out (Outbox.put)
    fd = os.open(go, os.O_RDONLY)  # the test holds it open for writing: no wait here
    try:
        os.read(fd, 1)            # the loop is blocked on purpose: nothing is read meanwhile
    finally:
        os.close(fd)
    try:
        obj = await comm.recv(src, timeout=30)
        return {"got": sorted(set(np.unique(obj["x"]).tolist())), **pull_state(comm)}
    except rlinf.PeerLostError as exc:
        return {"lost": str(exc), **pull_state(comm)}
    except rlinf.RlinfError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", **pull_state(comm)}
