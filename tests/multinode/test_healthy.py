"""rlinf across emulated machines when nothing goes wrong: workers on three nodes find
each other through a standalone manager, pick shared memory within a node and TCP
between nodes (the stream link for small messages, bulk streams for large ones), and carry point-to-point, collective and channel traffic intact."""

from __future__ import annotations

import pytest

from .agents import MiB

pytestmark = pytest.mark.multiproc


def test_registration_and_routing_across_nodes(nodes):
    n = nodes(3)
    n.start_manager(0)
    on = {"RLINF_TCP_STREAM": "1"}      # (the default; said here so the test holds if it changes)
    echoes = [n.agent(0, "echo", "a:1", env=on), n.agent(1, "echo", "b:0", env=on), n.agent(2, "echo", "c:0", env=on)]
    probe = n.agent(0, "route_probe", "a:0", targets=["a:1", "b:0", "c:0"], env=on)
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
    # the other messages: the stream link, over a Unix socket within the node and over
    # TCP (sealed: encryption is on by default) to the advertised endpoint between nodes
    links = out["links"]
    assert links["a:1"][0] == "StreamLink" and links["a:1"][1].startswith("unix://"), links
    for a in ("b:0", "c:0"):
        assert links[a] == ["StreamLink", roster[a]["endpoints"]["tcp_stream"]], links
        assert links[a][1].startswith(f"tcp://{n[where[a]].address}:"), links


def test_p2p_round_trips_between_nodes(nodes):
    n = nodes(2)
    n.start_manager(0)
    echo = n.agent(1, "echo", "b:0")
    sizes = [16, 300 << 10, 3 * MiB, 100]
    out = n.agent(0, "ping_pong", "a:0", peer="b:0", sizes=sizes, rounds=40).expect("result", timeout=60)
    assert out["rounds"] == 40
    assert echo.expect("result", timeout=30)["served"] == 40


def test_collectives_over_a_group_spanning_three_nodes(nodes):
    n = nodes(3)
    n.start_manager(0)
    placement = {"a:0": 0, "a:1": 0, "b:0": 1, "c:0": 2}
    members = list(placement)
    workers = [n.agent(node, "collective", address, members=members, root="b:0", nbytes=4 * MiB)
               for address, node in placement.items()]
    for address, w in zip(members, workers):
        checks = w.expect("result", timeout=90)["checks"]
        assert all(checks.values()), f"{address}: {checks}"


def test_a_channel_spanning_nodes_delivers_every_item_once(nodes):
    """Channel served on node 0; producers on nodes 1 and 2; consumers on nodes 0 and 1.
    Producers stay until the items are consumed (their clean exit is a fault test)."""
    n = nodes(3)
    n.start_manager(0)
    sizes = [64, 512 << 10, 2 * MiB, 1000]
    owner = n.agent(0, "channel_owner", "owner:0", name="items")
    owner.expect("created", timeout=60)
    consumers = [n.agent(i, "consume", f"consumer:{i}", name="items", nbytes=sizes) for i in (0, 1)]
    for c in consumers:
        c.expect("attached", timeout=60)
    producers = [n.agent(i, "produce", f"producer:{i}", name="items", n=60, nbytes=sizes, wait_to_exit=True)
                 for i in (1, 2)]
    for p in producers:
        p.expect("produced", timeout=60)
    owner.tell("close")
    got = [item for c in consumers for item in c.expect("result", timeout=60)["got"]]
    for p in producers + [owner]:
        p.tell("exit")
    keys = sorted((src, i) for src, i, _ in got)
    assert keys == sorted((f"producer:{p}", i) for p in (1, 2) for i in range(60)), "lost or duplicated items"
    assert all(ok for _, _, ok in got), "corrupt items"
    for p in producers + [owner]:
        p.expect("result", timeout=30)
