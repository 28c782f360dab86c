"""A channel client taken for lost by the channel's server, then back under the same
incarnation (a stall or a network outage; issue 23, found by the chaos soak): nothing it
sends vanishes silently, and nothing sent to it is delivered twice."""

from __future__ import annotations

import asyncio

import pytest

import rlinf
from rlinf.channel import server as channel_server
from rlinf.channel.server import ChannelServer
from rlinf.info import MembershipEvent

from .wait import until

pytestmark = pytest.mark.multiproc


@pytest.fixture
async def serve(cluster):
    """``await serve(name)``: a channel server in this process, and communicators
    c0..c2 to use it through; all closed after the test."""
    made: list = []

    async def make(name: str, **options):
        server = await ChannelServer(name, manager=cluster.manager_address, token=cluster.token, **options).start()
        made.append(server)
        comms = [await cluster.connect(f"c{i}:0").start() for i in range(3)]
        made.extend(comms)
        return server, comms

    yield make
    async with asyncio.timeout(30):
        for thing in reversed(made):
            try:
                await thing.aclose()
            except rlinf.RlinfError:    # a test checks what it expects its close to raise
                pass


def _lost(server: ChannelServer, comm) -> object:
    """The server takes ``comm`` for lost, as the manager would announce; returns what
    :func:`_back` needs."""
    info = server.comm._roster[comm.address]
    server.comm._membership.on_event(MembershipEvent("lost", comm.address, comm.incarnation))
    return info


def _back(server: ChannelServer, comm, info) -> None:
    server.comm._membership.on_event(MembershipEvent("joined", comm.address, comm.incarnation, info))


async def test_a_handle_forgotten_while_taken_for_lost_fails_instead_of_hanging(serve, monkeypatch):
    """The server forgot the handle of a worker it took for lost (it did not come back in
    time): the puts it makes once back were dropped with a log line on the server, and
    its flush waited forever. Now the server tells it, and it raises PeerLostError
    saying how many puts were not applied."""
    monkeypatch.setattr(channel_server, "LOST_HOLD", 0.05, raising=False)
    async with asyncio.timeout(60):
        server, (c0, *_) = await serve("forgot")
        ch = await c0.channel("forgot", timeout=10)
        await ch.put("applied")
        await ch.flush(timeout=10)
        info = _lost(server, c0)
        await until(lambda: not server.core.handles, what="the handle forgotten")
        _back(server, c0, info)
        for i in range(3):
            await ch.put(i)
        with pytest.raises(rlinf.PeerLostError, match=r"forgot this handle.*3 put\(s\) from this handle were not"):
            await ch.flush(timeout=10)
        with pytest.raises(rlinf.PeerLostError, match="forgot this handle"):
            await ch.put("next")
        assert server.core.queued == 1          # only the put made before
        with pytest.raises(rlinf.PeerLostError, match="3 put"):
            await c0.aclose()                   # a clean close says so too


async def test_items_sent_to_a_consumer_taken_for_lost_are_delivered_once(serve):
    """Items prefetched by a consumer the server takes for lost were put back and given
    to another consumer; the first, back under the same incarnation, returned them from
    its prefetch buffer too: duplicates. Now what was sent to it stays its own while it
    may come back; only what was not sent goes to the others."""
    async with asyncio.timeout(60):
        server, (c0, c1, c2) = await serve("dup")
        a = await c0.channel("dup", timeout=10, prefetch=4)
        b = await c1.channel("dup", timeout=10)
        producer = await c2.channel("dup", timeout=10)
        await producer.put(0)
        got_a = [await a.get(timeout=10)]
        for i in range(1, 5):
            await producer.put(i)
        await until(lambda: len(a._buffers.get(None, ())) == 4, what="four items prefetched")
        waiting = b.async_get()
        await b.stats(timeout=10)               # answered after the get: the server has it
        info = _lost(server, c0)
        await producer.put(5)
        await producer.flush(timeout=10)
        got_b = [await waiting]
        _back(server, c0, info)
        await producer.close(timeout=10)

        async def drain(ch, got):
            while True:
                try:
                    got.append(await ch.get(timeout=20))
                except rlinf.EndOfChannel:
                    return

        await asyncio.gather(drain(a, got_a), drain(b, got_b))
        everything = got_a + got_b
        assert sorted(everything) == list(range(6)), (got_a, got_b)   # each exactly once


async def test_a_producer_first_heard_before_its_join_is_suspended_when_lost_not_forgotten(serve):
    """The server judged whether a worker taken for lost was dead by the roster entry it
    cached at the worker's first op: none when that op overtook the worker's join (or
    another incarnation's), which counted as dead. Its handle was forgotten, the puts it
    made while cut off never arrived, and its next op raised (the chaos soak, seed 23).
    Now the judgement uses what the roster knew of that incarnation when it was lost."""
    async with asyncio.timeout(60):
        server, (c0, c1, _) = await serve("early")
        info = server.comm._roster.pop(c0.address)          # its join not seen yet ...
        producer = await c0.channel("early", timeout=10)
        await producer.put(0)
        await producer.flush(timeout=10)                     # ... when its first ops arrive
        _back(server, c0, info)                              # then the join
        _lost(server, c0)
        await until(lambda: all(h.lost for h in server.core.handles.values() if h.src == c0.address),
                    what="its handle suspended")
        for i in range(1, 4):
            await producer.put(i)                            # held by the server's receive path
        _back(server, c0, info)
        await producer.flush(timeout=10)
        consumer = await c1.channel("early", timeout=10)
        got = [await consumer.get(timeout=10) for _ in range(4)]
        assert sorted(got) == [0, 1, 2, 3]


async def test_a_hold_ends_with_its_own_loss_not_a_later_one(serve):
    """A worker taken for lost, back, then taken for lost again: the hold of its first
    loss ended during the second and forgot it at once, although it had been cut off
    only a moment (its puts meanwhile were dropped; the chaos soak, seed 23, twice).
    Each loss now has its own hold."""
    async with asyncio.timeout(60):
        server, (c0, c1, _) = await serve("twice")
        producer = await c0.channel("twice", timeout=10)
        await producer.put(0)
        await producer.flush(timeout=10)
        [h] = [h for h in server.core.handles.values() if h.src == c0.address]
        info = _lost(server, c0)
        await until(lambda: h.lost, what="its handle suspended")
        first = h.suspensions
        _back(server, c0, info)
        await producer.put(1)
        await producer.flush(timeout=10)
        assert not h.lost                                   # back: its next op resumed it
        _lost(server, c0)
        await until(lambda: h.lost and h.suspensions == first + 1, what="suspended again")
        server._expire(h, first)                            # the first loss's hold ends now
        assert server.core.handles.get((h.src, h.hid)) is h and h.lost   # still held, not forgotten
        await producer.put(2)                               # held while it is cut off
        _back(server, c0, info)
        await producer.flush(timeout=10)
        consumer = await c1.channel("twice", timeout=10)
        assert sorted([await consumer.get(timeout=10) for _ in range(3)]) == [0, 1, 2]
