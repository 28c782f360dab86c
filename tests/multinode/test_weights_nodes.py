"""The weight store across emulated machines (issue 25): pullers on other nodes get every
version intact, and each node receives a version's bytes once (its first puller relays
them to the others through shared memory)."""

from __future__ import annotations

import re
import time

import pytest

from .agents import MiB

pytestmark = pytest.mark.multiproc

_AGENTS = "tests.multinode.agents_weights"


def test_each_node_receives_a_version_once(nodes):
    n = nodes(3)
    n.start_manager(0)
    size, versions = 8 * MiB, 2
    trainer = n.agent(0, f"{_AGENTS}:publish", "trainer:0", nbytes=size, versions=versions)
    assert trainer.expect("published", timeout=60)["version"] == 1
    pullers = [n.agent(node, f"{_AGENTS}:pull", f"rollout:{i}", nbytes=size, versions=versions)
               for i, node in enumerate((1, 1, 2))]
    for v in range(1, versions + 1):
        if v > 1:
            trainer.tell("next")
            assert trainer.expect("published", timeout=60)["version"] == v
            for p in pullers:
                p.tell("again")
        got = [p.expect("pulled", timeout=60) for p in pullers]
        assert all(g["version"] == v and g["intact"] for g in got), got
        trainer.tell("stats")
        by_path = trainer.expect("stats", timeout=30)["bytes_by_path"]
        # per version: node 1 and node 2 once over the network, node 1's second puller
        # from its relay's shared memory
        assert by_path == {"net": 2 * v * size, "shm": v * size}, by_path
    for p in pullers:
        p.tell("exit")
        p.expect("result", timeout=30)
    trainer.tell("exit")
    trainer.expect("result", timeout=30)


def _in_order(trainer, pullers) -> None:
    """Start the pullers' next pull one after the other, each once the previous one
    waits at the directory: the directory routes them in this order (the first one of
    a node relays it; the relays form a chain in this order)."""
    for k, p in enumerate(pullers, 1):
        p.tell("again")
        deadline = time.monotonic() + 30
        while True:
            trainer.tell("stats")
            if trainer.expect("stats", timeout=30)["waiting"] >= k:
                break
            assert time.monotonic() < deadline, f"{k} pulls never waited at the directory"
            time.sleep(0.05)        # polling the directory's count, not waiting for time to pass


def test_a_chain_of_three_nodes_brings_every_version_to_every_puller_once_per_node(nodes):
    n = nodes(4)
    n.start_manager(0)
    size, versions = 24 * MiB, 3
    trainer = n.agent(0, f"{_AGENTS}:publish", "trainer:0", nbytes=size, versions=versions)
    pullers = [n.agent(1 + i // 2, f"{_AGENTS}:pull", f"rollout:{i}", nbytes=size, versions=versions)
               for i in range(6)]
    for v in range(1, versions + 1):
        if v > 1:
            _in_order(trainer, pullers)
            trainer.tell("next")
        assert trainer.expect("published", timeout=60)["version"] == v
        got = [p.expect("pulled", timeout=90) for p in pullers]
        assert all(g["version"] == v and g["intact"] for g in got), got
        trainer.tell("stats")
        # per version: each of the 3 nodes once over the network (its relay), its second
        # puller from the relay's shared memory
        assert trainer.expect("stats", timeout=30)["bytes_by_path"] == {"net": 3 * v * size, "shm": 3 * v * size}
    for p in pullers:
        p.tell("exit")
        p.expect("result", timeout=30)
    trainer.tell("exit")
    trainer.expect("result", timeout=30)


def _relay_buckets(n, i: int) -> set[str]:
    return set(re.findall(r"^\S*-w[0-9a-f]{6}-\d+$", n.sh(i, "ls /dev/shm"), re.M))


def test_a_relay_killed_mid_version_leaves_the_others_an_intact_version(nodes):
    """Node 1's first puller relays version 2 to its node and to the next node of the
    chain; killed while it streams, the version still reaches every other puller
    intact: node 1's second puller and the next relay ask again and are routed around
    it."""
    n = nodes(4)
    n.start_manager(0)
    size = 24 * MiB
    trainer = n.agent(0, f"{_AGENTS}:publish", "trainer:0", nbytes=size, versions=2, small_first=True)
    relay, *others = [n.agent(node, f"{_AGENTS}:pull", f"rollout:{i}", nbytes=size, versions=2, small_first=True)
                      for i, node in enumerate((1, 1, 2, 3))]
    assert trainer.expect("published", timeout=60)["version"] == 1
    assert all(p.expect("pulled", timeout=60)["intact"] for p in [relay, *others])
    before = _relay_buckets(n, 2)
    n.rate_limit(1, "40mbit")            # the relay's stream lasts seconds: killed in the middle
    _in_order(trainer, [relay, *others])
    trainer.tell("next")
    assert trainer.expect("published", timeout=60)["version"] == 2
    deadline = time.monotonic() + 30
    # node 2's relay takes its bucket for version 2 (larger: a new one) once node 1's
    # relay started: then it streams from it
    while not _relay_buckets(n, 2) - before:
        assert time.monotonic() < deadline, "node 2's relay never started"
        time.sleep(0.05)
    relay.kill()
    got = [p.expect("pulled", timeout=90) for p in others]
    assert all(g["version"] == 2 and g["intact"] for g in got), got
    for p in others:
        p.tell("exit")
        p.expect("result", timeout=30)
    trainer.tell("exit")
    trainer.expect("result", timeout=30)


def test_the_publisher_killed_mid_version_fails_every_puller_of_the_chain_clearly(nodes):
    """The holder dies while the relays stream version 2 (its link is slow): every
    puller, relay, follower or downstream relay, gets PeerLostError within its timeout,
    none a version."""
    n = nodes(4)
    n.start_manager(0)
    size = 24 * MiB
    trainer = n.agent(0, f"{_AGENTS}:publish", "trainer:0", nbytes=size, versions=2, small_first=True)
    pullers = [n.agent(node, f"{_AGENTS}:pull", f"rollout:{i}", nbytes=size, versions=2, small_first=True)
               for i, node in enumerate((1, 1, 2, 3))]
    assert trainer.expect("published", timeout=60)["version"] == 1
    assert all(p.expect("pulled", timeout=60)["intact"] for p in pullers)
    before = _relay_buckets(n, 2)
    n.rate_limit(0, "40mbit")            # the holder's stream lasts seconds: killed in the middle
    _in_order(trainer, pullers)
    trainer.tell("next")
    assert trainer.expect("published", timeout=60)["version"] == 2
    deadline = time.monotonic() + 30
    while not _relay_buckets(n, 2) - before:          # the chain streams: node 2's relay started
        assert time.monotonic() < deadline, "node 2's relay never started"
        time.sleep(0.05)
    trainer.kill()
    for p in pullers:
        assert "weights.nodes:0" in p.expect("lost", timeout=60)["error"]      # the publisher, named
        p.tell("exit")
        p.expect("result", timeout=30)
