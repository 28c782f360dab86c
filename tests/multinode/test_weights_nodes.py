"""The weight store across emulated machines (issue 25): pullers on other nodes get every
version intact, and each node receives a version's bytes once (its first puller relays
them to the others through shared memory)."""

from __future__ import annotations

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
