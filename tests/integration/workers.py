"""Module-level worker targets for the integration tests (the spawn context imports them)."""

from __future__ import annotations

import asyncio

import rlinf


async def echo(comm, peer: str, n: int, tag: int = 0):
    """Receive ``n`` messages from ``peer`` and send each back."""
    for _ in range(n):
        obj = await comm.recv(peer, tag=tag, timeout=60)
        await comm.send(obj, peer, tag=tag, timeout=60)
    return n


async def send_range(comm, dst: str, n: int, tag: int = 0):
    """Send 0..n-1 to ``dst`` with ``tag``, then wait for an ack (tag -1)."""
    for i in range(n):
        await comm.send(i, dst, tag=tag, timeout=60)
    return await comm.recv(dst, tag=999, timeout=60)


async def send_range_and_leave(comm, dst: str, n: int, tag: int = 0):
    """Send 0..n-1 to ``dst`` with ``tag`` and return at once (a clean exit: the
    communicator closes, its goodbye follows the data)."""
    for i in range(n):
        await comm.send(i, dst, tag=tag, timeout=60)
    return n


async def idle(comm):
    """Wait until stopped or killed; tell the driver we are up first."""
    await comm.send("up", "driver:0", tag=7, timeout=60)
    await asyncio.Event().wait()


async def raise_error(comm, message: str):
    raise RuntimeError(message)


async def send_range_and_raise(comm, dst: str, n: int, message: str):
    """Send 0..n-1 to ``dst``, then raise ``ValueError(message)`` (a worker that fails
    after its last messages: they are delivered, as a clean exit's are)."""
    for i in range(n):
        await comm.send(i, dst, timeout=60)
    raise ValueError(message)


async def late_joiner(comm):
    obj = await comm.recv("driver:0", timeout=60)
    await comm.send(("late", obj), "driver:0", timeout=60)
    return "ok"


class Counter(rlinf.Worker):
    """A Worker with state, a sync and an async method."""

    def __init__(self, start: int = 0) -> None:
        self.value = start

    async def setup(self) -> None:
        self.value += self.rank

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    async def where(self) -> tuple[str, int, int]:
        await asyncio.sleep(0)
        return self.address, self.rank, self.world_size

    def fail(self) -> None:
        raise ValueError("boom from a method")


async def return_tensor(comm):
    """A return value holding a tensor must reach the driver although we exit at once."""
    import torch

    return {"t": torch.arange(5), "ok": True}


async def link_kind(comm, peer: str):
    """Send one message to ``peer``; return the class name of the link it went over."""
    await comm.send("hi", peer, timeout=30)
    return type(comm._sessions.get(peer).outbox.link).__name__


async def public_communicator(comm):
    """Whether a spawned worker is given the public Communicator (groups and channels)."""
    return isinstance(comm, rlinf.Communicator) and callable(comm.group) and callable(comm.channel)


async def send_paced(comm, dst: str, n: int, pause: float):
    """Send 0..n-1 to ``dst``, ``pause`` seconds apart (messages are in flight at any
    moment), then wait for its "done"."""
    for i in range(n):
        await comm.send(i, dst, timeout=60)
        await asyncio.sleep(pause)
    assert await comm.recv(dst, timeout=60) == "done"
    return n


async def send_and_return(comm, dst: str, n: int):
    """Send 0..n-1 to ``dst`` and return at once (the communicator closes)."""
    for i in range(n):
        await comm.send(i, dst, timeout=60)
    return n
