"""rlinf.core._arrival: bulk frame sets are delivered in call order with the ZeroMQ ones."""

from __future__ import annotations

import asyncio

import pytest

from rlinf.core import _arrival as arrival
from rlinf.core._arrival import ArrivalOrder, bulk_header
from rlinf.transports.base import Received


def _zmq(peer: bytes, name: str) -> Received:
    return Received(peer, name.encode(), [])


def _bulk(peer: bytes, name: str, after: int) -> Received:
    return Received(peer, bulk_header(after, name.encode()), [])


async def test_a_bulk_frame_set_waits_for_the_zeromq_ones_sent_before_it():
    got = []
    order = ArrivalOrder(lambda r: got.append((r.peer, r.header)), asyncio.get_running_loop())
    order.zmq(_zmq(b"a|1", "z1"))
    order.bulk(_bulk(b"a|1", "B1", after=3))      # z2 and z3 were sent before it, not here yet
    order.bulk(_bulk(b"a|1", "B2", after=3))      # behind B1 on its stream
    order.bulk(_bulk(b"b|1", "other", after=0))   # another sender is not held up
    order.zmq(_zmq(b"a|1", "z2"))
    assert [h for _, h in got] == [b"z1", b"other", b"z2"]
    order.zmq(_zmq(b"a|1", "z3"))
    order.zmq(_zmq(b"a|1", "z4"))
    assert [h for p, h in got if p == b"a|1"] == [b"z1", b"z2", b"z3", b"B1", b"B2", b"z4"]
    order.bulk(_bulk(b"a|1", "B3", after=4))      # nothing missing: at once
    assert got[-1] == (b"a|1", b"B3")


async def test_a_parked_frame_set_is_delivered_after_the_grace(monkeypatch):
    monkeypatch.setattr(arrival, "GRACE", 0.01)
    delivered = asyncio.Event()
    got = []

    def deliver(r: Received) -> None:
        got.append(r.header)
        delivered.set()

    order = ArrivalOrder(deliver, asyncio.get_running_loop())
    order.bulk(_bulk(b"a|1", "B", after=1))       # the ZeroMQ frame set before it never comes
    async with asyncio.timeout(10):
        await delivered.wait()
    assert got == [b"B"]
    order.zmq(_zmq(b"a|1", "late"))              # counted on from where the grace left it
    order.bulk(_bulk(b"a|1", "C", after=2))
    assert got == [b"B", b"late", b"C"]


async def test_forget_drops_a_senders_count_and_parked_sets():
    got = []
    order = ArrivalOrder(lambda r: got.append(r.header), asyncio.get_running_loop())
    order.zmq(_zmq(b"a|1", "z"))
    order.bulk(_bulk(b"a|1", "B", after=5))
    order.forget(b"a|1")
    order.zmq(_zmq(b"a|1", "z2"))
    assert got == [b"z", b"z2"] and "parked=0" in repr(order)


@pytest.mark.parametrize("header", [b"", b"\x00" * 7])
async def test_a_bulk_frame_set_without_its_order_is_dropped(header):
    got = []
    order = ArrivalOrder(lambda r: got.append(r), asyncio.get_running_loop())
    order.bulk(Received(b"a|1", header, []))
    assert got == []
