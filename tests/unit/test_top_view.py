"""``rlinf top``'s channel rows, from the statistics a channel server reports (no processes)."""

from __future__ import annotations

import json

import msgpack
import pytest
from rich.console import Console

from rlinf.tools import top
from rlinf.channel import ChannelStats
from rlinf.channel._core import ChannelCore


def _reported_stats() -> dict:
    """What a channel server sends with its heartbeats: three items put, one handed to a
    consumer (pending with it), two still queued; packed and unpacked as on the control
    socket."""
    core = ChannelCore("rollouts", send=lambda h, op: None, clock=lambda: 100.0)
    for src in ("p:0", "learner:0"):
        core.handle_ops(src, 1, [("hello", 1, "inc-" + src, "node-a", src)])
    core.handle_ops("p:0", 1, [("put", None, w, 0, b"x") for w in (1.5, 2.0, 4.0)])
    core.handle_ops("learner:0", 1, [("get", 2, None, 1, None, None)])
    report = ChannelStats.from_dict(core.stats()).to_dict()
    return msgpack.unpackb(msgpack.packb({"channel": report}, use_bin_type=True), raw=False)["channel"]


def _snapshot(channel_stats: dict) -> dict:
    return {"manager": "tcp://127.0.0.1:1", "version": 1, "events": [], "workers": [
        {"address": "channel.rollouts:0", "incarnation": "y", "node_id": "node-a", "pid": 8, "age": 4.0,
         "devices": [], "silence": 0.1, "meta": {"kind": "channel", "channel": "rollouts"},
         "stats": {"uptime": 4.0, "msgs_in": 3, "msgs_out": 1, "bytes_in": 0, "bytes_out": 0,
                   "channel": channel_stats}}]}


def test_channel_stats_to_dict_round_trips_with_named_fields():
    report = _reported_stats()
    assert report["length"] == 2 and report["weight"] == pytest.approx(6.0)
    [consumer] = report["consumers"]
    assert consumer["name"] == "learner:0" and consumer["pending_count"] == 1
    assert consumer["pending_weight"] == pytest.approx(1.5)
    assert ChannelStats.from_dict(report).to_dict() == report
    json.dumps(report)                                      # what --once --json prints


@pytest.mark.parametrize("positional", [False, True], ids=["dicts", "wire-rows"])
def test_render_shows_channel_length_weight_and_consumers(positional):
    report = _reported_stats()
    if positional:    # the rows of the channel's own wire format are read too
        report["consumers"] = [list(c.values()) for c in report["consumers"]]
    view = top.View()
    view.update(_snapshot(report))
    console = Console(width=200, record=True)
    console.print(top.render(view))
    text = console.export_text()
    [row] = [line for line in text.splitlines() if "channel.rollouts:0" in line and "rollouts " in line]
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:4] == ["rollouts", "channel.rollouts:0", "2", "6"], cells
    assert cells[4].startswith("learner:0 pending 1 (w 1.5) done 0 speed - busy 0%"), cells
    assert top.to_json(_snapshot(report))["channels"][0]["channel"]["length"] == 2


def test_render_shows_versions_staleness_and_admissions():
    """A channel for asynchronous RL: its version, stale drops and admissions, and the
    staleness of what each consumer got."""
    core = ChannelCore("rollouts", send=lambda h, op: None, clock=lambda: 100.0, max_staleness=1, batch_size=4)
    for src in ("p:0", "learner:0"):
        core.handle_ops(src, 1, [("hello", 1, "inc-" + src, "node-a", src)])
    core.handle_ops("p:0", 1, [("admit", 7, 0)] + [("put", None, 1.0, 0, b"x", v, 0) for v in (0, 1, 2)])
    core.handle_ops("learner:0", 1, [("advance", 3, 2), ("get", 2, None, 5, None, None)])
    report = msgpack.unpackb(msgpack.packb(ChannelStats.from_dict(core.stats()).to_dict(), use_bin_type=True),
                             raw=False)
    view = top.View()
    view.update(_snapshot(report))
    console = Console(width=300, record=True)
    console.print(top.render(view))
    text = console.export_text()
    assert "version 2 (max staleness 1): stale dropped 1, admitted 1 (0 waiting)" in text
    assert "stale mean 0.50 max 1" in text


def test_render_shows_a_sender_blocked_on_a_receivers_window():
    """A worker whose sends wait for a receiver's credit (flow control) says so."""
    snap = _snapshot(_reported_stats())
    snap["workers"].append({"address": "rollout:0", "incarnation": "z", "node_id": "node-a", "pid": 9, "age": 2.0,
                            "devices": [], "silence": 0.1, "meta": {},
                            "stats": {"uptime": 2.0, "waiting_for_credit": {"trainer:0": 3, "trainer:1": 1}}})
    view = top.View()
    view.update(snap)
    console = Console(width=200, record=True)
    console.print(top.render(view))
    [row] = [line for line in console.export_text().splitlines() if line.lstrip("│ ").startswith("rollout:0")]
    assert "blocked on trainer:0 (3) +1" in row, row
