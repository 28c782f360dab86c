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


def test_gets_received_while_items_are_ahead_are_answered_by_them_one_each():
    t = _harness({"a:0": 1000.0})
    t.get("a:0")
    t.put("p:0", *[1] * 100)
    t.items("a:0")
    t.took("a:0", [1])
    _run_until(t, t.now + 1.0)
    [group] = _ahead_ids(t, "a:0")
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
