"""Flow control (DESIGN.md §4, issue 24): a receiver grants each sender a window of user
messages; sends wait for room, so a slow receiver's memory stays bounded; a send that
waits too long times out having sent nothing; rlinf's own traffic never waits for it.
Each test keeps a ledger of numbered messages: everything arrives once, in order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rlinf
from rlinf.config import Settings

from .wait import until

pytestmark = pytest.mark.multiproc

WINDOW_MSGS, WINDOW_BYTES = 16, 64 << 10


def _small_window(**changes) -> Settings:
    return Settings.from_env().replace(window_msgs=WINDOW_MSGS, window_bytes=WINDOW_BYTES, **changes)


def _held(receiver, sender) -> tuple[int, int]:
    """What ``receiver`` holds of ``sender``'s user messages (its own count)."""
    inflows = [i for i in receiver._sessions.inflows.values() if i.address == sender.address]
    return (sum(i.held for i in inflows), sum(i.held_bytes for i in inflows))


def _waiting(sender, dst: str) -> int:
    """How many of ``sender``'s messages to ``dst`` wait for room."""
    session = sender._sessions.get(dst)
    return len(session.outbox.credit.waiting) if session is not None else 0


async def _drain(comm, src: str, n: int) -> list:
    return [await comm.recv(src, timeout=10) for _ in range(n)]


async def test_a_slow_receiver_holds_at_most_its_window(cluster):
    """A sender far ahead of a receiver that does not receive: its sends wait once the
    window is full (the receiver holds no more than that), and go on as it receives."""
    async with asyncio.timeout(60), cluster.connect("a:0") as a, \
            cluster.connect("b:0", settings=_small_window()) as b:
        payload = bytes(1024)
        sending = asyncio.ensure_future(_send_all(a, "b:0", 200, payload))
        await until(lambda: _waiting(a, "b:0") or sending.done(), what="the sender waiting for room")
        assert not sending.done(), "the sender finished although the receiver took nothing"
        await until(lambda: _held(b, a)[0] == WINDOW_MSGS, what="the window's messages held")
        held = _held(b, a)
        assert held[0] <= WINDOW_MSGS and held[1] <= WINDOW_BYTES, held
        assert a.stats().peers["b:0"].credit_waits >= 1
        got = []
        for _ in range(200):
            got.append((await b.recv("a:0", timeout=10))[0])
            held = _held(b, a)
            assert held[0] <= WINDOW_MSGS and held[1] <= WINDOW_BYTES, held
        await asyncio.wait_for(sending, 10)
        assert [int.from_bytes(g, "little") for g in got] == list(range(200))


async def _send_all(comm, dst: str, n: int, payload: bytes, **kwargs) -> None:
    for i in range(n):
        await comm.send([i.to_bytes(4, "little"), payload], dst, **kwargs)


async def test_a_send_that_times_out_waiting_for_room_sends_nothing(cluster):
    async with asyncio.timeout(60), cluster.connect("a:0") as a, \
            cluster.connect("b:0", settings=_small_window()) as b:
        for i in range(WINDOW_MSGS):
            await a.send(i, "b:0", timeout=5)
        with pytest.raises(rlinf.CommTimeoutError):
            await a.send("timed out", "b:0", timeout=0.3)
        later = asyncio.ensure_future(a.send(WINDOW_MSGS, "b:0", timeout=10))
        got = await _drain(b, "a:0", WINDOW_MSGS + 1)
        await later
        assert got == list(range(WINDOW_MSGS + 1))          # the timed-out one never went
        with pytest.raises(rlinf.CommTimeoutError):
            await b.recv("a:0", timeout=0.3)


async def test_a_message_larger_than_the_window_goes_when_nothing_is_outstanding(cluster):
    """One message larger than the window goes alone; the next waits until the receiver
    took it."""
    async with asyncio.timeout(60), cluster.connect("a:0") as a, \
            cluster.connect("b:0", settings=_small_window()) as b:
        big = np.arange(4 * WINDOW_BYTES // 8, dtype=np.int64)
        await a.send(big, "b:0", timeout=10)
        second = asyncio.ensure_future(a.send(big * 2, "b:0", timeout=10))
        await until(lambda: _waiting(a, "b:0") or second.done(), what="the second send waiting for room")
        assert not second.done() and _held(b, a)[0] == 1
        assert np.array_equal(await b.recv("a:0", timeout=10), big)
        await second
        assert np.array_equal(await b.recv("a:0", timeout=10), big * 2)


async def test_async_send_completes_once_sent_and_keeps_the_order(cluster):
    async with asyncio.timeout(60), cluster.connect("a:0") as a, \
            cluster.connect("b:0", settings=_small_window()) as b:
        works = [a.async_send(i, "b:0") for i in range(3 * WINDOW_MSGS)]
        await asyncio.wait_for(works[WINDOW_MSGS - 1], 10)
        assert not works[-1].done()
        got = await _drain(b, "a:0", 3 * WINDOW_MSGS)
        await asyncio.wait_for(asyncio.gather(*works), 10)
        assert got == list(range(3 * WINDOW_MSGS))


async def test_collectives_and_acknowledgements_pass_full_windows(cluster):
    """Both sides filled each other's user window and neither receives: a collective
    between them still completes (rlinf's own traffic never waits for user credit), and
    afterwards everything is delivered in order."""
    settings = _small_window()
    async with asyncio.timeout(60), cluster.connect("a:0", settings=settings) as a, \
            cluster.connect("b:0", settings=settings) as b:
        for comm, peer in ((a, "b:0"), (b, "a:0")):
            for i in range(WINDOW_MSGS):
                await comm.send(i, peer, timeout=5)
        blocked = [asyncio.ensure_future(a.send(WINDOW_MSGS, "b:0")),
                   asyncio.ensure_future(b.send(WINDOW_MSGS, "a:0"))]
        group_a, group_b = a.group(["a:0", "b:0"]), b.group(["a:0", "b:0"])
        sums = await asyncio.gather(group_a.all_reduce(np.ones(4)), group_b.all_reduce(np.full(4, 2.0)))
        for s in sums:
            assert np.array_equal(np.asarray(s), np.full(4, 3.0))
        assert not any(t.done() for t in blocked)
        got_b, got_a = await asyncio.gather(_drain(b, "a:0", WINDOW_MSGS + 1), _drain(a, "b:0", WINDOW_MSGS + 1))
        await asyncio.gather(*blocked)
        assert got_a == got_b == list(range(WINDOW_MSGS + 1))


async def test_a_large_message_is_not_held_back_by_a_small_one_read_later(cluster):
    """Metadata on one tag, then a message larger than the window on another, which the
    receiver reads first (as MPI programs do): the large one must not wait until the
    small one is received."""
    async with asyncio.timeout(60), cluster.connect("a:0") as a, \
            cluster.connect("b:0", settings=_small_window()) as b:
        await a.send("meta", "b:0", tag=7, timeout=10)
        big = np.arange(4 * WINDOW_BYTES // 8, dtype=np.int64)
        await a.send(big, "b:0", tag=1, timeout=10)
        assert np.array_equal(await b.recv("a:0", tag=1, timeout=10), big)
        assert await b.recv("a:0", tag=7, timeout=10) == "meta"
