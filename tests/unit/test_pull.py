"""The pull protocol (rlinf/transports/_pull.py) between two sessions of this process,
wired by their notices: the handshake, reads, completions, refusals and failures."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest

from rlinf import wire
from rlinf.copier import Copier
from rlinf.errors import ClosedError, DecodeError, PeerLostError, ProtocolError
from rlinf.transports import cma
from rlinf.transports._pull import DEFAULT_PULL, PullSession, pull_threshold
from rlinf.transports._shm_pool import Recycler

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv / pidfd here")


class Pair:
    """A sender ``s:0`` and a receiver ``r:0`` (both this process); ``deliver()`` hands
    each its queued notices, as the communicator's SYSTEM messages would."""

    def __init__(self, *, threshold: int = 1 << 20, offload: int = 16 << 20, pid: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.queued: list[tuple[str, str, list]] = []     # (to, from, notice)
        self.copier = Copier(2, split_bytes=1 << 20)
        self.sessions = {}
        for me, inc in (("s:0", "S1"), ("r:0", "R1")):
            self.sessions[me] = PullSession(
                loop, inc, lambda dst, obj, me=me: self.queued.append((dst, me, obj)), Recycler(1 << 30),
                self.copier, offload=offload, threshold=threshold, pid_of=lambda a: pid)
        self.s, self.r = self.sessions["s:0"], self.sessions["r:0"]

    def deliver(self) -> list[str]:
        """Deliver every queued notice (and those they cause); what was delivered."""
        seen = []
        while self.queued:
            dst, src, obj = self.queued.pop(0)
            seen.append(obj[0])
            self.sessions[dst].on_notice(src, obj)
        return seen

    def agree(self) -> None:
        self.r.want("s:0", "S1")
        assert self.deliver() == ["ask", "cookie", "ok"]
        assert self.s.agreed("r:0", "R1") and not self.s.agreed("r:0", "R0")

    def close(self) -> None:
        for session in self.sessions.values():
            session.close(ClosedError("closed"))
        self.copier.close()


@pytest.fixture
async def pair():
    p = Pair()
    yield p
    p.close()


def _send(pair: Pair, buffers: list) -> tuple[asyncio.Future, list, asyncio.Future]:
    """Offer ``buffers`` from s to r and let r open the entry: ``(send future, r's
    buffers, r's read future)``."""
    sizes = [memoryview(b).nbytes for b in buffers]
    layout, item, sent = pair.s.offer("r:0", buffers, sizes)
    entry, _ = wire._unpack_entry([0, 0, b"", layout, None, None, None, item], 1 << 22, 0)   # packed
    got, reading = pair.r.open("s:0", "S1", entry.pull, [-c for c in entry.frame_counts if c < 0])
    return sent, got, reading


@pytest.mark.parametrize("offload", [16 << 20, 0])      # read on the loop / in an executor
async def test_an_agreed_pull_reads_exactly_and_completes_the_send_after(offload):
    pair = Pair(offload=offload)
    try:
        pair.agree()
        a = np.arange(3 << 18, dtype=np.float32)          # 3 MiB
        b = np.frombuffer(os.urandom(4099), np.uint8)      # odd size, read-only
        sent, got, reading = _send(pair, [a, memoryview(b"")[:0], b])
        async with asyncio.timeout(10):
            await reading
        assert not sent.done()                             # not before the receiver says so
        assert pair.deliver() == ["done"]
        assert sent.done() and sent.result() is None and not pair.s._held
        assert np.array_equal(np.frombuffer(got[0], np.float32), a) and bytes(got[1]) == bytes(b)
        got[0][:4] = b"\0\0\0\0"                           # owned and writable
        assert (pair.s.offered, pair.r.pulled) == (1, 1)
        assert pair.s.report() == {"threshold": 1 << 20, "offered": 1, "pulled": 0, "agreed": 1, "sources": 0,
                                   "held": 0}
        assert pair.r.report()["sources"] == 1
    finally:
        pair.close()


async def test_nothing_is_asked_twice_and_pulls_off_neither_ask_nor_answer():
    pair = Pair(threshold=0)
    try:
        pair.r.want("s:0", "S1")
        assert pair.deliver() == []
        pair.r.threshold = 1                  # r asks, s (off) does not answer
        pair.r.want("s:0", "S1")
        assert pair.deliver() == ["ask"]
        pair.r.want("s:0", "S1")
        assert pair.deliver() == []
    finally:
        pair.close()


async def test_a_sender_that_cannot_be_verified_keeps_using_slots(caplog):
    pair = Pair(pid=1)          # the roster says another pid than the cookie's
    try:
        with caplog.at_level(logging.INFO, "rlinf.transports.shm"):
            pair.r.want("s:0", "S1")
            assert pair.deliver() == ["ask", "cookie"]          # no "ok"
        assert not pair.s.agreed("r:0", "R1") and "no pulls from it" in caplog.text
        pair2 = Pair()
        try:
            pair2.r.want("s:0", "S1")
            dst, src, cookie = pair2.queued.pop()
            pair2.s.on_notice(src, cookie)                      # the ask
            dst, src, cookie = pair2.queued.pop()
            cookie[4] = bytes(16)                               # a forged cookie
            with caplog.at_level(logging.INFO, "rlinf.transports.shm"):
                pair2.r.on_notice(src, cookie)
            assert pair2.queued == [] and "cookie differs" in caplog.text
        finally:
            pair2.close()
    finally:
        pair.close()


async def test_an_entry_from_a_sender_never_verified_is_a_protocol_error(pair):
    with pytest.raises(ProtocolError):
        pair.r.open("s:0", "S1", wire.PullRef(0, (8,)), [8])
    pair.agree()
    with pytest.raises(ProtocolError):   # another incarnation of it
        pair.r.open("s:0", "S0", wire.PullRef(0, (8,)), [8])


async def test_a_bad_address_fails_that_receive_and_still_frees_the_send(pair):
    pair.agree()
    layout, item, sent = pair.s.offer("r:0", [np.ones(16)], [128])
    got, reading = pair.r.open("s:0", "S1", wire.PullRef(item[0], (8,)), [128])
    with pytest.raises(DecodeError, match="cannot be read"):
        await reading
    pair.deliver()
    assert sent.done() and not pair.s._held


async def test_a_receiver_that_leaves_or_a_close_fails_the_waiting_sends(pair):
    pair.agree()
    _, _, sent = pair.s.offer("r:0", [np.ones(16)], [128])
    pair.s.gone("r:0", "R1")
    with pytest.raises(PeerLostError):
        await sent
    assert not pair.s.agreed("r:0", "R1") and not pair.s._held
    _, _, sent = pair.s.offer("r:0", [np.ones(16)], [128])
    pair.s.close(ClosedError("closed"))
    with pytest.raises(ClosedError):
        await sent
    _, _, sent = pair.s.offer("r:0", [np.ones(16)], [128])
    pair.s.drop(2, None)                 # dropped unsent
    with pytest.raises(ClosedError):
        await sent


async def test_done_from_another_peer_and_malformed_notices(pair):
    pair.agree()
    _, _, sent = pair.s.offer("r:0", [np.ones(16)], [128])
    pair.s.on_notice("x:0", ["done", 0])
    assert not sent.done()
    for bad in ([], "done", ["what"], ["done"], [1, 2]):
        with pytest.raises(ProtocolError):
            pair.s.on_notice("r:0", bad)
    pair.s.on_notice("r:0", ["done", 0])
    assert sent.done()


async def test_a_sender_that_died_fails_the_receive_with_peer_lost(pair):
    pair.agree()
    process = pair.r._sources[("s:0", "S1")]
    process.close()                      # as if the process had exited: its pidfd is gone
    _, _, reading = _send(pair, [np.ones(1 << 18)])
    with pytest.raises(PeerLostError):
        await reading


def test_the_threshold_setting():
    assert pull_threshold({}) == DEFAULT_PULL
    assert pull_threshold({"RLINF_SHM_PULL": "0"}) == 0 == pull_threshold({"RLINF_SHM_PULL": "off"})
    assert pull_threshold({"RLINF_SHM_PULL": "4M"}) == 4 << 20
    with pytest.raises(ValueError):
        pull_threshold({"RLINF_SHM_PULL": "lots"})


@pytest.mark.parametrize("entry", [
    [0, 0, b"", [-8], None, None, None, [0, []]],                  # fewer addresses than pulled buffers
    [0, 0, b"", [-8], None, None, None, [0, [4096, 8192]]],        # more
    [0, 0, b"", [-8], None, None, None, [0, [0]]],                 # a null address
    [0, 0, b"", [-8], None, None, None, [0, [-4096]]],
    [0, 0, b"", [-8], None, None, None, [-1, [4096]]],             # a negative id
    [0, 0, b"", [-8], None, None, None, [0]],
    [0, 0, b"", [-8], None, None, None, "x"],
    [0, 0, b"", [3], None, None, None, [0, []]],                   # nothing to pull
    [0, 0, b"", [-8], ["rlinf-1-x-0-0", 0, 4096, 0, False], None, None, [0, [4096]]],   # and a slot
    [0, 0, b"", [-(wire.MAX_SLOT + 1)], None, None, None, [0, [4096]]],
    [0, 0, b"", [-8, "a"], None, None, None, [0, [4096]]],
])
def test_malformed_pull_descriptors_are_protocol_errors(entry):
    header = wire.pack_header("s:0", "S1", [entry], packed=True)
    with pytest.raises(ProtocolError):
        wire.unpack_header(header, [b"abc"] if 3 in entry[3] else [])


def test_a_pull_descriptor_round_trips():
    header = wire.pack_header("s:0", "S1", [[0, 5, b"h", [-8, 3, 0, -100], None, None, None, [7, [4096, 1 << 47]]]],
                              packed=True)
    _src, _inc, [entry], _packed = wire.unpack_header(header, [b"abc"])
    assert entry.pull == wire.PullRef(7, (4096, 1 << 47)) and entry.slot is None
