"""Single-copy pulls between real processes: a copy-out receiver reads a same-node
sender's buffers in place (``rlinf/transports/shm/_pull.py``)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import rlinf
from rlinf.util.procs import process_gone
from rlinf.transports import cma

from .wait import until
from . import workers_shm

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not cma.available(), reason="no process_vm_readv / pidfd here")]

COPY_OUT = {"RLINF_SHM_VIEWS": "0"}


class Gate:
    """A FIFO that holds a worker's loop blocked (``frozen_puller`` reads a byte from it)
    until :meth:`open`. We keep it open read-write, so neither side's ``open`` waits."""

    def __init__(self, path) -> None:
        os.mkfifo(path)
        self.path = str(path)
        self._fd = os.open(path, os.O_RDWR)

    def open(self) -> None:
        os.write(self._fd, b"g")

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def gate(tmp_path):
    g = Gate(tmp_path / "go")
    yield g
    g.close()


async def test_a_copy_out_receiver_pulls_and_a_send_returns_only_once_read(cluster):
    """The first message goes through a slot; the receiver then asks to pull, and the
    rest are pulled. The sender refills its one buffer as soon as each send returned:
    the receiver still sees every message as it was sent."""
    n = 8
    async with asyncio.timeout(60):
        receiver = await cluster.spawn(workers_shm.check_fills, "checker", 1, args=("sender:0", n), env=COPY_OUT)
        sender = await cluster.spawn(workers_shm.send_reused, "sender", 1, args=("checker:0", n, 3 << 20))
        [got], [sent] = await asyncio.gather(receiver.join(), sender.join())
        assert got["pulled"] == n - 1, got          # all but the first, which went through a slot
        assert got["sources"] == 1
        assert sent["offered"] == got["pulled"] and sent["held"] == 0
        assert sent["held_after_send"] == 0         # no send returned before its read


async def test_two_copy_out_peers_that_send_first_do_not_wait_on_each_other(cluster):
    """Each sends a large array, then receives: reads happen on arrival, not on receive."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.swap, "p", 2, args=(6, 4 << 20), env=COPY_OUT)
        states = await group.join()
        assert all(s["pulled"] == 6 and s["offered"] == 6 for s in states), states


async def test_a_send_waiting_on_a_killed_receiver_fails_with_peer_lost(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers_shm.pull_then_freeze, "frozen", 1, args=("driver:0",), env=COPY_OUT)
        await driver.send({"x": np.ones(2 << 20, np.uint8)}, "frozen:0")          # through a slot
        [info] = [p for p in await driver.peers() if p.address == "frozen:0"]
        await until(lambda: driver._lifecycle.pull.agreed("frozen:0", info.incarnation), what="the receiver to agree to pull")
        await driver.send("freeze", "frozen:0", tag=1)
        assert await driver.recv("frozen:0", tag=2) == "frozen"
        sending = asyncio.ensure_future(driver.send({"x": np.ones(2 << 20, np.uint8)}, "frozen:0"))
        await until(lambda: driver._lifecycle.pull.offered == 1, what="the pulled send to be queued")
        assert not sending.done()                     # nobody reads it
        await group.kill()
        with pytest.raises(rlinf.PeerLostError):
            await asyncio.wait_for(sending, 10)
        assert not driver._lifecycle.pull._held


async def test_pulls_off_on_the_sender_keep_slots(cluster):
    n = 4
    async with asyncio.timeout(60):
        receiver = await cluster.spawn(workers_shm.check_fills, "checker", 1, args=("sender:0", n), env=COPY_OUT)
        sender = await cluster.spawn(workers_shm.send_reused, "sender", 1, args=("checker:0", n, 2 << 20),
                                     env={"RLINF_SHM_PULL": "0"})
        [got], [sent] = await asyncio.gather(receiver.join(), sender.join())
        assert got["pulled"] == 0 and got["sources"] == 0 and sent["offered"] == 0


async def test_a_sender_killed_before_its_message_is_read_fails_that_receive(cluster, driver, gate):
    """The receiver's loop is frozen while a pulled message arrives and its sender is
    killed; once the receiver reads on, its read finds the sender gone (its pidfd says
    so, whatever process has that pid now): the receive raises PeerLostError, nothing
    else is read."""
    async with asyncio.timeout(60):
        receiver = await cluster.spawn(workers_shm.frozen_puller, "puller", 1,
                                       args=("sender:0", "driver:0", gate.path), env=COPY_OUT)
        sender = await cluster.spawn(workers_shm.pull_sender, "sender", 1, args=("puller:0", "driver:0", 2 << 20))
        assert await driver.recv("sender:0", tag=40) == "agreed"
        await driver.send("freeze", "puller:0", tag=1)
        assert await driver.recv("puller:0", tag=2) == "frozen"
        await driver.send("go", "sender:0", tag=41)
        assert await driver.recv("sender:0", tag=42) == 1          # one pulled send in flight
        pid = sender.pids[0]
        await sender.kill()
        await until(lambda: process_gone(pid), what="the sender to be gone")
        gate.open()
        [got] = await receiver.join()
        assert "could be read" in got.get("lost", "") and got["pulled"] == 1, got     # the read failed


@pytest.mark.parametrize("how", ["timeout", "close"])
async def test_a_send_given_up_before_its_read_never_delivers_the_reused_buffer(cluster, gate, how):
    """The receiver's loop is frozen while a pulled message waits; the sender's send
    times out (or the sender closes), so the caller reuses its buffer. When the receiver
    reads on, its read finds the hold revoked: that receive raises DecodeError, and the
    bytes written after the send failed are never delivered as the message."""
    sender = await cluster.connect("giver:0").start()
    try:
        async with asyncio.timeout(60):
            receiver = await cluster.spawn(workers_shm.frozen_puller, "puller", 1,
                                           args=("giver:0", "giver:0", gate.path), env=COPY_OUT)
            await sender.send({"x": np.ones(2 << 20, np.uint8)}, "puller:0")          # through a slot
            [info] = [p for p in await sender.peers() if p.address == "puller:0"]
            await until(lambda: sender._lifecycle.pull.agreed("puller:0", info.incarnation), what="the receiver to agree")
            await sender.send("freeze", "puller:0", tag=1)
            assert await sender.recv("puller:0", tag=2) == "frozen"
            buf = np.full(2 << 20, 7, np.uint8)
            if how == "timeout":
                with pytest.raises(rlinf.CommTimeoutError):
                    await sender.send({"x": buf}, "puller:0", timeout=0.2)
            else:
                sending = asyncio.ensure_future(sender.send({"x": buf}, "puller:0"))
                await until(lambda: sender._lifecycle.pull.offered == 1, what="the pulled send to be queued")
                with pytest.raises(rlinf.CommTimeoutError, match="puller:0"):
                    await sender.aclose()  # waits a moment for the read (none comes), then revokes;
                                           # raises: the frozen receiver acknowledged nothing
                with pytest.raises(rlinf.ClosedError):
                    await sending
            assert not sender._lifecycle.pull._held
            buf[:] = 9                     # the send failed: the caller reuses its buffer
            gate.open()
            [got] = await receiver.join()
            assert "withdrew" in got.get("error", ""), got
    finally:
        await sender.aclose()
