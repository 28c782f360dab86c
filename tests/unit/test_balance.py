"""Balance from the first step, without processes: the batch placement of
``performance_aware`` (LPT once every consumer is measured), work stealing by default,
and the per-step balance of the heterogeneous workload (speeds 1, 1, 2, 4) through the
real channel core in simulated time."""

from __future__ import annotations

import heapq
import random
import statistics

import pytest

from rlinf.channel import ChannelStats, ConsumerInfo, ItemInfo, PerformanceAware
from rlinf.channel._core import ChannelCore

from .test_channel_unit import Harness


def test_lpt_places_the_heaviest_first_by_expected_finish():
    consumers = [ConsumerInfo(f"c{i}:0", "n", 0, pending, 0, 0.0, speed)
                 for i, (pending, speed) in enumerate([(0.0, 1.0), (0.0, 1.0), (2.0, 2.0), (0.0, 4.0)])]
    items = [ItemInfo(i, w) for i, w in enumerate([1.0, 8.0, 1.0, 2.0, 4.0])]
    choices = PerformanceAware().assign_batch(items, consumers)
    # 8 -> c3 (ends 2); 4 -> c2 or c3 (both 3): the faster, c3; 2 -> c0, c1 or c2 (all 2): the
    # faster, c2; 1 -> c0 (ends 1); the last 1 -> c1 (ends 1, not c0's 2)
    assert choices == [0, 3, 1, 2, 3]


def test_a_batch_policy_waits_for_every_speed_then_places_what_waits():
    t = Harness(policy="performance_aware")
    t.hello("p:0", "a:0", "b:0")
    ra, rb = t.get("a:0"), t.get("b:0")
    t.put("p:0", 1, 1, 1, 1, 1, 1)          # nobody measured: shared, served FIFO to who asks
    assert t.items("a:0") == [[1]] and t.items("b:0") == [[2]]
    s = ChannelStats.from_dict(t.core.stats())
    assert [c.pending_count for c in s.consumers] == [1, 1] and s.length == 4
    t.now += 1.0
    t.ops("a:0", ("took", [1], False), ("done", [1], 1.0))       # a: speed 1; b still unknown
    assert t.core.shared[None] and not t.core.handles[("a:0", 1)].assigned.get(None)
    t.ops("b:0", ("took", [2], False), ("done", [2], 0.25))      # b: speed 4: the 4 waiting are placed
    assert not t.core.shared.get(None)
    assert [len(t.core.handles[(n, 1)].assigned.get(None, ())) for n in ("a:0", "b:0")] == [0, 4]
    t.get("a:0")                            # (LPT gave it none: b ends all four by 1.0, a one by 1.0)
    assert t.items("a:0") == [] and (ra, rb) == (101, 102)


def test_stealing_is_on_by_default_only_for_load_placing_policies():
    for policy, steals in [("performance_aware", True), ("shortest_queue", True), ("round_robin", False),
                           ("weighted_round_robin", False), ("fifo", False), ("most_free_memory", False)]:
        assert ChannelCore("t", policy=policy, send=lambda h, op: None).work_stealing is steals
    assert not ChannelCore("t", policy="performance_aware", work_stealing=False, send=lambda h, op: None).work_stealing


class BadBatch(PerformanceAware):
    def assign_batch(self, items, consumers):
        return [99] * len(items)


def test_a_failing_batch_placement_leaves_items_shared_and_is_counted():
    t = Harness(policy=BadBatch())
    t.hello("p:0", "a:0")
    t.get("a:0")
    t.put("p:0", 1)
    t.ops("a:0", ("took", [1], False), ("done", [1], 1.0))
    t.put("p:0", 1, 1)
    assert len(t.core.shared[None]) == 2 and ChannelStats.from_dict(t.core.stats()).policy_errors >= 1


def _steps(policy: str, sizes: int, steps: int, speeds=(1.0, 1.0, 2.0, 4.0)) -> list[float]:
    """Imbalance per step: a step's items put at once, each consumer getting one item at a
    time and working weight / speed simulated seconds (as benchmarks/balance_core_sim.py)."""
    now = [0.0]
    inbox: list = []
    core = ChannelCore("sim", policy=policy, send=lambda h, op: op[0] == "items" and inbox.append((h.src, op)),
                       clock=lambda: now[0])
    names = [f"c{i}:0" for i in range(len(speeds))]
    rid = iter(range(1, 1 << 30))
    for src in ["p:0", *names]:
        core.handle_ops(src, 1, [("hello", 1, "i", "n", src)])
    for src in names:
        core.handle_ops(src, 1, [("get", next(rid), None, 1, None, None)])
    rng, events, out = random.Random(7), [], []
    for _ in range(steps):
        busy = [0.0] * len(speeds)
        core.handle_ops("p:0", 1, [("put", None, rng.lognormvariate(0, 1), 0, b"") for _ in range(sizes)])
        left = sizes
        while True:
            for src, op in inbox:
                i = names.index(src)
                core.handle_ops(src, 1, [("took", [op[3][0][0]], False)])
                heapq.heappush(events, (now[0] + op[3][0][1] / speeds[i], i, op[3][0][0], op[3][0][1] / speeds[i]))
            inbox.clear()
            if not left:
                break
            now[0], i, item, seconds = heapq.heappop(events)
            busy[i] += seconds
            left -= 1
            core.handle_ops(names[i], 1, [("done", [item], seconds), ("get", next(rid), None, 1, None, None)])
        out.append((max(busy) - min(busy)) / statistics.fmean(busy))
    return out


@pytest.mark.parametrize("items", [48, 256])
def test_performance_aware_balances_every_step_from_the_first(items):
    imbalances = _steps("performance_aware", items, 6)
    assert max(imbalances) <= 0.15 and statistics.median(imbalances) <= 0.05, imbalances


def test_placing_again_never_undoes_a_placement_that_ends_as_soon():
    """With exact speeds the first placement is LPT's; placing it again after each report
    at the end of a backlog (each item only among the consumers sent nothing newer)
    used to end some steps 10-33% apart (48 items, 20 steps: worst 32.5%). Placing again
    is kept only when it is expected to end sooner: every step stays within 3%."""
    imbalances = _steps("performance_aware", 48, 20)
    assert max(imbalances) <= 0.03, imbalances


def test_speed_blind_policies_do_not_balance_the_same_workload():
    """The same simulation tells balance apart: round robin ignores speed."""
    assert statistics.median(_steps("round_robin", 48, 4)) > 0.5


def test_placed_items_are_placed_again_when_an_early_speed_estimate_moves():
    """Estimates from one item are rough: when one moves by more than 10%, what was
    placed and not sent is placed again with the new estimate (weight over seconds, older
    reports decayed by 0.95 each)."""
    t = Harness(policy="performance_aware", work_stealing=False)
    t.hello("p:0", "a:0", "b:0")
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", 1, 1)
    t.items("a:0")
    t.items("b:0")
    t.ops("a:0", ("took", [1], False), ("done", [1], 1.0))       # a: 1/s
    t.ops("b:0", ("took", [2], False), ("done", [2], 1.0))       # b: 1/s (says its first item)
    t.put("p:0", *[1] * 8)                                      # placed 4 and 4
    queued = lambda n: len(t.core.handles[(n, 1)].assigned.get(None, ()))   # noqa: E731
    assert (queued("a:0"), queued("b:0")) == (4, 4)
    t.get("b:0")
    [[got]] = t.items("b:0")
    t.ops("b:0", ("took", [got], False), ("done", [got], 0.1))    # b: (0.95 + 1) / (0.95 + 0.1) = 1.86/s
    assert (queued("a:0"), queued("b:0")) == (2, 5)               # the 7 not sent, placed again


def test_a_declared_speed_places_items_before_any_measurement():
    t = Harness(policy="performance_aware")
    for name, speed in (("p:0", None), ("a:0", 1.0), ("b:0", 3.0)):
        t.core.handle_ops(name, 1, [("hello", 1, "inc-" + name, "node", name, speed)])
        t.drain(name)
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", *[1] * 8)                          # placed at once: 2 and 6 (b is 3x faster)
    assert t.items("a:0") == [[4]] and t.items("b:0") == [[1]]     # LPT: a gets items 4 and 8
    queued = [len(t.core.handles[(n, 1)].assigned.get(None, ())) for n in ("a:0", "b:0")]
    assert queued == [1, 5] and not t.core.shared.get(None)
    assert ChannelStats.from_dict(t.core.stats()).consumer("b:0").speed is None   # stats: measured only


def test_placing_again_keeps_each_consumers_put_order_without_stealing():
    """a is sent item 1, then is fast: placing again moves items to it, but only ones
    newer than what it was sent (b, sent item 2 first, never gets item 1's elders)."""
    t = Harness(policy="performance_aware", work_stealing=False)
    for name, speed in (("p:0", None), ("a:0", 1.0), ("b:0", 1.0)):
        t.core.handle_ops(name, 1, [("hello", 1, "inc-" + name, "node", name, speed)])
        t.drain(name)
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", *([1] * 7 + [7]))
    got = {"a:0": [i for batch in t.items("a:0") for i in batch], "b:0": [i for batch in t.items("b:0") for i in batch]}
    for _ in range(12):          # each in turn finishes its item fast and asks again: placed again each time
        for name in ("a:0", "b:0"):
            done = got[name][-1:]
            if not done:
                continue
            t.now += 0.05
            t.ops(name, ("took", done, False), ("done", done, 0.05 if name == "a:0" else 0.5),
                  ("get", 900 + len(got[name]), None, 1, None, None))
            got[name] += [i for batch in t.items(name) for i in batch]
    assert sorted(got["a:0"] + got["b:0"]) == list(range(1, 9))
    for name, ids in got.items():
        assert ids == sorted(ids), (name, ids)


class FailsWhenTold(PerformanceAware):
    fail = False

    def assign_batch(self, items, consumers):
        if self.fail:
            raise RuntimeError("told to fail")
        return super().assign_batch(items, consumers)


def test_a_failed_placement_again_serves_consumers_that_wait():
    """Placing again pulls back what is not sent; when the policy then fails, those items
    wait shared, and a consumer already waiting gets them at once."""
    t = Harness(policy=FailsWhenTold(), work_stealing=False)
    for name, speed in (("p:0", None), ("a:0", 1.0), ("b:0", 1.0)):
        t.core.handle_ops(name, 1, [("hello", 1, "inc-" + name, "node", name, speed)])
        t.drain(name)
    t.get("a:0")
    t.get("b:0")
    t.put("p:0", 1, 1, 1)
    sent = {name: [i for batch in t.items(name) for i in batch] for name in ("a:0", "b:0")}
    owner = next(name for name in sent if t.core.handles[(name, 1)].assigned.get(None))
    idle = "b:0" if owner == "a:0" else "a:0"
    t.get(idle)                                     # nothing for it: it waits
    assert t.items(idle) == []
    t.core.policy.fail = True
    t.now += 1.0
    t.ops(owner, ("took", sent[owner], False), ("done", sent[owner], 1.0))   # placed again: fails
    assert t.core.guard.errors == 1
    assert t.items(idle) == [[3]]
