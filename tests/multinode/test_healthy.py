"""rlinf across emulated machines when nothing goes wrong: workers on three nodes find
each other through a standalone manager, pick shared memory within a node and TCP
between nodes, and carry point-to-point, collective and channel traffic intact."""

from __future__ import annotations

import pytest

from .agents import MiB

pytestmark = pytest.mark.multiproc


def test_registration_and_routing_across_nodes(nodes):
    n = nodes(3)
    n.start_manager(0)
    echoes = [n.agent(0, "echo", "a:1"), n.agent(1, "echo", "b:0"), n.agent(2, "echo", "c:0")]
    probe = n.agent(0, "route_probe", "a:0", targets=["a:1", "b:0", "c:0"])
    out = probe.expect("result", timeout=60)
    peer_rosters = [e.expect("result", timeout=30)["roster"] for e in echoes]

    roster = out["roster"]
    where = {"a:1": 0, "b:0": 1, "c:0": 2}
    # every worker is known with the node it runs on, and reachable at that node's address
    # (not loopback: the manager is not on loopback, so the address on its subnet)
    for a, i in where.items():
        assert roster[a]["host"] == n[i].name
        assert roster[a]["endpoints"]["tcp"].startswith(f"tcp://{n[i].address}:"), roster[a]
    a0 = peer_rosters[0]["a:0"]
    assert a0["host"] == n[0].name and a0["endpoints"]["tcp"].startswith(f"tcp://{n[0].address}:")
    ids = {"a:0": a0["node_id"], **{a: roster[a]["node_id"] for a in ("a:1", "b:0", "c:0")}}
    assert ids["a:0"] == ids["a:1"]
    assert len({ids["a:0"], ids["b:0"], ids["c:0"]}) == 3, ids
    # a large message: shared memory within the node, the bulk TCP stream between nodes
    routes = out["routes"]
    assert "shm" in routes["a:1"] and "bulk" not in routes["a:1"], routes
    for a in ("b:0", "c:0"):
        assert "bulk" in routes[a] and "shm" not in routes[a], routes
