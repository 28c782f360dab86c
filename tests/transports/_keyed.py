"""Checks shared by the transports that open with the key challenge (bulk TCP, stream)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading

import numpy as np
import pytest

import rlinf
from rlinf.transports.shm import Recycler


async def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` without sending anything (EOF or a reset)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, sock.recv, 1) == b""
    except ConnectionResetError:
        return True


async def check_a_client_without_the_key_is_refused(transport, key: bytes, listener, scheme: str) -> None:
    """A client with another key fails with AuthenticationError; a good one still gets
    its frame set delivered, under its identity."""
    async with asyncio.timeout(20):
        with pytest.raises(rlinf.AuthenticationError):
            await transport(b"x" * 32).connect(listener.endpoints[scheme], identity=b"evil|1")
        good = await transport(key).connect(listener.endpoints[scheme], identity=b"good|1")
        await good.send(b"h", [b"payload"])
        received = await listener.recv()
        assert (received.peer, received.header, bytes(received.frames[0])) == (b"good|1", b"h", b"payload")
        good.close()


async def check_it_still_serves(transport, key: bytes, listener, scheme: str) -> None:
    """A new client's frame set (1 MiB and an empty buffer) is delivered whole: what
    went before did not break the listener."""
    link = await transport(key).connect(listener.endpoints[scheme], identity=b"a|1")
    data = np.arange(1 << 20, dtype=np.uint8)
    await link.send(b"h", [data, b""])
    received = await listener.recv()
    assert np.array_equal(np.frombuffer(received.frames[0], np.uint8), data)
    assert received.frames[1].nbytes == 0
    link.close()


async def check_more_than_65536_buffers_arrive(transport, key: bytes, listener, scheme: str) -> None:
    """A frame set of 70 000 buffers (the wire format allows 4M: one per buffer of a large
    message) arrives whole, and the link still carries the next one."""
    link = await transport(key).connect(listener.endpoints[scheme], identity=b"a|1")
    await link.send(b"many", [bytes([i % 251]) * 3 for i in range(70_000)])
    await link.send(b"next", [])
    got = [await listener.recv(), await listener.recv()]
    assert [g.header for g in got] == [b"many", b"next"] and len(got[0].frames) == 70_000
    assert bytes(got[0].frames[69_999]) == bytes([69_999 % 251]) * 3
    link.close()


#: Bytes of memory this machine has: a claim beyond it can never be honoured here.
PHYSICAL_MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sizes_past_memory(frame: int) -> list[int]:
    """Frame sizes of at most ``frame`` bytes adding up to 100 GiB, or to twice this
    machine's memory where that is more (the claim must exceed it everywhere)."""
    total = max(100 << 30, 2 * PHYSICAL_MEMORY)
    return [frame] * -(-total // frame)


@contextlib.contextmanager
def watched(caplog, logger: str):
    """Within: record what reaches the running loop's exception handler, the threads'
    excepthook and the logs. On leaving, assert nothing reached the first two and no
    "Fatal error" was logged; the block reads ``records()`` for ``logger``'s warnings."""
    loop = asyncio.get_running_loop()
    unhandled: list = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    previous, threading.excepthook = threading.excepthook, unhandled.append
    try:
        with caplog.at_level(logging.WARNING):
            yield lambda: [r.getMessage() for r in caplog.records if r.name == logger]
    finally:
        loop.set_exception_handler(None)
        threading.excepthook = previous
    assert unhandled == []
    assert not [r for r in caplog.records if "Fatal error" in r.getMessage() or r.name == "asyncio"]


class ShortOfMemory(Recycler):
    """Receive memory on a machine short of it: nothing over 1 MiB at once."""

    def take(self, n: int):
        if n > 1 << 20:
            raise MemoryError(f"cannot allocate {n} bytes")
        return super().take(n)
