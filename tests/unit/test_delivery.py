"""rlinf.core._delivery and the outbox's log: numbering, acknowledgement, resend timing."""

from __future__ import annotations

import asyncio
import itertools

import msgpack

from rlinf.core import _delivery as delivery, wire
from rlinf.core._outbox import OutMessage, Outbox
from rlinf.core.stats import Counters

from ..recording_link import RecordingLink


def _small(i: int, tag: int = 0) -> OutMessage:
    return OutMessage(wire.plain_entry(wire.USER, tag, b"h", None), [bytes([i])], 1, None, False)


def test_a_log_numbers_frame_sets_and_forgets_what_is_acknowledged():
    log = delivery.SendLog()
    log.keep(0, 3, None, b"a", [])
    log.keep(3, 1, None, b"b", [])
    log.keep(4, 2, None, b"c", [])
    assert log.next == 6
    assert log.ack(2) == []                       # a frame set goes only when all of it arrived
    assert [k.seq for k in log.ack(4)] == [0, 3]
    assert log.ack(3) == []                       # acknowledgements only move forward
    assert [k.seq for k in log.ack(6)] == [4] and not log.kept


def test_the_resend_timer_waits_for_silence_and_backs_off():
    log = delivery.SendLog()
    assert not log.due()                          # nothing kept: never due
    log.keep(0, 1, None, b"", [])
    ticks = 0
    while not log.due():
        ticks += 1
    assert ticks * delivery.TICK >= delivery.RTO - delivery.TICK
    again = 0
    while not log.due():
        again += 1
    assert again > ticks                          # doubled
    log.keep(1, 1, None, b"", [])
    log.ack(1)                                    # progress: back to the first timeout
    for _ in range(int(delivery.RTO / delivery.TICK) - 1):
        assert not log.due()


def test_an_inflow_reports_a_restarted_numbering_only_once_it_had_begun():
    inflow = delivery.Inflow("a:0", "i", b"a:0|i")
    assert not inflow.adopt(7)                    # first contact
    inflow.expected = 3
    assert inflow.adopt(8) and inflow.expected == 0 and inflow.epoch == 8


async def test_the_outbox_keeps_until_acknowledged_and_resends_in_order():
    loop = asyncio.get_running_loop()
    link = RecordingLink()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"))
    box.attach(link, None)
    for i in range(3):
        box.put(_small(i), loop)
        box.flush()
    sent = [wire.unpack(f[0], f[1:]) for f in link.sent]
    seqs = [(s[5], len(s[2])) for s in sent]
    assert [s for s, _ in seqs] == [0, 1, 2] and all(s[4] == box.log.epoch for s in sent)
    box.acked(box.log.epoch, 1)
    assert [k.seq for k in box.log.kept] == [1, 2]
    box.acked(box.log.epoch + 1, 3)               # about another log: ignored
    assert len(box.log.kept) == 2
    link.sent.clear()
    box.acked(box.log.epoch, -(1 + 1))            # "I have 0, resend from 1"
    again = [wire.unpack(f[0], f[1:]) for f in link.sent]
    assert [s[5] for s in again] == [1, 2]
    assert [f[1] for f in link.sent] == [b"\x01", b"\x02"]     # the same payloads


async def test_a_failed_outbox_voids_what_it_cannot_send_again():
    loop = asyncio.get_running_loop()
    link = RecordingLink()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"))
    box.attach(link, None)
    future = loop.create_future()
    big = OutMessage(wire.plain_entry(wire.USER, 5, b"h", [1]), [memoryview(bytes(2 << 20))], 2 << 20, future, True)
    box.put(big, loop)
    box.flush()
    box.put(_small(1), loop)
    box.flush()
    box.fail(ConnectionError("gone"))
    assert future.done() and isinstance(future.exception(), ConnectionError)
    void, small = box.log.kept
    assert [(e[wire.KIND], e[wire.TAG]) for e in void.entries] == [(wire.SYSTEM, wire.VOID)] and void.payload == []
    assert small.entries is None and small.payload == [b"\x01"]       # the small copy stays, as it was
    assert msgpack.unpackb(box.log.kept[0].entries[0][wire.CODEC_HEADER]) == [wire.USER, 5]


class _PushesBack(RecordingLink):
    """Refuses frame sets while ``full``; ``wait_writable`` returns once it is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False
        self.writable = asyncio.Event()

    def try_send(self, frames, *, track=False):
        from rlinf.errors import WouldBlock
        if self.full:
            raise WouldBlock()
        super().try_send(frames, track=track)

    async def wait_writable(self) -> None:
        await self.writable.wait()


async def test_a_new_message_never_overtakes_a_resend_that_was_pushed_back():
    """A resend paused by the link's backpressure: a message sent meanwhile (which would
    go out at once, alone, on an idle link) waits behind it, so numbers stay in order."""
    loop = asyncio.get_running_loop()
    link = _PushesBack()
    ticks = itertools.count(0.0, 1.0)
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"), clock=lambda: next(ticks))   # always idle
    box.attach(link, None)
    box.put(_small(0), loop)
    box.put(_small(1), loop)
    box.flush()
    link.full = True
    box.resend()                                   # pushed back at once
    link.full = False
    box.put(_small(2), loop)                       # must not go ahead of the resend
    link.writable.set()
    async with asyncio.timeout(5):
        while len(link.sent) < 5:
            await asyncio.sleep(0)
    seqs = [wire.unpack(f[0], f[1:])[5] for f in link.sent]
    assert seqs == [0, 1, 0, 1, 2], seqs     # sent, sent again, then the new one


# --------------------------------------------------------------------------- overtaking bulk


def test_a_frame_set_overtakes_only_the_bulk_message_it_names():
    """Receiver: frame sets that may skip bulk message 0 (``skip`` = 1) are delivered
    ahead of it, in their order; one that names nothing waits for the gap to close."""
    inflow = delivery.Inflow("a:0", "i", b"a:0|i")
    assert inflow.clear_before(1, 1)             # only message 0 missing: the one it may skip
    inflow.delivered(1, 1)
    assert inflow.expected == 0 and inflow.seen(1) and not inflow.seen(0)
    assert inflow.fields()[1:3] == (0, 2)        # acknowledged apart: 1 arrived ahead of 0
    assert not inflow.clear_before(3, 1)         # message 2 is missing too
    inflow.park(3, ([None], [], True, 1))
    assert inflow.unpark() is None
    assert not inflow.clear_before(2, 2)         # it names another message than the one missing
    assert inflow.clear_before(2, 1)
    inflow.delivered(2, 1)
    assert inflow.unpark()[0] == 3               # now only message 0 is missing before it
    inflow.delivered(3, 1)
    assert not inflow.clear_before(5, 0)         # no skip: waits for message 0 (and 4)
    inflow.delivered(0, 1)                       # the bulk message: the prefix closes over the rest
    assert inflow.expected == 4 and not inflow.ahead and not inflow.skippers
    assert inflow.fields()[1:3] == (4, 0)


def test_a_new_numbering_is_noticed_when_only_messages_delivered_ahead_arrived():
    """Review finding: message 0 (bulk) never came, 1 was delivered ahead; a new epoch
    must report the old log as begun (messages may be missing)."""
    inflow = delivery.Inflow("a:0", "i", b"a:0|i")
    inflow.adopt(7)
    inflow.delivered(1, 1)
    assert inflow.adopt(8)


def test_the_sender_frees_what_arrived_ahead_and_never_sends_it_again():
    log = delivery.SendLog()
    for seq in range(4):
        log.keep(seq, 1, None, b"", [b"x"], credit=(1, 1, 0))
    assert [k.seq for k in log.ack_ahead(0, 3)] == [2, 1]     # 1 and 2 arrived ahead of 0
    assert log.ack_ahead(0, 3) == []                          # told once
    assert [log.arrived(k) for k in log.kept] == [False, True, True, False]
    assert [k.seq for k in log.ack(3)] == [0, 1, 2] and log.ahead == 0


class _BulkLink:
    """A bulk stream whose one send finishes when the test says so."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.sent: list[bytes] = []

    async def send(self, header: bytes, frames: list) -> None:
        self.sent.append(header)
        await self.done.wait()

    def close(self) -> None:
        pass


async def test_messages_with_other_tags_overtake_a_bulk_message_on_its_way():
    """Sender: while a bulk message (tag 0) is on its way, user messages with other tags
    go at once, naming the bulk message they may overtake, also past one with tag 0,
    which waits until the bulk stream has delivered."""
    from rlinf.core.routing import BULK

    loop = asyncio.get_running_loop()
    link, bulk = RecordingLink(), _BulkLink()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"))

    async def dial():
        return bulk
    box.bulk = dial
    box.attach(link, None)
    big = OutMessage(wire.plain_entry(wire.USER, 0, b"h", [1]), [memoryview(bytes(2 << 20))], 2 << 20,
                     loop.create_future(), True, transport=BULK)
    box.put(big, loop)
    box.flush()
    async with asyncio.timeout(5):
        while not bulk.sent:
            await asyncio.sleep(0)
    box.put(_small(1, tag=1), loop)                           # another tag: goes
    box.put(_small(2), loop)                                  # tag 0: waits
    box.put(_small(3, tag=2), loop)                           # passes it
    box.put(_small(4), loop)                                  # tag 0: behind the other one
    box.flush()
    got = [wire.unpack(f[0], f[1:]) for f in link.sent]
    assert [(g[6], [e.tag for e in g[2]]) for g in got] in ([(1, [1]), (1, [2])], [(1, [1, 2])])   # may skip 0
    assert got[0][5] == 1
    sent = len(link.sent)
    bulk.done.set()
    async with asyncio.timeout(5):
        while len(link.sent) == sent:
            await asyncio.sleep(0)
    got = [wire.unpack(f[0], f[1:]) for f in link.sent[sent:]]
    assert [(g[5], g[6], [e.tag for e in g[2]]) for g in got] == [(3, 0, [0, 0])]   # then in their order
    assert big.future.done()


async def test_while_the_bulk_stream_is_dialled_other_tags_go_first():
    """A bulk message waits for its stream to be dialled: a message with another tag goes
    ahead of it (it takes the lower number: nothing to skip); one with its tag waits. If
    the stream cannot be opened, the bulk message goes through ZeroMQ, still before the
    message with its tag."""
    from rlinf.core.routing import BULK
    from rlinf.errors import TransportUnavailableError

    loop = asyncio.get_running_loop()
    link, dialled = RecordingLink(), asyncio.Event()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"))

    async def dial():
        await dialled.wait()
        raise TransportUnavailableError("no bulk listener")
    box.bulk = dial
    box.attach(link, None)
    big = OutMessage(wire.plain_entry(wire.USER, 0, b"h", [1]), [memoryview(bytes(2 << 20))], 2 << 20,
                     loop.create_future(), True, transport=BULK)
    box.put(big, loop)
    box.put(_small(1), loop)                                  # its tag: waits
    box.put(_small(2, tag=1), loop)                           # another tag: goes now
    box.flush()
    got = [wire.unpack(f[0], f[1:]) for f in link.sent]
    assert [(g[5], g[6], [e.tag for e in g[2]]) for g in got] == [(0, 0, [1])]
    dialled.set()
    async with asyncio.timeout(5):
        while len(link.sent) < 3:
            await asyncio.sleep(0)
    got = [wire.unpack(f[0], f[1:]) for f in link.sent[1:]]
    assert [(g[5], [e.tag for e in g[2]]) for g in got] == [(1, [0]), (2, [0])]   # the bulk one, then its tag
    assert bytes(link.sent[2][1]) == b"\x01"
