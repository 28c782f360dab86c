"""The pull protocol (rlinf/transports/shm/_pull.py) between two sessions of this process,
wired by their notices: the handshake, reads, completions, refusals and failures."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest

from rlinf.core import wire
from rlinf.transports import descriptors
from rlinf.util.copier import Copier
from rlinf.errors import ClosedError, DecodeError, PeerLostError, ProtocolError
from rlinf.transports import cma
from rlinf.config import Settings
from rlinf.transports.shm._pull import DEFAULT_PULL, PullSession
from rlinf.transports.shm._pool import Recycler

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


def _offer(pair: Pair, buffers: list) -> tuple[wire.Entry, asyncio.Future]:
    """Offer ``buffers`` from s to r: (the entry as r parses it, the send's future); the
    entry counts as sent."""
    sizes = [memoryview(b).nbytes for b in buffers]
    layout, item, sending, sent = pair.s.offer("r:0", "R1", buffers, sizes)
    sent.set_result(None)
    entry, _ = wire._unpack_entry([0, 0, b"", layout, None, None, None, item], 1 << 22, 0)   # packed
    return entry, sending


def _open(pair: Pair, entry: wire.Entry) -> tuple[list, asyncio.Future]:
    return pair.r.open("s:0", "S1", entry.pull, [-c for c in entry.frame_counts if c < 0])


def _send(pair: Pair, buffers: list) -> tuple[asyncio.Future, list, asyncio.Future]:
    """Offer ``buffers`` from s to r and let r open the entry: ``(send future, r's
    buffers, r's read future)``."""
    entry, sending = _offer(pair, buffers)
    got, reading = _open(pair, entry)
    return sending, got, reading


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


async def test_an_entry_that_cannot_be_read_is_refused_and_its_sender_told(pair):
    with pytest.raises(ProtocolError):
        pair.r.open("s:0", "S1", descriptors.PullRef(0, (8,), 8, 1), [8])
    assert pair.deliver() == ["done"]                        # each refusal tells the sender
    pair.agree()
    with pytest.raises(ProtocolError):   # another incarnation of it
        pair.r.open("s:0", "S0", descriptors.PullRef(0, (8,), 8, 1), [8])
    entry, sending = _offer(pair, [np.ones(16)])

    def no_memory(n):
        raise MemoryError(f"{n} bytes")

    pair.r._recycler.take = no_memory      # more than this process can allocate
    with pytest.raises(ProtocolError, match="cannot hold"):
        pair.r.open("s:0", "S1", entry.pull, [descriptors.MAX_SLOT])
    assert pair.deliver() == ["done", "done"]
    assert sending.done() and not pair.s._held                # its hold is over


async def test_a_bad_address_fails_that_receive_and_still_frees_the_send(pair):
    pair.agree()
    entry, sending = _offer(pair, [np.ones(16)])
    ref = entry.pull
    got, reading = pair.r.open("s:0", "S1", descriptors.PullRef(ref.pull_id, (8,), ref.token_address, ref.token), [128])
    with pytest.raises(DecodeError, match="cannot be read"):
        await reading
    pair.deliver()
    assert sending.done() and not pair.s._held


@pytest.mark.parametrize("how", ["cancel", "drop"])
async def test_a_hold_given_up_before_the_read_makes_that_receive_fail(pair, how):
    """The sender's send timed out (its future cancelled) or failed: the buffers are the
    caller's again, so a read that happens later must not deliver what it read."""
    pair.agree()
    data = np.full(1 << 16, 7, np.uint8)
    entry, sending = _offer(pair, [data])
    if how == "cancel":
        assert sending.cancel() and sending.cancelled()   # revoked before cancel() returns
    else:
        pair.s.drop(entry.pull.pull_id, PeerLostError("lost", peer="r:0"))
    assert not pair.s._held
    data[:] = 9                              # the caller reuses its buffer
    _got, reading = _open(pair, entry)
    with pytest.raises(DecodeError, match="withdrew"):
        await reading


async def test_a_hold_given_up_before_its_entry_left_drops_the_entry(pair):
    pair.agree()
    layout, item, sending, sent = pair.s.offer("r:0", "R1", [np.ones(16)], [128])
    sending.cancel()
    assert sent.cancelled()                  # the outbox drops a queued entry whose future is cancelled
    layout, item, sending, sent = pair.s.offer("r:0", "R1", [np.ones(16)], [128])
    sent.set_exception(PeerLostError("lost", peer="r:0"))      # the outbox could not send it
    with pytest.raises(PeerLostError):
        await sending
    assert not pair.s._held


async def test_close_waits_for_reads_then_revokes(pair):
    pair.agree()
    _entry, sending = _offer(pair, [np.ones(16)])
    async with asyncio.timeout(5):
        await pair.s.drain(0.01)             # nobody reads: gives up after its timeout
    waiting = asyncio.ensure_future(pair.s.drain(5))
    await asyncio.sleep(0)
    assert not waiting.done()
    pair.s.on_notice("r:0", ["done", _entry.pull.pull_id])
    async with asyncio.timeout(5):
        await waiting
    assert sending.result() is None


async def test_a_receiver_that_leaves_or_a_close_fails_the_waiting_sends(pair):
    pair.agree()
    _, sending = _offer(pair, [np.ones(16)])
    pair.s.peer("r:0", "R0").close()             # an older incarnation: not what holds this one
    assert not sending.done()
    pair.s.peer("r:0", "R1").close()
    with pytest.raises(PeerLostError):
        await sending
    assert not pair.s.agreed("r:0", "R1") and not pair.s._held
    _, sending = _offer(pair, [np.ones(16)])
    pair.s.drop(1, None)                 # dropped unsent
    with pytest.raises(ClosedError):
        await sending
    _, sending = _offer(pair, [np.ones(16)])
    pair.s.close(ClosedError("closed"))
    with pytest.raises(ClosedError):
        await sending


async def test_done_from_another_peer_and_malformed_notices(pair):
    pair.agree()
    _, sending = _offer(pair, [np.ones(16)])
    pair.s.on_notice("x:0", ["done", 0])
    assert not sending.done()
    for bad in ([], "done", ["what"], ["done"], [1, 2], ["done", "0"]):
        with pytest.raises(ProtocolError):
            pair.s.on_notice("r:0", bad)
    pair.s.on_notice("r:0", ["done", 0])
    assert sending.done()
    pair.s.on_notice("x:0", ["ok", "X1"])      # x never got our cookie
    assert not pair.s.agreed("x:0", "X1")
    pair.r.peer("s:0", "S1").asked = True
    for cookie in ([None, 4096, bytes(16)], [1, 4096, b""], [1, 0, bytes(16)], [1, 4096, "x" * 16]):
        with pytest.raises(ProtocolError):
            pair.r.on_notice("s:0", ["cookie", "S1", *cookie])


async def test_a_sender_that_died_fails_the_receive_with_peer_lost(pair):
    pair.agree()
    process = pair.r.peers[("s:0", "S1")].source
    process.close()                      # as if the process had exited: its pidfd is gone
    _, _, reading = _send(pair, [np.ones(1 << 18)])
    with pytest.raises(PeerLostError):
        await reading


def test_the_threshold_setting():
    def pull_threshold(env: dict[str, str]) -> int:    # what the communicator passes as threshold=
        return Settings.from_env(env).shm_pull

    assert pull_threshold({}) == DEFAULT_PULL
    assert pull_threshold({"RLINF_SHM_PULL": "0"}) == 0 == pull_threshold({"RLINF_SHM_PULL": "off"})
    assert pull_threshold({"RLINF_SHM_PULL": "4M"}) == 4 << 20
    with pytest.raises(ValueError, match="RLINF_SHM_PULL='lots'"):
        pull_threshold({"RLINF_SHM_PULL": "lots"})


@pytest.mark.parametrize("entry", [
    [0, 0, b"", [-8], None, None, None, [0, [], 64, 1]],            # fewer addresses than pulled buffers
    [0, 0, b"", [-8], None, None, None, [0, [4096, 8192], 64, 1]],  # more
    [0, 0, b"", [-8], None, None, None, [0, [0], 64, 1]],           # a null address
    [0, 0, b"", [-8], None, None, None, [0, [-4096], 64, 1]],
    [0, 0, b"", [-8], None, None, None, [-1, [4096], 64, 1]],       # a negative id
    [0, 0, b"", [-8], None, None, None, [0, [4096], 0, 1]],         # no token address
    [0, 0, b"", [-8], None, None, None, [0, [4096], 64, 0]],        # a null token
    [0, 0, b"", [-8], None, None, None, [0, [4096]]],
    [0, 0, b"", [-8], None, None, None, "x"],
    [0, 0, b"", [3], None, None, None, [0, [], 64, 1]],             # nothing to pull
    [0, 0, b"", [-8], ["rlinf-1-x-0-0", 0, 4096, 0, False], None, None, [0, [4096], 64, 1]],   # and a slot
    [0, 0, b"", [-(descriptors.MAX_SLOT + 1)], None, None, None, [0, [4096], 64, 1]],
    [0, 0, b"", [-8, "a"], None, None, None, [0, [4096], 64, 1]],
])
def test_malformed_pull_descriptors_are_protocol_errors(entry):
    header = wire.pack_header("s:0", "S1", [entry], packed=True)
    with pytest.raises(ProtocolError):
        wire.unpack_header(header, [b"abc"] if 3 in entry[3] else [])


def test_a_pull_descriptor_round_trips():
    header = wire.pack_header("s:0", "S1", [[0, 5, b"h", [-8, 3, 0, -100], None, None, None,
                                             [7, [4096, 1 << 47], 8192, 5]]], packed=True)
    _src, _inc, [entry], _packed = wire.unpack_header(header, [b"abc"])
    assert entry.pull == descriptors.PullRef(7, (4096, 1 << 47), 8192, 5) and entry.slot is None


async def test_the_collectives_abort_check_leaves_pulled_data_queued_in_order():
    """Aborts are small, never pulled: a pulled message (still being read) is data, and
    the abort check must neither decode it half-read nor lose it."""
    import types

    from rlinf.core._mailbox import Mailbox, Message
    from rlinf.core._receive import ReceivePath
    from rlinf.util.bounded import Recent

    mailbox = Mailbox()
    reading = asyncio.get_running_loop().create_future()
    pulled = [Message("a:0", "A1", "t", b"", [], pulling=reading) for _ in range(2)]
    for msg in pulled:
        mailbox.deliver(msg)

    class Codec:
        def decode(self, header, buffers):
            raise AssertionError("a pulled message was decoded")

    receive = ReceivePath("me:0", Codec(), mailbox, None, Recent(), True, types.SimpleNamespace(valid=set()),
                          guard=lambda: None, on_bye=lambda src, incarnation: None)
    receive.take_queued("t", lambda obj, src: None)
    assert [mailbox.get_nowait("a:0", "t"), mailbox.get_nowait("a:0", "t")] == pulled
    reading.cancel()


async def test_cancelling_the_work_of_a_pulled_send_revokes_before_it_returns(pair):
    from rlinf.core.work import Work

    pair.agree()
    data = np.full(1 << 16, 7, np.uint8)
    entry, sending = _offer(pair, [data])
    assert Work(sending, "send").cancel()
    data[:] = 9                              # at once: no loop turn in between
    _got, reading = _open(pair, entry)
    with pytest.raises(DecodeError, match="withdrew"):
        await reading


async def test_a_late_goodbye_of_an_old_incarnation_keeps_the_new_ones_agreement(pair):
    pair.s.on_notice("r:0", ["ask", "R2"])            # r restarted and asks again
    pair.s.peer("r:0", "R1").close()                          # the old one's loss is reported late
    pair.s.on_notice("r:0", ["ok", "R2"])
    assert pair.s.agreed("r:0", "R2")
    pair.s.on_notice("x:0", ["ask", "X1"])
    pair.s.on_notice("x:0", ["ok", "X0"])             # not the incarnation that asked
    assert not pair.s.agreed("x:0", "X0")


async def test_a_late_ask_of_an_old_incarnation_keeps_the_new_ones_agreement(pair):
    """An old incarnation still running a moment asks after the new one agreed: the
    cookie goes to the address, the new one confirms, and it stays agreed; an agreement
    of the new incarnation ends the old one's."""
    pair.agree()                                          # r:0 as R1
    pair.s.on_notice("r:0", ["ask", "R0"])                # an earlier incarnation, late
    pair.deliver()
    assert pair.s.agreed("r:0", "R1") and not pair.s.agreed("r:0", "R0")
    pair.s.on_notice("r:0", ["ask", "R2"])                # a later one asks and agrees
    pair.s.on_notice("r:0", ["ok", "R2"])
    assert pair.s.agreed("r:0", "R2") and not pair.s.agreed("r:0", "R1")


async def test_an_outbox_that_refuses_the_entry_leaves_no_hold(pair):
    import types

    from rlinf.core._send import SendPath

    pair.agree()

    class Refusing:
        address, error = "r:0", None
        info = types.SimpleNamespace(incarnation="R1")

        def put(self, msg, loop, hold=False, gated=False):
            raise PeerLostError("r:0 was lost", peer="r:0")

    me = types.SimpleNamespace(_pull=pair.s, _loop=asyncio.get_running_loop())
    with pytest.raises(PeerLostError):
        SendPath._queue_pull(me, Refusing(), 0, b"", [np.ones(16)], [128], 128)
    assert not pair.s._held
