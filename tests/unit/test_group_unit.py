"""Pure parts of the collectives and of resharding: membership, algorithm choice, plans,
the split rule, reductions and structure slicing. No processes, no sockets."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

from rlinf.collectives import group as G
from rlinf.collectives import reshard as R


class _Stub:
    """Stands in for a Communicator: a Group only reads ``internal.address`` until it is used."""

    class _Core:
        def __init__(self, address: str) -> None:
            self.address = address

    def __init__(self, address: str) -> None:
        self.internal = self._Core(address)


_stub = _Stub


# -- membership ----------------------------------------------------------------------------
def test_members_are_canonical_whatever_the_order():
    addresses = ["b:1", "a:10", "a:2", "driver:0"]
    orders = {G.canonical_members(list(p)) for p in itertools.permutations(addresses)}
    assert orders == {("a:2", "a:10", "b:1", "driver:0")}        # numeric ranks
    g = G.Group(_stub("a:10"), addresses)
    assert (g.members, g.rank, g.size) == (["a:2", "a:10", "b:1", "driver:0"], 1, 4)
    assert g.id == G.Group(_stub("b:1"), addresses[::-1]).id == G.group_id(g.members)
    assert G.group_id(["a:0", "b:0"]) != G.group_id(["a:0", "b:1"])
    assert "size=4" in repr(g) and "rank=1" in repr(g)


@pytest.mark.parametrize("addresses, error, match", [
    ("a:0", TypeError, "list of worker addresses"),
    ([], ValueError, "at least one"),
    (["a:0", "a:0"], ValueError, "duplicate"),
    (["a:0", "nope"], ValueError, "group:rank"),
    (["a:0", 3], TypeError, "str"),
    (["b:0", "c:0"], ValueError, "not a member"),
])
def test_bad_groups_are_refused(addresses, error, match):
    with pytest.raises(error, match=match):
        G.Group(_stub("a:0"), addresses)


# -- algorithm choice and plans ----------------------------------------------------------
def test_broadcast_algorithm_by_size_and_group_size():
    assert G.choose_broadcast(100, 3) == "direct"
    assert G.choose_broadcast(100, G.TREE_MIN_MEMBERS) == "tree"
    assert G.choose_broadcast(G.LARGE_BROADCAST - 1, 4) == "direct"
    assert G.choose_broadcast(G.LARGE_BROADCAST, 2) == "topology"
    assert G.choose_broadcast(64 << 20, 64) == "topology"


@pytest.mark.parametrize("n", range(1, 40))
def test_binomial_tree_reaches_everyone_once(n):
    parent = {}
    for rel in range(n):
        for child in G.tree_children(rel, n):
            assert child not in parent and child > rel
            parent[child] = rel
    assert set(parent) == set(range(1, n))
    depth = lambda r: 0 if r == 0 else 1 + depth(parent[r])   # noqa: E731
    assert max(map(depth, range(n))) <= max(1, (n - 1).bit_length())
    if n > 1:   # the biggest subtree is served first
        assert G.tree_children(0, n)[0] == 1 << ((n - 1).bit_length() - 1)


def test_node_plan_one_copy_per_node():
    nodes = {"a:0": "x", "a:1": "y", "b:0": "x", "b:1": "y", "c:0": "z", "d:0": None}
    members = sorted(nodes, key=lambda a: (a.split(":")[0], int(a.split(":")[1])))
    local, chain, locals_ = G.node_plan(members, "b:0", nodes.get)
    assert local == ["a:0"]                          # the root's node
    assert chain == ["a:1", "c:0", "d:0"]            # lowest member of each other node, in order
    assert locals_ == {"a:1": ["b:1"], "c:0": [], "d:0": []}
    # a root that is not the lowest of its node is still its node's source
    local, chain, _ = G.node_plan(members, "b:1", nodes.get)
    assert local == ["a:1"] and chain == ["a:0", "c:0", "d:0"]
    # unknown nodes are nodes of their own; one node means no chain
    assert G.node_plan(["a:0", "b:0"], "a:0", lambda a: None) == ([], ["b:0"], {"b:0": []})
    assert G.node_plan(["a:0", "b:0"], "b:0", lambda a: "n") == (["a:0"], [], {})


def test_chunk_plan_covers_every_byte():
    sizes = [0, 5, G.CHUNK, 2 * G.CHUNK + 3]
    plan = G.chunk_plan(sizes)
    covered = collections.defaultdict(int)
    for i, off, length in plan:
        assert 0 < length <= G.CHUNK and off == covered[i]
        covered[i] += length
    assert [covered[i] for i in range(len(sizes))] == sizes
    assert len(plan) == 1 + 1 + 3


@pytest.mark.parametrize("length, n", [(0, 3), (1, 3), (10, 3), (12, 4), (7, 1), (5, 8)])
def test_split_rule_is_array_split(length, n):
    expected = [len(p) for p in np.array_split(np.arange(length), n)]
    assert [hi - lo for lo, hi in G.split_bounds(length, n)] == expected
    assert R.split_sizes(length, n) == expected
    assert G.split_bounds(length, n)[-1][1] == length


# -- reductions ------------------------------------------------------------------------------
def test_reduce_in_order_numpy_and_torch():
    parts = [np.array([1.0, 5.0, -2.0]), np.array([3.0, 0.0, 4.0]), np.array([2.0, 2.0, 2.0])]
    assert np.array_equal(G.reduce_in_order(parts, "sum"), [6.0, 7.0, 4.0])
    assert np.array_equal(G.reduce_in_order(parts, "mean"), [2.0, 7 / 3, 4 / 3])
    assert np.array_equal(G.reduce_in_order(parts, "max"), [3.0, 5.0, 4.0])
    assert np.array_equal(G.reduce_in_order(parts, "min"), [1.0, 0.0, -2.0])
    assert np.array_equal(parts[0], [1.0, 5.0, -2.0])            # inputs untouched
    tparts = [torch.tensor(p, dtype=torch.bfloat16) for p in parts]
    got = G.reduce_in_order(tparts, "max")
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.tensor([3.0, 5.0, 4.0], dtype=torch.bfloat16))
    flags = [torch.tensor([True, False, False]), torch.tensor([False, False, True])]
    assert G.reduce_in_order(flags, "sum").tolist() == [True, False, True]
    assert G.reduce_in_order([np.array([True, False]), np.array([False, False])], "sum").tolist() == [True, False]


def test_reduction_order_makes_results_identical():
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal(1000).astype(np.float32) * 10 ** k for k in range(5)]
    once = G.reduce_in_order(parts, "sum")
    assert np.array_equal(once, G.reduce_in_order(list(parts), "sum"))


# -- resharding: plan and structures ------------------------------------------------------------
def test_transfer_plan_matches_the_split_rule():
    rng = random.Random(1234)
    print("seed 1234")
    for _ in range(300):
        counts = [rng.randint(0, 6) for _ in range(rng.randint(1, 5))]
        n_dst = rng.randint(1, 5)
        plan = R.transfer_plan(counts, n_dst)
        offsets = np.cumsum([0] + counts)
        parts = np.array_split(np.arange(sum(counts)), n_dst)
        for j, part in enumerate(parts):
            rows = [r for s, d, lo, hi in plan if d == j for r in range(offsets[s] + lo, offsets[s] + hi)]
            assert rows == list(part), (counts, n_dst, j)
            pieces = [(s, lo, hi) for s, d, lo, hi in plan if d == j]
            assert pieces == sorted(pieces)
            if not len(part):
                assert pieces == [(0, 0, 0)]      # source 0 sends the structure, no rows
            for s, lo, hi in pieces:
                assert 0 <= lo <= hi <= counts[s]


@dataclasses.dataclass(frozen=True)
class Step:
    obs: torch.Tensor
    note: str


Pair = collections.namedtuple("Pair", "left right")


def _shard(lo, hi):
    rows = np.arange(lo, hi)
    return {"step": Step(torch.tensor(rows)[:, None].repeat(1, 2), "n"),
            "pair": Pair(rows.astype(np.float32), [torch.tensor(rows, dtype=torch.bfloat16)]),
            "tuple": (rows * 2,), "k": 3}


def test_slice_and_merge_round_trip():
    whole = _shard(0, 9)
    assert R.batch_size(whole) == 9
    pieces = [R.slice_along(whole, lo, hi) for lo, hi in [(0, 4), (4, 4), (4, 9)]]
    assert R.batch_size(pieces[1]) == 0
    assert np.shares_memory(pieces[0]["pair"].left, whole["pair"].left)    # views, no copy
    merged = R.merge_along(pieces)
    assert type(merged["step"]) is Step and type(merged["pair"]) is Pair and merged["k"] == 3
    assert torch.equal(merged["step"].obs, whole["step"].obs)
    assert np.array_equal(merged["pair"].left, whole["pair"].left)
    assert torch.equal(merged["pair"].right[0], whole["pair"].right[0])
    assert np.array_equal(merged["tuple"][0], whole["tuple"][0])
    assert R.merge_along([whole]) is whole


def test_slice_along_other_dims():
    x = np.arange(24).reshape(2, 4, 3)
    assert R.batch_size({"x": x}, dim=1) == 4 and R.batch_size({"x": x}, dim=-1) == 3
    assert np.array_equal(R.slice_along(x, 1, 3, dim=1), x[:, 1:3])
    assert np.array_equal(R.merge_along([x[:, :1], x[:, 1:]], dim=1), x)


@pytest.mark.parametrize("bad, match", [
    ({"a": np.ones(2), "b": np.ones(3)}, "same size along dim"),
    ({"a": 1, "b": "x"}, "at least one"),
    ({"a": np.ones(())}, "no dimension"),
])
def test_bad_shards(bad, match):
    with pytest.raises(ValueError, match=match):
        R.batch_size(bad)


def test_merge_refuses_mismatched_structures():
    with pytest.raises(ValueError, match="different keys"):
        R.merge_along([{"a": np.ones(1)}, {"b": np.ones(1)}])
    with pytest.raises(ValueError, match="cannot be joined"):
        R.merge_along([np.ones((1, 2)), np.ones((1, 3))])
    with pytest.raises(ValueError, match="mix numpy arrays and torch tensors"):
        R.merge_along([np.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match="differ in structure"):
        R.merge_along([[np.ones(1)], (np.ones(1),)])
