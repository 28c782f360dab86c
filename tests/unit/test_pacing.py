"""Versions, the staleness bound and admission (pacing) of a channel, without processes:
the pure arithmetic (:mod:`rlinf.channel._pacing`) and the core driven op by op."""

from __future__ import annotations

import collections
import heapq
import itertools
import random

import pytest

from rlinf.channel import ChannelStats
from rlinf.channel._pacing import Pacing, admission_limit, check_pacing
from rlinf.channel._state import Item

from .test_channel_unit import Harness


class Replies:
    def __init__(self) -> None:
        self.granted: list[tuple[str, int]] = []

    def __call__(self, h, rid, value) -> None:
        self.granted.append((h, rid))


class Consumer:
    """What :meth:`Pacing.handed` needs of a consumer."""
    staleness = None
    lost = False


_ids = itertools.count(1)


def hand(p: Pacing, *versions: int) -> None:
    """The trainer was handed admitted items made with ``versions``."""
    p.handed(Consumer(), [Item(next(_ids), 1.0, None, None, 0, "p", v, True) for v in versions])


# -- admission arithmetic ------------------------------------------------------------------
def test_admission_limit_is_the_last_item_consumed_within_k_versions():
    # B = 4, k = 2, nothing handed out when the version began: items 1..12 are consumed
    # at that version and the 2 after it
    assert admission_limit(0, 2, 4) == 12
    assert admission_limit(12, 2, 4) == 24
    assert admission_limit(0, 0, 32) == 32            # synchronous: one version's batch at a time
    for k in range(4):                                # the promise, item by item
        for b in (1, 3, 32):
            for v in range(5):
                limit = admission_limit(v * b, k, b)  # at version v, v * b items were handed out
                assert (limit - 1) // b - v == k      # the last admitted is exactly k behind
                assert limit // b - v == k + 1        # one more would be k + 1 behind


def test_a_crafted_sequence_of_admissions_puts_exits_and_advances():
    r = Replies()
    p = Pacing(1, 2, r)                 # k = 1, B = 2: 4 places ahead of version 0
    for rid in range(1, 7):
        p.admit("a", rid, 0)
    assert r.granted == [("a", 1), ("a", 2), ("a", 3), ("a", 4)] and len(p.waiting) == 2
    assert p.put("a", 0, 1) == (0, True)    # ended by its put: counts for good, frees nothing
    p.release("a", 1)                   # ... and its block's exit changes nothing
    assert p.admitted == 4 and len(r.granted) == 4
    p.release("a", 2)                   # exit without a put: its place goes to rid 5
    assert r.granted[-1] == ("a", 5) and p.admitted == 4
    p.admit("b", 7, 0)
    for rid in (3, 4):
        p.put("a", 0, rid)
    hand(p, 0, 0, 0)                    # the trainer got 3 items ...
    p.advance(1)                        # ... and moved on; but rid 5, admitted at version 0,
    assert r.granted[-1] == ("a", 5)    # is out: more admitted could overtake it
    p.put("a", 0, 5)                    # now the limit is 3 handed out + 4 = 7
    assert r.granted[-2:] == [("a", 6), ("b", 7)] and p.admitted == 6 and not p.waiting
    assert p.open == {("a", 6): [1, 3, 1], ("b", 7): [1, 3, 1]}    # asked with 0, made with 1
    p.admit("b", 8, 1)
    p.admit("b", 9, 1)
    assert r.granted[-1] == ("b", 8) and len(p.waiting) == 1
    p.release("b", 9)                   # withdrawn while waiting (cancel, timeout)
    assert not p.waiting and p.admitted == 7
    p.release("a", 99)                  # unknown: ignored
    assert p.admitted == 7
    assert p.put("c", 1, 0) == (1, False)   # not admitted: takes no place


def simulate(seed: int, k: int, b: int, per_version: int, versions: int = 40) -> tuple[int, int]:
    """A discrete-event run: 5 producers with log-normal rollout times (sigma 1.5), a
    trainer taking items in put order, ``per_version`` items per version, advancing after
    each; an item older than ``k`` when its turn comes is dropped (the safety net).
    Returns the most versions behind an item trained was, and the items dropped; fails
    if the run stalls (every producer waits for admission, the trainer for items)."""
    rng = random.Random(seed)
    events: list = []                   # (time, seq, (handle, rid, current))
    seq = itertools.count()
    now = 0.0

    def granted(h, rid, current):
        heapq.heappush(events, (now + rng.lognormvariate(0, 1.5), next(seq), (h, rid, current)))

    p = Pacing(k, b, granted)
    rids = itertools.count(1)
    for h in range(5):
        p.admit(h, next(rids), 0)
    queue: collections.deque = collections.deque()
    trainer = Consumer()
    trained = worst = dropped = 0
    while p.current < versions:
        assert events, f"stalled at version {p.current}"
        now, _, (h, rid, version) = heapq.heappop(events)
        made, paced = p.put(h, version, rid)
        p.release(h, rid)
        queue.append(Item(next(seq), 1.0, None, None, 0, "p", made, paced))
        while queue:                    # the trainer consumes at once, in put order
            item = queue.popleft()
            if p.current - item.version > k:
                p.dropped(item)
                dropped += 1
                continue
            p.handed(trainer, [item])
            worst = max(worst, p.current - item.version)
            trained += 1
            if trained % per_version == 0:
                p.advance(p.current + 1)
        p.admit(h, next(rids), version)
    return worst, dropped


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k,b", [(0, 4), (1, 4), (2, 8)])
def test_pacing_bounds_staleness_with_long_tailed_rollouts(seed, k, b):
    """B items per version: no item is trained more than k versions after the version it
    was made with, none is dropped, and the run never stalls."""
    assert simulate(seed, k, b, b) <= (k, 0)


@pytest.mark.parametrize("seed", range(4))
def test_a_trainer_taking_more_than_b_items_per_version_never_stalls(seed):
    """The limit counts what was handed out, not ``version * B`` (which stalled at
    version 2 with k = 1, B = 2 and 3 items per version)."""
    worst, dropped = simulate(seed, 1, 2, 3)
    assert worst <= 1 and dropped == 0


@pytest.mark.parametrize("seed", range(4))
def test_dropped_items_give_their_places_back(seed):
    """A trainer taking fewer than B per version lets items grow stale: they are dropped
    (the safety net), and their places are given back, so the run goes on (a dropped
    item that kept its place would, after (k + 1) * B drops, stall everyone)."""
    worst, dropped = simulate(seed, 0, 4, 1, versions=60)
    assert worst == 0 and dropped > 4


def test_close_refuses_waiting_and_later_admissions():
    got = []
    p = Pacing(0, 1, lambda h, rid, value: got.append((rid, value)))
    p.admit("a", 1, 0)
    p.admit("a", 2, 0)
    p.close()
    p.admit("a", 3, 0)
    assert got == [(1, 0), (2, None), (3, None)] and not p.waiting


def test_the_grant_answers_the_current_version_and_a_resumed_trainer_admits_one_window():
    got = []
    p = Pacing(1, 2, lambda h, rid, value: got.append((rid, value)))
    p.advance(30)                       # a trainer resuming at version 30: (k + 1) * B places,
    for rid in range(1, 7):             # not (30 + k + 1) * B at once
        p.admit("a", rid, 0)
    assert got == [(1, 30), (2, 30), (3, 30), (4, 30)]
    for rid in range(1, 5):
        p.put("a", 30, rid)
    hand(p, 30, 30)
    p.advance(31)                       # what waited while the trainer moved on learns it
    assert got[-2:] == [(5, 31), (6, 31)]


def test_an_admission_of_n_places_counts_each_put_and_frees_the_rest_at_exit():
    r = Replies()
    p = Pacing(0, 4, r)                 # k = 0, B = 4
    p.admit("a", 1, 0, 3)               # a group of 3
    p.admit("b", 2, 0, 2)               # 3 + 2 > 4: waits (oldest first: nobody overtakes it)
    p.admit("c", 3, 0, 1)
    assert r.granted == [("a", 1)] and p.admitted == 3
    assert [p.put("a", 0, 1) for _ in range(2)] == [(0, True)] * 2 and ("a", 1) in p.open
    assert p.put("a", 0, 1) == (0, True) and ("a", 1) not in p.open    # its 3rd put ends it
    assert p.put("a", 0, 1) == (0, False)   # (a 4th is not counted; the client refuses it)
    hand(p, 0, 0, 0)
    p.advance(1)                        # 3 handed out + 4: b's 2 and c's 1 fit
    assert r.granted[1:] == [("b", 2), ("c", 3)] and p.admitted == 6
    p.put("b", 1, 2)
    p.release("b", 2)                   # exit after 1 of 2 puts: 1 place freed
    assert p.admitted == 5 and not p.open.get(("b", 2))
    p.admit("d", 4, 1, 99)              # more than (k + 1) * B could never fit: clamped
    assert p.waiting[-1][3] == 4


def test_waiting_admissions_of_a_handle_taken_for_lost_wait_until_it_is_back():
    r = Replies()
    p = Pacing(0, 1, r)
    a, lost, c = Consumer(), Consumer(), Consumer()
    lost.lost = True
    p.admit(a, 1, 0)
    p.admit(lost, 2, 0)
    p.admit(c, 3, 0)
    p.release(a, 1)                     # a place: not for the lost handle, for c
    assert r.granted == [(a, 1), (c, 3)] and p.waiting[0][0] is lost
    p.release(c, 3)
    lost.lost = False
    p.grant()                           # (the core grants when a handle is back)
    assert r.granted[-1] == (lost, 2)


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


def test_a_dropped_admitted_item_gives_its_place_back_through_the_core():
    """k = 0, B = 1: b's rollout, admitted while the trainer moved on, is put with the
    old version (explicitly) and dropped; its place comes back, so the next rollout is
    admitted and the trainer is fed (it used to wait forever, every producer too)."""
    t = Harness(max_staleness=0, batch_size=1)
    t.hello("a:0", "b:0", "t:0")
    t.ops("a:0", ("admit", 1, 0))
    t.ops("b:0", ("admit", 2, 0))
    assert t.drain("a:0") == [("reply", 1, 0)] and t.drain("b:0") == []
    t.ops("a:0", ("put", None, 1.0, 0, "x", 0, 1), ("release", 1))
    t.get("t:0")
    assert t.items("t:0") == [[1]]
    t.ops("t:0", ("advance", 9, 1))
    assert t.drain("b:0") == [("reply", 2, 1)]
    t.ops("b:0", ("put", None, 1.0, 0, "y", 0, 2), ("release", 2))
    t.get("t:0")
    assert t.items("t:0") == [] and stats(t).stale_dropped == 1
    t.ops("a:0", ("admit", 3, 1))
    assert t.drain("a:0") == [("reply", 3, 1)]
    t.ops("a:0", ("put", None, 1.0, 0, "z", 1, 3), ("release", 3))
    assert t.items("t:0") == [[3]]
    s = stats(t)
    assert (s.admitted, s.admissions_open, s.admissions_waiting) == (2, 0, 0)


def test_a_trainer_taking_more_than_b_per_version_is_fed_through_the_core():
    """k = 1, B = 2, the trainer takes 3 items per version: admissions follow what it
    took (by versions times B they stopped at version 2)."""
    t = Harness(max_staleness=1, batch_size=2)
    t.hello("p:0", "t:0")
    rid = 0
    for version in range(6):
        for _ in range(3):
            rid += 1
            t.ops("p:0", ("admit", rid, version))
            assert t.drain("p:0") == [("reply", rid, version)], (version, rid)
            t.ops("p:0", ("put", None, 1.0, 0, rid, version, rid), ("release", rid))
        t.get("t:0", max_items=3)
        assert [len(batch) for batch in t.items("t:0")] == [3]
        t.ops("t:0", ("advance", 1000 + version, version + 1))
    assert stats(t).stale_dropped == 0


def test_a_group_admission_counts_each_put_through_the_core():
    t = Harness(max_staleness=0, batch_size=4)
    t.hello("p:0", "q:0", "t:0")
    t.ops("p:0", ("admit", 1, 0, 3))
    t.ops("q:0", ("admit", 2, 0, 2))
    assert t.drain("p:0") == [("reply", 1, 0)] and t.drain("q:0") == []
    vput_admitted = [("put", None, 1.0, 0, f"g{i}", 0, 1) for i in range(3)]
    t.ops("p:0", *vput_admitted, ("release", 1))
    s = stats(t)
    assert (s.admitted, s.admissions_open, s.admissions_waiting) == (3, 0, 1)
    t.get("t:0", max_items=3)
    assert t.items("t:0") == [[1, 2, 3]]
    assert stats(t).consumer("t:0").staleness_histogram == (3,)       # each versioned, each counted
    t.ops("t:0", ("advance", 9, 1))
    assert t.drain("q:0") == [("reply", 2, 1)]


def test_an_item_given_back_counts_its_staleness_once():
    t = Harness(max_staleness=5)
    t.hello("p:0", "c:0")
    vput(t, "p:0", 0)
    t.get("c:0")
    [[item]] = t.items("c:0")
    t.ops("c:0", ("unget", [item]))            # a get abandoned as its answer arrived
    t.get("c:0")
    assert t.items("c:0") == [[item]]
    assert stats(t).consumer("c:0").staleness_histogram == (1,)


def test_a_handle_taken_for_lost_is_granted_nothing_until_it_is_back():
    from rlinf.channel import _lost

    t = Harness(max_staleness=0, batch_size=1)
    t.hello("a:0", "b:0", "c:0")
    t.ops("a:0", ("admit", 1, 0))
    t.ops("b:0", ("admit", 2, 0))
    t.ops("c:0", ("admit", 3, 0))
    assert t.drain("a:0") == [("reply", 1, 0)]
    _lost.suspend(t.core, "b:0", "")
    t.ops("a:0", ("release", 1))                    # the place goes to c, not to the lost b
    assert t.drain("b:0") == [] and t.drain("c:0") == [("reply", 3, 0)]
    t.ops("c:0", ("release", 3))
    assert t.drain("b:0") == []
    t.ops("b:0", ("stats", 4))                      # b is back (any op): granted
    assert t.drain("b:0")[0] == ("reply", 2, 0)
