"""Load-balancing policies: crafted consumer states, membership changes, make_policy."""

from __future__ import annotations

import importlib.util
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from rlinf.channel import policies as policies_module
from rlinf.channel.policies import (FIFO, POLICY_NAMES, ConsumerInfo, ItemInfo, LoadBalancePolicy, MostFreeMemory,
                                    PerformanceAware, RoundRobin, ShortestQueue, SpeedMeter, WeightedRoundRobin,
                                    make_policy, select_checked)

ALL_POLICIES = [FIFO, RoundRobin, WeightedRoundRobin, ShortestQueue, PerformanceAware, MostFreeMemory]
ITEM = ItemInfo(item_id=0, weight=1.0)


def consumers(**columns: list) -> list[ConsumerInfo]:
    """Build snapshots column-wise: consumers(pending_weight=[3, 1, 2])."""
    n = len(next(iter(columns.values())))
    return [
        ConsumerInfo(address=f"c:{i}", **{field: values[i] for field, values in columns.items()})
        for i in range(n)
    ]


# --- every policy --------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_POLICIES, ids=lambda c: c.name)
def test_empty_consumer_list_raises(cls: type[LoadBalancePolicy]) -> None:
    with pytest.raises(ValueError, match="no consumers"):
        cls().select_consumer(ITEM, [])


@pytest.mark.parametrize("cls", ALL_POLICIES, ids=lambda c: c.name)
def test_random_states_give_in_range_indices(cls: type[LoadBalancePolicy]) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    policy = cls()
    for _ in range(300):
        n = rng.randint(1, 6)
        snapshot = [
            ConsumerInfo(
                address=f"c:{rng.randrange(8)}x{i}",
                pending_count=rng.randrange(5),
                pending_weight=rng.choice([0.0, rng.random() * 10]),
                consumed_weight=rng.random() * 100,
                speed=rng.choice([None, 0.0, -1.0, math.nan, math.inf, rng.random() * 5 + 0.01]),
                free_device_memory=rng.choice([None, 0, rng.randrange(1 << 34)]),
                waiting=rng.random() < 0.5,
            )
            for i in range(n)
        ]
        item = ItemInfo(item_id=0, weight=rng.choice([0.0, rng.lognormvariate(0, 1)]))
        choice = policy.select_consumer(item, snapshot)
        assert isinstance(choice, int) and 0 <= choice < n, (seed, snapshot, choice)
        policy.on_consumed(snapshot[choice].address, item, rng.random())


@pytest.mark.parametrize("cls", ALL_POLICIES, ids=lambda c: c.name)
def test_policies_pickle_for_the_channel_process(cls: type[LoadBalancePolicy]) -> None:
    policy = cls()
    policy.select_consumer(ITEM, consumers(pending_weight=[1.0, 0.0]))
    clone = pickle.loads(pickle.dumps(policy))
    assert type(clone) is cls and clone.name == cls.name


def test_only_fifo_does_not_assign() -> None:
    assert [cls.assigns for cls in ALL_POLICIES] == [False, True, True, True, True, True]


# --- crafted states, one table per policy --------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [([False, True, True], 1), ([True, False, False], 0), ([False, False, False], 0), ([False, False, True], 2)],
)
def test_fifo_fallback_is_first_waiting_consumer(waiting: list[bool], expected: int) -> None:
    assert FIFO().select_consumer(ITEM, consumers(waiting=waiting)) == expected


@pytest.mark.parametrize(
    ("consumed", "pending", "expected"),
    [
        ([5.0, 3.0, 3.0], [0.0, 0.0, 0.0], 1),  # tie -> lowest index
        ([0.0, 0.0, 0.0], [2.0, 1.0, 3.0], 1),
        ([10.0, 0.0, 4.0], [0.0, 9.0, 0.0], 2),  # consumed + pending counts, not pending alone
        ([1.0, 1.0], [1.0, 1.0], 0),
    ],
)
def test_weighted_round_robin_least_total_weight(
    consumed: list[float], pending: list[float], expected: int
) -> None:
    snapshot = consumers(consumed_weight=consumed, pending_weight=pending)
    assert WeightedRoundRobin().select_consumer(ITEM, snapshot) == expected


def test_weighted_round_robin_equalises_weight_over_a_stream() -> None:
    policy, totals = WeightedRoundRobin(), [0.0, 0.0, 0.0]
    for w in [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]:
        i = policy.select_consumer(ItemInfo(0, w), consumers(pending_weight=totals))
        totals[i] += w
    assert totals == [5.0, 5.0, 5.0]


@pytest.mark.parametrize(
    ("pending_weight", "pending_count", "expected"),
    [
        ([3.0, 1.0, 2.0], [1, 1, 1], 1),
        ([2.0, 2.0, 2.0], [3, 1, 2], 1),  # tie on weight -> fewer items
        ([2.0, 2.0, 2.0], [1, 1, 1], 0),  # full tie -> lowest index
        ([0.5, 0.0, 0.0], [0, 4, 2], 2),  # weight first, count only breaks ties
    ],
)
def test_shortest_queue(pending_weight: list[float], pending_count: list[int], expected: int) -> None:
    snapshot = consumers(pending_weight=pending_weight, pending_count=pending_count)
    assert ShortestQueue().select_consumer(ITEM, snapshot) == expected


@pytest.mark.parametrize(
    ("speeds", "pending", "weight", "expected"),
    [
        ([1.0, 1.0, 2.0, 4.0], [0.0, 0.0, 0.0, 0.0], 1.0, 3),
        ([1.0, 4.0], [0.0, 3.0], 2.0, 1),  # (0+2)/1 = 2 > (3+2)/4 = 1.25
        ([1.0, 4.0], [0.0, 3.0], 0.5, 0),  # (0+0.5)/1 = 0.5 < 3.5/4 = 0.875
        ([2.0, 2.0], [1.0, 1.0], 1.0, 0),  # tie -> lowest index
        ([1.0, 2.0], [0.0, 1.0], 1.0, 1),  # finish tie (1.0) -> faster consumer
        ([None, None, None], [2.0, 1.0, 3.0], 1.0, 1),  # nothing measured: default speed
        ([4.0, None], [4.0, 1.0], 1.0, 1),  # unknown uses mean known (4): 5/4 > 2/4
        ([1.0, 3.0, None], [1.0, 4.0, 2.0], 1.0, 2),  # mean known = 2: 2, 5/3, 3/2
        ([0.0, 2.0, 2.0], [0.0, 1.0, 1.0], 1.0, 0),  # speed 0 is "not measured": mean 2
    ],
)
def test_performance_aware_earliest_expected_finish(
    speeds: list[float | None], pending: list[float], weight: float, expected: int
) -> None:
    snapshot = consumers(speed=speeds, pending_weight=pending)
    assert PerformanceAware().select_consumer(ItemInfo(0, weight), snapshot) == expected


def test_performance_aware_spreads_in_proportion_to_speed() -> None:
    policy, pending, counts = PerformanceAware(), [0.0] * 4, [0] * 4
    for k in range(80):
        snapshot = consumers(speed=[1.0, 1.0, 2.0, 4.0], pending_weight=pending, pending_count=counts)
        i = policy.select_consumer(ItemInfo(k, 1.0), snapshot)
        pending[i] += 1.0
        counts[i] += 1
    assert counts == [10, 10, 20, 40]


def test_performance_aware_learns_speed_from_on_consumed() -> None:
    policy = PerformanceAware()
    snapshot = consumers(speed=[None, None], pending_weight=[0.0, 1.0])
    assert policy.select_consumer(ITEM, snapshot) == 0  # both assumed equal
    policy.on_consumed("c:1", ItemInfo(0, 8.0), 1.0)  # c:1 runs at 8/s
    policy.on_consumed("c:0", ItemInfo(1, 1.0), 1.0)  # c:0 runs at 1/s
    assert policy.speeds(snapshot) == [1.0, 8.0]
    assert policy.select_consumer(ITEM, snapshot) == 1
    # A snapshot's own measurement wins over the policy's meter.
    assert policy.speeds(consumers(speed=[3.0, 0.5])) == [3.0, 0.5]
    policy.reset()
    assert policy.speeds(snapshot) == [1.0, 1.0]


def test_performance_aware_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="alpha"):
        PerformanceAware(alpha=0.0)
    with pytest.raises(ValueError, match="default_speed"):
        PerformanceAware(default_speed=0.0)


@pytest.mark.parametrize(
    ("free", "pending", "expected"),
    [
        ([None, 10, 20], [0.0, 0.0, 0.0], 2),
        ([None, 0, None], [3.0, 1.0, 2.0], 1),  # no reports == 0 -> shortest queue
        ([5, 5, 1], [2.0, 1.0, 0.0], 1),  # tie on memory -> shortest queue
        ([None, None], [0.0, 0.0], 0),
    ],
)
def test_most_free_memory(free: list[int | None], pending: list[float], expected: int) -> None:
    snapshot = consumers(free_device_memory=free, pending_weight=pending)
    assert MostFreeMemory().select_consumer(ITEM, snapshot) == expected


# --- round robin and membership changes ----------------------------------------------


def served(policy: RoundRobin, addresses: list[str], times: int) -> list[str]:
    snapshot = [ConsumerInfo(address=a) for a in addresses]
    return [addresses[policy.select_consumer(ITEM, snapshot)] for _ in range(times)]


def test_round_robin_cycles_in_order() -> None:
    assert served(RoundRobin(), ["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]


@pytest.mark.parametrize(
    ("before", "served_first", "after", "expected_next"),
    [
        (["a", "b", "c"], 2, ["a", "c"], ["c", "a"]),  # last served (b) left -> its successor
        (["a", "b", "c"], 1, ["z", "a", "b", "c"], ["b", "c", "z"]),  # joined in front: no repeat
        (["a", "b", "c"], 2, ["a", "b", "c", "d"], ["c", "d", "a"]),  # joined at the end
        (["a", "b", "c"], 3, ["a", "b"], ["a", "b"]),  # c left after serving: wrap around
        (["a", "b", "c"], 2, ["c", "b", "a"], ["a", "c"]),  # reordered: follow b by address
        (["a", "b"], 1, ["x", "y"], ["x", "y"]),  # everyone replaced: start over
    ],
)
def test_round_robin_across_membership_changes(
    before: list[str], served_first: int, after: list[str], expected_next: list[str]
) -> None:
    policy = RoundRobin()
    assert served(policy, before, served_first) == before[:served_first]
    assert served(policy, after, len(expected_next)) == expected_next


def test_round_robin_reset_starts_over() -> None:
    policy = RoundRobin()
    served(policy, ["a", "b", "c"], 2)
    policy.reset()
    assert served(policy, ["a", "b", "c"], 1) == ["a"]


# --- SpeedMeter -----------------------------------------------------------------------


def test_speed_meter_ewma_math() -> None:
    meter = SpeedMeter(alpha=0.3)
    assert meter.value is None
    assert meter.update(10.0, 2.0) == pytest.approx(5.0)  # first sample sets the value
    assert meter.update(4.0, 4.0) == pytest.approx(5.0 + 0.3 * (1.0 - 5.0))  # 3.8
    assert meter.update(9.0, 1.0) == pytest.approx(3.8 + 0.3 * (9.0 - 3.8))  # 5.36
    assert meter.count == 3
    meter.reset()
    assert (meter.value, meter.count) == (None, 0)


def test_speed_meter_converges_to_a_steady_speed() -> None:
    meter = SpeedMeter()
    meter.update(1.0, 1.0)
    for _ in range(40):
        meter.update(3.0, 1.5)  # 2 units/s
    assert meter.value == pytest.approx(2.0, rel=1e-5)


def test_speed_meter_alpha_one_keeps_latest() -> None:
    meter = SpeedMeter(alpha=1.0)
    meter.update(1.0, 1.0)
    assert meter.update(6.0, 2.0) == 3.0


def test_speed_meter_skips_uninformative_samples() -> None:
    meter = SpeedMeter()
    assert meter.update(0.0, 1.0) is None
    assert meter.update(1.0, 0.0) is None
    meter.update(2.0, 1.0)
    assert meter.update(0.0, 5.0) == 2.0
    assert meter.count == 1


@pytest.mark.parametrize(("weight", "seconds"), [(-1.0, 1.0), (1.0, -0.1), (math.nan, 1.0), (1.0, math.inf)])
def test_speed_meter_rejects_bad_samples(weight: float, seconds: float) -> None:
    with pytest.raises(ValueError):
        SpeedMeter().update(weight, seconds)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan])
def test_speed_meter_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        SpeedMeter(alpha)


# --- make_policy and user policies ----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        (None, FIFO),
        ("fifo", FIFO),
        ("round_robin", RoundRobin),
        ("weighted_round_robin", WeightedRoundRobin),
        ("shortest_queue", ShortestQueue),
        ("performance_aware", PerformanceAware),
        ("most_free_memory", MostFreeMemory),
        ("Round-Robin", RoundRobin),
        (" performance aware ", PerformanceAware),
        (ShortestQueue, ShortestQueue),
    ],
)
def test_make_policy_builds(spec: object, cls: type) -> None:
    policy = make_policy(spec)  # type: ignore[arg-type]
    assert type(policy) is cls


def test_make_policy_passes_instances_through() -> None:
    policy = PerformanceAware(alpha=0.5)
    assert make_policy(policy) is policy


def test_make_policy_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown load-balancing policy 'fastest'") as info:
        make_policy("fastest")
    for name in ("fifo", "round_robin", "weighted_round_robin", "shortest_queue", "performance_aware"):
        assert name in str(info.value)


@pytest.mark.parametrize("spec", [3, 1.5, ["fifo"], object(), dict, LoadBalancePolicy])
def test_make_policy_rejects_other_types(spec: object) -> None:
    with pytest.raises(TypeError):
        make_policy(spec)  # type: ignore[arg-type]


class Last(LoadBalancePolicy):
    """A user policy: always the last consumer."""

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        if not consumers:
            raise ValueError("no consumers")
        return len(consumers) - 1


class NeedsArgs(LoadBalancePolicy):
    def __init__(self, bias: int) -> None:
        self.bias = bias

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        return self.bias


def test_user_subclass_through_make_policy() -> None:
    policy = make_policy(Last)
    assert isinstance(policy, Last) and policy.assigns and policy.name == "Last"
    assert policy.select_consumer(ITEM, consumers(pending_weight=[0.0, 9.0, 9.0])) == 2
    policy.on_consumed("c:2", ITEM, 1.0)  # default hooks exist and do nothing
    policy.reset()
    assert make_policy(NeedsArgs(1)).select_consumer(ITEM, consumers(pending_weight=[0.0, 0.0])) == 1
    with pytest.raises(TypeError, match="pass an instance instead"):
        make_policy(NeedsArgs)


class NoSelect(LoadBalancePolicy):
    """Forgot select_consumer (abstract: cannot be built)."""

    def select(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        return 0


class OneArgument(LoadBalancePolicy):
    def select_consumer(self, item: ItemInfo) -> int:  # type: ignore[override]
        return 0


class ThreeArguments(LoadBalancePolicy):
    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo], extra: int) -> int:  # type: ignore[override]
        return 0


class AsyncSelect(LoadBalancePolicy):
    async def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:  # type: ignore[override]
        return 0


class NotCallable(LoadBalancePolicy):
    select_consumer = 0  # type: ignore[assignment]


class Flexible(LoadBalancePolicy):
    """Extra parameters with defaults, or *args, still take (item, consumers)."""

    def select_consumer(self, item, consumers, bias=0, *rest, **options) -> int:  # type: ignore[override]
        return bias


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (NoSelect, r"NoSelect does not implement select_consumer\(self, item, consumers\)"),
        (OneArgument, r"OneArgument: select_consumer\(item\) cannot be called as select_consumer\(item, consumers\)"),
        (OneArgument(), r"OneArgument: select_consumer\(item\) cannot be called"),
        (ThreeArguments, r"select_consumer\(item, consumers, extra\) cannot be called"),
        (AsyncSelect, "coroutine function.*never awaits"),
        (NotCallable(), "NotCallable does not implement select_consumer"),
    ],
)
def test_make_policy_rejects_a_policy_without_a_usable_select_consumer(spec: object, message: str) -> None:
    """Checked when the policy is given (create_channel calls make_policy), not when the
    first item is placed: such a policy would send every item to the shared queue."""
    with pytest.raises(TypeError, match=message):
        make_policy(spec)  # type: ignore[arg-type]


def test_make_policy_accepts_a_select_consumer_with_extra_optional_parameters() -> None:
    assert make_policy(Flexible).select_consumer(ITEM, consumers(pending_weight=[0.0])) == 0


def test_subclass_of_builtin_gets_its_own_name() -> None:
    class MyRR(RoundRobin):
        pass

    assert MyRR.name == "MyRR" and RoundRobin.name == "round_robin"


@pytest.mark.parametrize(("bias", "error"), [(5, ValueError), (-1, ValueError), (True, TypeError), ("0", TypeError),
                                             (1.0, TypeError), (np.bool_(True), TypeError), (np.int64(2), ValueError)])
def test_select_checked_rejects_bad_answers(bias: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="NeedsArgs"):
        select_checked(NeedsArgs(bias), ITEM, consumers(pending_weight=[0.0, 0.0]))  # type: ignore[arg-type]
    assert select_checked(NeedsArgs(1), ITEM, consumers(pending_weight=[0.0, 0.0])) == 1
    with pytest.raises(ValueError, match="no consumers"):
        select_checked(NeedsArgs(0), ITEM, [])


def test_module_all_is_complete() -> None:
    public = {
        name
        for name, value in vars(policies_module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == policies_module.__name__
    }
    assert public <= set(policies_module.__all__)
    assert set(POLICY_NAMES) >= {"fifo", "round_robin", "weighted_round_robin", "shortest_queue", "performance_aware"}


# --- the Q3 simulation: the best built-in policy balances within 10% ------------------


def load_balance_sim():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "balance_sim.py"
    spec = importlib.util.spec_from_file_location("balance_sim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_balance_simulation_performance_aware_meets_q3() -> None:
    rows = {row["policy"]: row for row in load_balance_sim().run(quick=True)}
    best = rows["performance_aware"]
    assert best["median_imbalance"] <= 0.10
    policies = [r for name, r in rows.items() if name not in ("lpt_oracle", "least_loaded (RLinf)")]
    assert best["median_imbalance"] == min(r["median_imbalance"] for r in policies)
    # the references: the LPT oracle (reorders, knows all) below it, RLinf's least-loaded far above
    assert rows["lpt_oracle"]["median_imbalance"] <= best["median_imbalance"]
    assert rows["least_loaded (RLinf)"]["median_imbalance"] > 0.5
    # Speed-blind policies leave the fast consumer idle: far from balanced.
    assert rows["shortest_queue"]["median_imbalance"] > 0.5


def test_select_checked_takes_any_integer_index() -> None:
    """numpy's integers are indices too (a policy returning ``np.argmax(...)``)."""
    for index in (np.int64(1), np.uint8(1), np.intp(1)):
        choice = select_checked(NeedsArgs(index), ITEM, consumers(pending_weight=[0.0, 0.0]))
        assert choice == 1 and type(choice) is int
