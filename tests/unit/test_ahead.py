"""Items sent ahead to a consumer at prefetch=0 under a batch policy (rlinf.channel._ahead):
crafted sequences on the core with a fake clock."""

from __future__ import annotations

import pytest

from rlinf.channel import _ahead
from rlinf.channel._ahead import AHEAD_LEAD, AHEAD_SPAN, RECALL_GRACE

from .test_channel_unit import Harness


def _harness(speeds: dict[str, float], policy="performance_aware", **options) -> Harness:
    t = Harness(policy=policy, **options)
    for name, speed in (("p:0", None), *speeds.items()):
        t.core.handle_ops(name, 1, [("hello", 1, "inc-" + name, "node", name, speed)])
        t.drain(name)
    return t


def _ahead_ids(t: Harness, src: str) -> list[list[int]]:
    """Ids of the groups sent ahead to ``src`` (drains what it was sent)."""
    return [[i[0] for i in op[2]] for op in t.drain(src) if op[0] == "ahead"]


def _push_due(t: Harness) -> float:
    """When the items last scheduled to go ahead are due."""
    return max((entry for entry in t.core.timers if entry[2] == "push"), key=lambda e: e[1])[0]


def _run_until(t: Harness, when: float) -> None:
    t.now = when
    _ahead.run_due(t.core)


def test_the_next_item_goes_ahead_just_before_the_current_one_ends():
    t = _harness({"a:0": 1.0})
    t.get("a:0")
    t.put("p:0", 2, 1, 1)                 # placed for a (its declared speed): it is sent item 1
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    start = t.now
    assert _push_due(t) == pytest.approx(start + 2.0 - AHEAD_LEAD)      # weight 2 at speed 1
    _run_until(t, start + 2.0 - AHEAD_LEAD - 0.01)
    assert _ahead_ids(t, "a:0") == []     # not yet: committed only just before it is needed
    _run_until(t, start + 2.0 - AHEAD_LEAD)
    assert _ahead_ids(t, "a:0") == [[2]]  # one item: it alone takes longer than AHEAD_SPAN
    # its get (sent before item 2 arrived) is answered by item 2: nothing more is sent, it waits not
    t.now = start + 2.0
    t.ops("a:0", ("done", [1], 2.0), ("get", 900, None, 1, None, None))
    assert t.items("a:0") == [] and not t.core.handles[("a:0", 1)].requests.get(None)
    assert _push_due(t) == pytest.approx(t.now + 1.0 - AHEAD_LEAD)    # item 3: at item 2's expected end
    t.took("a:0", [2])
    assert t.core.handles[("a:0", 1)].pending_count == 2      # items 2 (working) and 3


def test_short_items_go_ahead_in_groups_that_cover_the_span_in_put_order():
    speed = 1000.0                        # 1 ms per item of weight 1
    t = _harness({"a:0": speed})
    t.get("a:0")
    t.put("p:0", *[1] * 100)
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    _run_until(t, t.now + 1.0)
    [group] = _ahead_ids(t, "a:0")
    assert group == list(range(2, 2 + len(group))) and 1 < len(group) <= round(AHEAD_SPAN * speed)
    _run_until(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == []     # one group at a time: the next once it took them all
    t.took("a:0", group[:-1])
    _run_until(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == []
    t.took("a:0", group[-1:])
    _run_until(t, t.now + 1.0)
    [following] = _ahead_ids(t, "a:0")
    assert following[0] == group[-1] + 1


def _first_group(n: int) -> tuple[Harness, list[int]]:
    """a (1 ms per item) took item 1 of ``n``: the ids of the group then sent ahead."""
    t = _harness({"a:0": 1000.0})
    t.get("a:0")
    t.put("p:0", *[1] * n)
    t.items("a:0")
    t.took("a:0", [1])
    _run_until(t, t.now + 1.0)
    [group] = _ahead_ids(t, "a:0")
    return t, group


def test_gets_received_while_items_are_ahead_are_answered_by_them_one_each():
    t, group = _first_group(100)
    assert len(group) >= 3
    for _ in range(2):                    # two gets that crossed the group on the way
        t.get("a:0")
    h = t.core.handles[("a:0", 1)]
    assert t.items("a:0") == [] and not h.requests.get(None) and h.ahead.ids[None] == group[2:]
    t.took("a:0", group)                  # (the rest were taken from its buffer: no get sent)
    t.get("a:0")                          # a get with nothing ahead: answered as usual
    assert t.items("a:0") == [[group[-1] + 1]]


def test_a_round_trip_measured_on_answered_gets_moves_the_next_send_earlier():
    t = _harness({"a:0": 1.0})
    t.get("a:0")
    t.put("p:0", *[1] * 6)
    t.items("a:0")
    t.now += 1.0 + 0.1                    # worked 1 s, its get arrives 0.1 s later: round trip 0.1
    t.ops("a:0", ("took", [1], False), ("done", [1], 1.0), ("get", 900, None, 1, None, None))
    assert t.items("a:0") == [[2]]
    assert t.core.handles[("a:0", 1)].ahead.gap == pytest.approx(0.1)
    t.took("a:0", [2])
    _run_until(t, t.now + 1.0 - AHEAD_LEAD)
    assert _ahead_ids(t, "a:0") == [[3]]
    t.now += 0.5
    t.took("a:0", [3])                    # it started item 3 a round trip before this report
    assert _push_due(t) == pytest.approx(t.now - 0.1 + 1.0 - AHEAD_LEAD)


@pytest.mark.parametrize("case", ["fifo", "prefetch", "idle", "unmeasured"])
def test_nothing_goes_ahead_where_it_is_off(case):
    """Not under fifo (consumers compete for items only when idle), not to a consumer that
    prefetches (it asks ahead itself), not to one that is not at work and asks nothing,
    not before a speed is known (nothing is placed for it yet)."""
    speeds = {"a:0": None if case == "unmeasured" else 1.0, "b:0": None if case == "unmeasured" else 1.0}
    t = _harness(speeds, policy="fifo" if case == "fifo" else "performance_aware")
    if case == "prefetch":
        t.ops("a:0", ("credit", None, 1, None))
    else:
        t.get("a:0")
    t.put("p:0", *[1] * 6)
    t.items("a:0")
    if case == "idle":                    # took it with ack and finished it: at work no more
        t.ops("a:0", ("took", [1], True), ("done", [1], 1.0))
    else:
        t.took("a:0", [1])
    for _ in range(3):
        _run_until(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == []


def _a_with_item_3_ahead(**options) -> Harness:
    """a and b (speed 1) working on items 1 and 2 since ``t.now - 1``; item 3 (placed for
    a) was sent ahead to a."""
    t = _harness({"a:0": 1.0, "b:0": 1.0}, **options)
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", 1, 1, 1)                 # LPT: a gets 1 and 3, b gets 2
    assert t.items("a:0") == [[1]] and t.items("b:0") == [[2]]
    t.took("a:0", [1])
    t.took("b:0", [2])
    _run_until(t, t.now + 1.0 - AHEAD_LEAD)
    assert _ahead_ids(t, "a:0") == [[3]]
    t.now += AHEAD_LEAD
    return t


def _recalls(t: Harness) -> list[tuple]:
    return [op for op in t.drain("a:0") if op[0] == "recall"]


def test_items_ahead_of_a_consumer_that_is_late_are_recalled_for_one_that_waits():
    t = _a_with_item_3_ahead()
    t.ops("b:0", ("done", [2], 1.0), ("get", 901, None, 1, None, None))      # b waits, with nothing
    assert t.items("b:0") == [] and _recalls(t) == []
    _run_until(t, t.now + max(RECALL_GRACE, 1.0))      # a is still on item 1 past its deadline
    assert _recalls(t) == [("recall", None, [3])]
    t.ops("a:0", ("unget", [3]))         # it had not taken it: it comes back and goes to b
    assert t.items("b:0") == [[3]]
    assert not t.core.handles[("a:0", 1)].ahead.ids


def test_nothing_is_recalled_without_stealing():
    """Recalling is stealing (the item may go to a consumer that got newer ones): off
    with stealing, when an item placed for a consumer stays its own anyway."""
    t = _a_with_item_3_ahead(work_stealing=False)
    t.ops("b:0", ("done", [2], 1.0), ("get", 901, None, 1, None, None))
    _run_until(t, t.now + 10.0)
    assert _recalls(t) == [] and t.items("b:0") == []


def test_a_consumer_that_leaves_gives_back_what_was_sent_ahead():
    t = _a_with_item_3_ahead()
    t.ops("a:0", ("bye",))
    t.ops("b:0", ("done", [2], 1.0), ("get", 901, None, 1, None, None))
    assert t.items("b:0") == [[3]]


def _run_all(t: Harness, until: float) -> None:
    """What the server's timer does: run the due timers, each at its time, up to ``until``."""
    while t.core.timers and t.core.timers[0][0] <= until:
        _run_until(t, max(t.now, t.core.timers[0][0]))
    t.now = until


def test_an_item_ahead_overdue_while_none_waited_is_recalled_once_one_waits():
    """b stops asking with item 3 ahead; its recall deadline passes while a is still busy
    (no one waits then, no timer is left): a's get later must still bring item 3 back."""
    t = _harness({"a:0": 1.0, "b:0": 1.0})
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", 10, 1, 1)               # LPT: a gets the 10, b gets 1 and 1
    assert t.items("a:0") == [[1]] and t.items("b:0") == [[2]]
    t.took("a:0", [1])
    t.took("b:0", [2])
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "b:0") == [[3]]
    _run_all(t, t.now + 9.0)
    assert not t.core.timers
    t.ops("a:0", ("done", [1], 10.0))
    t.get("a:0")
    assert [op for op in t.drain("b:0") if op[0] == "recall"] == [("recall", None, [3])]
    t.ops("b:0", ("unget", [3]))
    assert t.items("a:0") == [[3]]
    assert not t.core.recalls             # nothing more is due to be recalled


def test_cheap_items_go_ahead_at_most_max_items_at_once():
    t = _harness({"a:0": 1.0})
    t.get("a:0")
    t.put("p:0", 1, *[0] * 500)           # weight 0: no time at all by its speed
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == [list(range(2, 2 + _ahead.AHEAD_MAX_ITEMS))]


def test_large_items_go_ahead_within_max_bytes_past_the_first():
    t = _harness({"a:0": 1000.0})
    t.get("a:0")
    size = _ahead.AHEAD_MAX_BYTES // 3 + 1            # three do not fit, two do
    t.ops("p:0", *[("put", None, 1.0, size, b"x") for _ in range(10)])
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == [[2, 3]]


def test_nothing_goes_ahead_under_a_staleness_bound():
    """An item ahead would escape the floor that advance() raises (it would be handed out
    stale): with max_staleness, gets are answered as they come."""
    t = _harness({"a:0": 1.0}, max_staleness=0)
    t.get("a:0")
    t.ops("p:0", *[("put", None, 1.0, 0, b"x", 0, 0) for _ in range(4)])
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    for _ in range(3):
        _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == [] and not t.core.timers


def test_a_top_up_get_is_answered_at_once_with_what_there_is_maybe_nothing():
    """The rest of a get_batch that took every item sent ahead: it must not wait."""
    t, group = _first_group(12)
    t.took("a:0", group)
    t.ops("a:0", ("get", 900, None, 100, None, None, True))
    [answer] = [op for op in t.drain("a:0") if op[0] == "items"]
    assert answer[1] == 900 and [i[0] for i in answer[3]] == list(range(group[-1] + 1, 13))
    t.ops("a:0", ("get", 901, None, 100, None, None, True))
    assert [op for op in t.drain("a:0") if op[0] == "items"] == [("items", 901, None, [])]
    assert not t.core.handles[("a:0", 1)].requests.get(None)     # nothing left waiting


def test_sending_ahead_frees_queue_space_for_a_producer_held_by_maxsize():
    t = _harness({"a:0": 1000.0}, maxsize=4)
    t.get("a:0")
    for _ in range(10):                   # put while space is granted (item 1 goes to a at once)
        t.put("p:0", 1)
        t.ops("p:0", ("want", 1, False))
        if ("grant", 1) not in t.drain("p:0"):
            break
    assert t.core._free() == 0            # full: the producer waits for space
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0")
    assert ("grant", 1) in t.drain("p:0")      # at once, not at the next message the channel gets


def test_large_items_sent_ahead_travel_out_of_band():
    """The server marks a message with large items ahead as large; the wire moves their
    arrays out of band and gives them back on the other side."""
    import numpy as np

    from rlinf.channel._wire import decode_ops, encode_ops
    from rlinf.channel.server import ChannelServer

    big = np.arange(10, dtype=np.uint8)
    op = ("ahead", ("k", 1), [(1, 1.0, (2, b"h", [big])), (2, 1.0, (1, [3], b"abc"))])
    server = ChannelServer("c", manager="tcp://127.0.0.1:1", token="t")
    server._flush_scheduled = True        # (no loop here: nothing is scheduled)
    server._send(_FakeHandle("a:0", 1), op)
    [(ops, large)] = server._out.values()
    assert ops == [op] and large
    blob, buffers = encode_ops(ops, large)
    assert buffers == [big]
    [back] = decode_ops([blob, buffers])
    assert back[1] == ("k", 1) and back[2][0][2][2][0] is big and back[2][1][2] == (1, (3,), b"abc")


def test_a_top_up_get_is_never_answered_by_the_items_ahead():
    """The client sends a top-up before its "took" of the items ahead it took (that leaves
    with the top-up's answer): the channel answers with the items after them, and counts
    them as ahead until that "took" (a top-up given up loses none of them)."""
    t, group = _first_group(12)
    t.ops("a:0", ("get", 900, None, 100, None, None, True))
    [answer] = [op for op in t.drain("a:0") if op[0] == "items"]
    assert answer[1] == 900 and [i[0] for i in answer[3]] == list(range(group[-1] + 1, 13))
    h = t.core.handles[("a:0", 1)]
    assert h.ahead.ids[None] == group
    t.ops("a:0", ("cancel", 900), ("unget", answer_ids := [i[0] for i in answer[3]]))   # given up
    t.ops("a:0", ("unget", group))        # and detached: every item is back, none retired
    assert sorted(it.id for it in t.core.handles[("a:0", 1)].assigned[None]) == [*group, *answer_ids]


def test_a_get_that_crosses_a_group_takes_as_many_as_its_batch_rule_allows():
    """A get_batch received while items are ahead is answered by as many of them as the
    get_batch rule takes (the client gives it the same), not one."""
    t, group = _first_group(100)
    assert len(group) >= 4
    h = t.core.handles[("a:0", 1)]
    t.get("a:0", max_items=2)
    assert h.ahead.ids[None] == group[2:]
    t.get("a:0", max_items=None)          # every item there: the rest of the group
    assert t.items("a:0") == [] and not h.ahead.ids and not h.requests.get(None)
    assert _ahead.batch_len([1.0, 1.0, 5.0, 1.0], None, 3.0) == 2
    assert _ahead.batch_len([5.0, 1.0], 3, 3.0) == 1 and _ahead.batch_len([1.0] * 9, 3, None) == 3


def test_no_group_goes_ahead_while_an_answer_is_not_reported_taken():
    """The get that an answer was for may have been given up: the answer then comes back
    (unget) after a group sent ahead meanwhile, which the consumer would take first. So
    the next group waits for the answer's "took", or goes out with it if it came back."""
    t = _harness({"a:0": 1000.0})
    t.get("a:0")
    t.put("p:0", *[1] * 100)
    assert t.items("a:0") == [[1]]
    t.took("a:0", [1])
    t.get("a:0")
    assert t.items("a:0") == [[2]]
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == []     # item 2 not reported taken yet
    t.ops("a:0", ("cancel", t.rid), ("unget", [2]))     # its get was given up
    _run_all(t, t.now + 1.0)
    [group] = _ahead_ids(t, "a:0")
    assert group[0] == 2 and group == list(range(2, 2 + len(group)))
    t.took("a:0", group)
    t.get("a:0")
    [[answer]] = t.items("a:0")
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0") == []     # held again
    t.took("a:0", [answer])               # taken: the next group goes
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "a:0")[0][0] == answer + 1


def test_an_item_ahead_of_a_consumer_back_from_lost_is_recalled_when_another_waits():
    """b is taken for lost with item 3 ahead, and its recall deadline passes while it is
    away (its item stays its own then); back, it stops calling get: a, waiting, gets it."""
    from rlinf.channel import _lost

    t = _harness({"a:0": 1.0, "b:0": 1.0})
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", 10, 1, 1)
    t.took("a:0", [1])
    t.took("b:0", [2])
    _run_all(t, t.now + 1.0)
    assert _ahead_ids(t, "b:0") == [[3]]
    t.drain("a:0")
    _lost.suspend(t.core, "b:0", "")
    t.ops("a:0", ("done", [1], 10.0))
    t.get("a:0")
    _run_all(t, t.now + 9.0)
    assert [op for op in t.drain("b:0") if op[0] == "recall"] == []    # away: not recalled
    t.ops("b:0", ("done", [2], 1.0))      # back
    assert not t.core.handles[("b:0", 1)].lost
    assert [op for op in t.drain("b:0") if op[0] == "recall"] == [("recall", None, [3])]
    t.ops("b:0", ("unget", [3]))
    assert t.items("a:0") == [[3]]


class _Done:
    @staticmethod
    def done() -> bool:
        return True


class _FakeHandle:
    def __init__(self, src: str, hid: int) -> None:
        self.src, self.hid = src, hid


def test_ops_that_cannot_be_encoded_for_one_handle_do_not_stop_the_others():
    from rlinf.channel.server import ChannelServer

    sent = []

    class _Internal:
        @staticmethod
        def start_send(message, dst, tag):
            sent.append(dst)
            return _Done()

    class _Comm:
        internal = _Internal()

    server = ChannelServer("c", manager="tcp://127.0.0.1:1", token="t")
    server.comm = _Comm()
    server._out = {("bad:0", 1): [[("items", 1, object(), [])], False], ("good:0", 1): [[("end", 1, None)], False]}
    server._flush()
    assert sent == ["good:0"] and server._out == {}


async def test_a_get_given_up_as_items_sent_ahead_answer_it_keeps_them_in_order():
    """A get that times out (or is cancelled) just as a group sent ahead answers it: its
    item goes back before the rest of the group, here, not to the channel (after them)."""
    import asyncio

    from rlinf.channel import Channel
    from rlinf.channel._payload import pack

    from .test_channel_unit import _CommBeforeOpen

    ch = Channel(_CommBeforeOpen(), "c")
    ch._loop = asyncio.get_running_loop()
    ch._flush_scheduled = True            # (the ops stay here to be looked at)
    rid, future = ch._start_get(None, 1, None)
    ch._on_ops([("ahead", None, [(i, 1.0, pack(ch._codec, f"item{i}")[0]) for i in (1, 2, 3)])])
    assert future.done()
    ch._abandon(rid, future)
    assert [i[0] for i in ch._buffers[None]] == [1, 2, 3]
    assert not [op for op in ch._ops if op[0] == "unget"]
    assert [ch.get_nowait() for _ in range(3)] == ["item1", "item2", "item3"]


async def test_a_batch_topped_up_and_given_up_keeps_the_items_sent_ahead():
    """get_batch took both items sent ahead and asks the channel for more; cancelled before
    the answer, those two stay here, in order, for the next get."""
    import asyncio

    ch, batch = await _topping_up()
    [get] = [op for op in ch._ops if op[0] == "get"]
    # the top-up, and no "took" of 1, 2 before its answer: given up now, the channel
    # must still count them as ahead here (taken later, recalled, or given back on detach)
    assert get[3] == 8 and get[6] is True and not ch._acc_took
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert not ch._acc_took and ("cancel", get[1]) in ch._ops
    assert [ch.get_nowait() for _ in range(2)] == ["item1", "item2"]
    assert ch._acc_took == {False: [1, 2]}


async def test_a_batch_with_items_ahead_here_and_no_time_to_top_up_returns_them():
    """get_batch(timeout=0) with items sent ahead buffered: those, not CommTimeoutError;
    the top-up is withdrawn (what it may bring goes back)."""
    import asyncio

    ch = _client()
    ch._on_ops([("ahead", None, [(i, 1.0, _packed(ch, i)) for i in (1, 2)])])
    async with asyncio.timeout(5):
        assert await ch.get_batch(max_items=10, timeout=0) == ["item1", "item2"]
    [get] = [op for op in ch._ops if op[0] == "get"]
    assert ("cancel", get[1]) in ch._ops and ch._acc_took == {False: [1, 2]}


async def test_a_waiting_get_batch_gets_the_whole_group_that_arrived():
    """A get_batch waiting here when a group sent ahead arrives takes as many as its rule
    allows (what the channel counts for it), a get one, the rest stay buffered."""
    import asyncio

    ch = _client()
    batch = asyncio.ensure_future(ch.get_batch(max_items=3, timeout=10))
    async with asyncio.timeout(5):
        while not [op for op in ch._ops if op[0] == "get"]:
            await asyncio.sleep(0)
    one = asyncio.ensure_future(ch.get(timeout=10))
    async with asyncio.timeout(5):
        while len([op for op in ch._ops if op[0] == "get"]) < 2:
            await asyncio.sleep(0)
    ch._on_ops([("ahead", None, [(i, 1.0, _packed(ch, i)) for i in range(1, 6)])])
    async with asyncio.timeout(5):
        assert await batch == ["item1", "item2", "item3"] and await one == "item4"
    assert [i[0] for i in ch._buffers[None]] == [5]


def _packed(ch, i: int):
    from rlinf.channel._payload import pack

    return pack(ch._codec, f"item{i}")[0]


def _client():
    """A Channel handle that keeps its ops here (to be looked at), opened on this loop."""
    import asyncio

    from rlinf.channel import Channel

    from .test_channel_unit import _CommBeforeOpen

    class _Comm(_CommBeforeOpen):
        class internal(_CommBeforeOpen.internal):
            trace = None

            @staticmethod
            def timeout_of(timeout):
                return timeout

    ch = Channel(_Comm(), "c")
    ch._loop = asyncio.get_running_loop()
    ch._flush_scheduled = True
    return ch


async def test_the_answer_of_a_get_given_up_goes_to_the_next_get_waiting_then_its_own_back():
    """prefetch=0: get 1 is given up, get 2 sent before get 1's answer arrives. Get 1's
    answer (older) answers get 2; get 2's own answer (newer) goes back: put order holds."""
    import asyncio

    ch = _client()
    rid1, future1 = ch._start_get(None, 1, None)
    ch._abandon(rid1, future1)
    get2 = asyncio.ensure_future(ch.get(timeout=10))
    async with asyncio.timeout(5):
        while len([op for op in ch._ops if op[0] == "get"]) < 2:
            await asyncio.sleep(0)
    rid2 = [op for op in ch._ops if op[0] == "get"][1][1]
    ch._on_ops([("items", rid1, None, [(1, 1.0, _packed(ch, 1)), (2, 1.0, _packed(ch, 2))])])
    ch._on_ops([("items", rid2, None, [(3, 1.0, _packed(ch, 3))])])
    async with asyncio.timeout(5):
        assert await get2 == "item1"
    assert [op for op in ch._ops if op[0] == "unget"] == [("unget", [2]), ("unget", [3])]


async def test_items_recalled_while_a_batch_tops_up_go_back_if_it_is_given_up():
    """A recall that arrives while get_batch tops up finds the items out of the buffer
    (taken by it): given up, the batch gives those back rather than keeping them."""
    import asyncio

    ch, batch = await _topping_up()
    ch._on_ops([("recall", None, [1, 2])])
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert ("unget", [1, 2]) in ch._ops and not ch._buffers.get(None) and not ch._acc_took
    assert not ch._topping


async def _topping_up():
    """A client with items 1, 2 sent ahead, and a get_batch(max_items=10) that took them
    and sent its top-up: (client, the get_batch's task)."""
    import asyncio

    ch = _client()
    ch._on_ops([("ahead", None, [(i, 1.0, _packed(ch, i)) for i in (1, 2)])])
    batch = asyncio.ensure_future(ch.get_batch(max_items=10, timeout=10))
    async with asyncio.timeout(5):
        while not [op for op in ch._ops if op[0] == "get"]:
            await asyncio.sleep(0)
    return ch, batch


async def _gets_sent(ch, n: int) -> list:
    """The "get" ops of ``ch``, once there are ``n``."""
    import asyncio

    async with asyncio.timeout(5):
        while len(gets := [op for op in ch._ops if op[0] == "get"]) < n:
            await asyncio.sleep(0)
    return gets


async def test_gets_while_a_batch_tops_up_are_sent_after_its_answer_and_took():
    """A get and an async_get of other tasks while get_batch tops up send their get ops
    only once the top-up is answered, after the batch's "took": sent before, the channel
    would take each as answered by the items the batch took (still ahead there)."""
    import asyncio

    ch, batch = await _topping_up()
    one = asyncio.ensure_future(ch.get(timeout=10))
    work = ch.async_get()
    for _ in range(10):
        await asyncio.sleep(0)
    [top_up] = await _gets_sent(ch, 1)
    assert not one.done() and not work.done() and not ch._acc_took
    ch._on_ops([("items", top_up[1], None, [(3, 1.0, _packed(ch, 3))])])
    async with asyncio.timeout(5):
        assert await batch == ["item1", "item2", "item3"]
    _, get1, get2 = await _gets_sent(ch, 3)
    assert ch._acc_took == {False: [1, 2, 3]}     # (a flush sends "took" ahead of the gets)
    ch._on_ops([("items", get1[1], None, [(4, 1.0, _packed(ch, 4))]),
                ("items", get2[1], None, [(5, 1.0, _packed(ch, 5))])])
    async with asyncio.timeout(5):
        assert await one == "item4" and await work == "item5"


async def test_a_get_waiting_for_a_batch_given_up_while_topping_up_takes_the_items_ahead():
    """The batch is cancelled while it tops up: the get waiting for it takes the oldest
    item sent ahead (back in the buffer) and asks nothing; the top-up's answer goes back."""
    import asyncio

    ch, batch = await _topping_up()
    one = asyncio.ensure_future(ch.get(timeout=10))
    for _ in range(10):
        await asyncio.sleep(0)
    batch.cancel()
    async with asyncio.timeout(5):
        assert await one == "item1"
    [top_up] = [op for op in ch._ops if op[0] == "get"]
    ch._on_ops([("items", top_up[1], None, [(3, 1.0, _packed(ch, 3))])])
    assert ("unget", [3]) in ch._ops and ch.get_nowait() == "item2"
    assert batch.cancelled() and not ch._topping


async def test_a_get_waiting_for_a_top_up_times_out_without_asking():
    import asyncio

    from rlinf import CommTimeoutError

    ch, batch = await _topping_up()
    async with asyncio.timeout(5):
        with pytest.raises(CommTimeoutError):
            await ch.get(timeout=0.05)
    assert len([op for op in ch._ops if op[0] == "get"]) == 1 and not batch.done()
    batch.cancel()
