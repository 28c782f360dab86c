"""Versions, the staleness bound and admission (pacing) of a channel, without processes:
the pure arithmetic (:mod:`rlinf.channel._pacing`) and the core driven op by op."""

from __future__ import annotations

import pytest

from rlinf.channel import ChannelStats
from rlinf.channel._pacing import Pacing, admission_limit, check_pacing

from .test_channel_unit import Harness


class Replies:
    def __init__(self) -> None:
        self.granted: list[tuple[str, int]] = []

    def __call__(self, h, rid, value) -> None:
        self.granted.append((h, rid))


# -- admission arithmetic ------------------------------------------------------------------
def test_admission_limit_is_the_last_item_consumed_within_k_versions():
    # B = 4, k = 2: items 0..11 are consumed at versions 0, 1, 2: all within 2 of version 0
    assert admission_limit(0, 2, 4) == 12
    assert admission_limit(3, 2, 4) == 24
    assert admission_limit(0, 0, 32) == 32            # synchronous: one version's batch at a time
    for k in range(4):                                # the promise, item by item
        for b in (1, 3, 32):
            for v in range(5):
                limit = admission_limit(v, k, b)
                assert (limit - 1) // b - v == k      # the last admitted is exactly k behind
                assert limit // b - v == k + 1        # one more would be k + 1 behind


def test_a_crafted_sequence_of_admissions_puts_exits_and_advances():
    r = Replies()
    p = Pacing(1, 2, r)                 # k = 1, B = 2: 4 items ahead of version 0
    for rid in range(1, 7):
        p.admit("a", rid, 0)
    assert r.granted == [("a", 1), ("a", 2), ("a", 3), ("a", 4)] and len(p.waiting) == 2
    p.put("a", 0, 1)                    # ended by its put: counts for good, frees nothing
    p.release("a", 1)                   # ... and its block's exit changes nothing
    assert p.admitted == 4 and len(r.granted) == 4
    p.release("a", 2)                   # exit without a put: its place goes to rid 5
    assert r.granted[-1] == ("a", 5) and p.admitted == 4
    p.admit("b", 7, 0)
    p.advance(1)                        # one version more, but rollouts of version 0 are out:
    assert r.granted[-1] == ("a", 5)    # more admitted could overtake them
    for rid in (3, 4):
        p.put("a", 0, rid)
    assert r.granted[-1] == ("a", 5)    # rid 5 (version 0) still out
    p.put("a", 0, 5)                    # now the oldest out is version 1: B = 2 places
    assert r.granted[-2:] == [("a", 6), ("b", 7)] and p.admitted == 6 and not p.waiting
    assert p.open == {("a", 6): 1, ("b", 7): 1}    # asked with 0, admitted at 1: made with 1
    p.admit("b", 8, 1)
    p.release("b", 8)                   # withdrawn while waiting (cancel, timeout)
    assert not p.waiting and p.admitted == 6
    p.release("a", 99)                  # unknown: ignored
    assert p.admitted == 6


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k,b", [(0, 4), (1, 4), (2, 8)])
def test_pacing_bounds_staleness_with_long_tailed_rollouts(seed, k, b):
    """A discrete-event run: 5 producers with log-normal rollout times (sigma 1.5), a
    trainer taking items in put order, B per version, advancing after each batch. No
    item is trained more than k versions after the version it was made with, and the
    run never stalls."""
    import heapq
    import random

    rng = random.Random(seed)
    events: list = []                   # (time, seq, what, data)
    seq = iter(range(10**9))
    now = 0.0

    def granted(h, rid, current):
        heapq.heappush(events, (now + rng.lognormvariate(0, 1.5), next(seq), "put", (h, rid, current)))

    p = Pacing(k, b, granted)
    rids = iter(range(1, 10**9))
    for h in range(5):
        p.admit(h, next(rids), 0)
    queue: list[int] = []
    trained = 0
    while trained < 40 * b:
        assert events, "stalled"
        now, _, _what, (h, rid, version) = heapq.heappop(events)
        p.put(h, version, rid)
        p.release(h, rid)
        queue.append(version)
        while queue:                    # the trainer consumes at once, in put order
            made = queue.pop(0)
            assert p.current - made <= k
            trained += 1
            if trained % b == 0:
                p.advance(p.current + 1)
        p.admit(h, next(rids), version)


def test_close_refuses_waiting_and_later_admissions():
    got = []
    p = Pacing(0, 1, lambda h, rid, value: got.append((rid, value)))
    p.admit("a", 1, 0)
    p.admit("a", 2, 0)
    p.close()
    p.admit("a", 3, 0)
    assert got == [(1, 0), (2, None), (3, None)] and not p.waiting


def test_the_grant_answers_the_current_version():
    got = []
    p = Pacing(0, 1, lambda h, rid, value: got.append((rid, value)))
    p.advance(3)
    for rid in range(1, 6):
        p.admit("a", rid, 0)            # limit (3 + 0 + 1) * 1 = 4
    assert got == [(1, 3), (2, 3), (3, 3), (4, 3)]
    for rid in range(1, 5):
        p.put("a", 3, rid)
    p.advance(5)                        # what waited while the trainer moved on learns it
    assert got[-1] == (5, 5)


def test_a_producer_that_goes_gives_its_admissions_back():
    r = Replies()
    p = Pacing(0, 2, r)
    p.admit("dead", 1, 0)
    p.admit("dead", 2, 0)
    p.admit("live", 3, 0)
    p.admit("dead", 4, 0)
    assert r.granted == [("dead", 1), ("dead", 2)]
    p.forget("dead")
    assert r.granted[-1] == ("live", 3) and p.admitted == 1 and not p.waiting


def test_advance_never_goes_back_and_versions_check():
    p = Pacing(None, None, Replies())
    assert p.advance(3) == 3 and p.advance(1) == 3 and p.current == 3
    with pytest.raises(TypeError):
        p.put("a", "3", 0)
    with pytest.raises(TypeError):
        p.put("a", True, 0)
    assert check_pacing(None, None) == (None, None)
    with pytest.raises(ValueError):
        check_pacing(None, 4)           # pacing without a bound
    with pytest.raises(ValueError):
        check_pacing(-1, None)
    with pytest.raises(ValueError):
        check_pacing(1, 0)
    with pytest.raises(TypeError):
        check_pacing(1.5, None)


# -- the core: staleness bound -------------------------------------------------------------
def vput(t: Harness, src: str, *versions, key=None) -> None:
    t.ops(src, *[("put", key, 1.0, 0, f"v{v}", v, 0) for v in versions])


def stats(t: Harness) -> ChannelStats:
    return ChannelStats.from_dict(t.core.stats())


def test_stale_items_are_never_handed_out_and_are_counted_per_key():
    t = Harness(max_staleness=1)
    t.hello("p:0", "c:0", "t:0")
    vput(t, "p:0", 0, 1, 2, 0, None, 3)
    vput(t, "p:0", 0, key="k")
    t.ops("t:0", ("advance", 5, 2))
    assert t.drain("t:0") == [("reply", 5, 2)]
    t.get("c:0", max_items=10)
    assert t.items("c:0") == [[2, 3, 5, 6]]       # versions 1, 2, None, 3: 0 < 2 - 1 dropped
    s = stats(t)
    assert s.stale_dropped == 2 and s.version == 2 and s.length == 1
    t.get("c:0", key="k")
    assert t.items("c:0") == []                    # its only item was stale: the get waits
    s = stats(t)
    assert s.stale_dropped == 3 and {k.key: k.stale_dropped for k in s.keys} == {None: 2, "k": 1}
    c = s.consumer("c:0")                          # handed out at version 2: 1, 0, -, 0 behind
    assert (c.staleness_max, c.staleness_histogram) == (1, (2, 1))
    assert c.staleness_mean == pytest.approx(1 / 3)


def test_stale_items_assigned_by_a_policy_leave_pending_counts_right_and_end_after_close():
    t = Harness(max_staleness=0, policy="round_robin")
    t.hello("p:0", "a:0", "b:0", "t:0")
    rids = [t.get("a:0"), t.get("b:0")]            # waiting: nothing to give yet
    t.ops("t:0", ("advance", 1, 1))
    vput(t, "p:0", 0, 0, 0, 0)                     # all stale: assigned, then dropped when served
    assert t.items("a:0") == t.items("b:0") == []  # the gets still wait
    t.ops("p:0", ("close", 7))
    rids += [t.get("a:0"), t.get("b:0")]
    ends = [op for src in ("a:0", "b:0") for op in t.drain(src) if op[0] == "end"]
    assert sorted(op[1] for op in ends) == sorted(rids)
    s = stats(t)
    assert s.stale_dropped == 4 and all(c.pending_count == 0 for c in s.consumers)


# -- the core: admissions ------------------------------------------------------------------
def test_admissions_through_the_core_put_exit_and_death():
    t = Harness(max_staleness=0, batch_size=2)
    t.hello("p:0", "q:0", "t:0")
    t.ops("p:0", ("admit", 1, 0), ("admit", 2, 0))
    t.ops("q:0", ("admit", 3, 0))
    assert t.drain("p:0") == [("reply", 1, 0), ("reply", 2, 0)] and t.drain("q:0") == []
    t.ops("p:0", ("put", None, 1.0, 0, "x", 0, 1), ("release", 1))     # put inside, then exit
    assert t.drain("q:0") == []
    t.core.gone("p:0", "")                                              # p dies holding admission 2
    assert t.drain("q:0") == [("reply", 3, 0)]
    s = stats(t)
    assert (s.admitted, s.admissions_open, s.admissions_waiting) == (2, 1, 0)
    t.ops("q:0", ("release", 3))                                        # exit without a put
    assert stats(t).admitted == 1


def test_stats_print_versions_and_staleness():
    t = Harness(max_staleness=2, batch_size=4)
    t.hello("p:0", "c:0")
    vput(t, "p:0", 0)
    t.get("c:0")
    text = str(stats(t))
    assert "version 0 (max_staleness=2, batch_size=4)" in text and "staleness mean 0.00 max 0" in text
