"""The Ray actor's relay of a worker's messages loses nothing when a reply is lost
(no Ray cluster needed: the actor's class is driven directly)."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing

import pytest

pytest.importorskip("ray")
from rlinf.launch.ray import _RankActor  # noqa: E402


def _relay() -> tuple[_RankActor, object]:
    actor = _RankActor.__new__(_RankActor)   # without a worker thread or a Ray runtime
    actor._conn, worker_end = multiprocessing.Pipe()
    actor._node, actor._incarnation = "node-1", "inc-1"
    actor._unacked, actor._seq, actor._eof = collections.deque(), 0, False
    actor._reading = asyncio.Lock()
    return actor, worker_end


async def test_unacknowledged_messages_are_sent_again_and_acknowledged_ones_dropped():
    actor, worker = _relay()
    async with asyncio.timeout(10):
        worker.send_bytes(b"a")
        worker.send_bytes(b"b")
        node, inc, batch = await actor.messages("", 0)
        assert (node, inc, batch) == ("node-1", "inc-1", [(1, b"a"), (2, b"b")])
        # that reply was lost: the driver asks again with what it had acknowledged before
        worker.send_bytes(b"c")
        _, _, again = await actor.messages("", 0)
        assert again == [(1, b"a"), (2, b"b")]                # nothing read in between is lost
        _, _, rest = await actor.messages("inc-1", 2)
        assert rest == [(3, b"c")]
        # an acknowledgement for another incarnation (before a restart) drops nothing
        worker.send_bytes(b"d")
        _, _, kept = await actor.messages("inc-0", 99)
        assert kept == [(3, b"c")]


async def test_a_retry_while_the_first_call_still_reads_does_not_read_the_pipe_twice():
    actor, worker = _relay()
    async with asyncio.timeout(10):
        first = asyncio.ensure_future(actor.messages("", 0))   # blocks reading the pipe
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(actor.messages("", 0))   # the driver gave up on the first
        await asyncio.sleep(0)
        worker.send_bytes(b"x")
        assert (await first)[2] == [(1, b"x")]
        assert (await retry)[2] == [(1, b"x")]
