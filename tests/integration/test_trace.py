"""The timeline trace with real processes: ``rlinf.trace(DIR)`` in the driver, a
cluster whose workers send, run a collective and use a channel (whose server is a
process of its own), then ``rlinf trace merge``: one valid timeline, every send joined
to its receive, every process's clock offset recorded.

The worker target is module level: the spawn context imports this module.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import rlinf
from rlinf.tools import cli

pytestmark = pytest.mark.multiproc

MEMBERS = ["t:0", "t:1"]


async def traced(comm) -> str:
    """Rank 0 sends small messages and one through shared memory, and puts two items in
    a channel it creates; rank 1 receives and gets them; both run two collectives."""
    rank = MEMBERS.index(comm.address)
    peer = MEMBERS[1 - rank]
    if rank == 0:
        for i in range(3):
            await comm.send(i, peer, tag=1, timeout=30)
        await comm.send(np.ones(1 << 17), peer, tag=2, timeout=30)      # 1 MiB: shared memory
        channel = await comm.create_channel("trace-q")
        await channel.put({"step": 1}, timeout=30)
        await channel.put(np.arange(10), timeout=30)
    else:
        assert [await comm.recv(peer, tag=1, timeout=30) for _ in range(3)] == [0, 1, 2]
        assert (await comm.recv(peer, tag=2, timeout=30)).sum() == 1 << 17
        channel = await comm.channel("trace-q", timeout=30)
        assert (await channel.get(timeout=30))["step"] == 1
        assert (await channel.get(timeout=30)).sum() == 45
    group = comm.group(MEMBERS)
    total = await group.all_reduce(np.ones(4), timeout=30)
    assert total.tolist() == [2.0] * 4
    await group.barrier(timeout=30)        # rank 0's channel stays until rank 1 got its items
    return comm.address


async def test_a_traced_cluster_merges_into_one_timeline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLINF_TRACE", "")          # restored after the test, whatever rlinf.trace sets
    directory = rlinf.trace(tmp_path / "traces")
    async with asyncio.timeout(120):
        async with rlinf.Cluster() as cluster:
            group = await cluster.spawn(traced, "t", n=2)
            assert sorted(await group.join(timeout=60)) == MEMBERS
    rlinf.trace(None)
    files = sorted(p.name for p in (tmp_path / "traces").iterdir())
    # the two workers and the channel server (the cluster's own driver has no communicator)
    assert any(f.startswith("t_0-") for f in files) and any(f.startswith("t_1-") for f in files), files
    assert len(files) >= 3, files

    out = tmp_path / "trace.json"
    assert cli.main(["trace", "merge", directory, "-o", str(out)]) == 0
    assert "unmatched" in capsys.readouterr().out
    trace = json.loads(out.read_text())

    # what chrome://tracing and Perfetto need
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert {"ph", "pid", "name"} <= event.keys(), event
        if event["ph"] != "M":
            assert {"ts", "tid"} <= event.keys() and isinstance(event["ts"], (int, float)), event
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == len(files) and any(n.startswith("t:0 (pid ") for n in names.values())
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"send", "recv", "collective", "channel"} <= lanes

    summary = trace["metadata"]["rlinf"]
    assert summary["unaligned"] == [] and all(p["offset_us"] is not None for p in summary["processes"])
    assert summary["unmatched_sends"] == 0 and summary["unmatched_receives"] == 0, summary
    sends = [e for e in events if e["ph"] == "X" and e["name"] == "send"]
    receives = [e for e in events if e["ph"] == "X" and e["name"] == "recv"]
    assert summary["sends"] == summary["receives"] == sum(e["args"]["count"] for e in sends) > 5
    assert all("flow" in e["args"] for e in sends + receives)       # every send joined to its receive
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * summary["flows"] and summary["flows"] >= max(len(sends), len(receives))

    # the user messages, with their sizes and paths, sender and receiver alike
    by_pid = {name.split(" ")[0]: pid for pid, name in names.items()}
    user = [e["args"] for e in sends if e["pid"] == by_pid["t:0"] and e["args"]["peer"] == "t:1"
            and e["args"]["tag"] in (1, 2)]
    assert {(a["tag"], a["path"]) for a in user} == {(1, "stream"), (2, "shm")}
    assert sum(a["count"] for a in user if a["tag"] == 1) == 3         # (a burst may be one event)
    assert user[-1]["count"] == 1 and user[-1]["bytes"] >= 1 << 20
    got = [e for e in receives if e["pid"] == by_pid["t:1"] and e["args"]["peer"] == "t:0"
           and e["args"]["tag"] == 2]
    assert got and got[0]["args"]["path"] == "shm" and got[0]["args"]["bytes"] == user[-1]["bytes"]

    spans = {(e["pid"], e["name"]) for e in events if e["ph"] == "X" and e["tid"] in (3, 4)}
    for rank in MEMBERS:
        assert (by_pid[rank], "all_reduce") in spans and (by_pid[rank], "barrier") in spans
    assert (by_pid["t:0"], "channel.put") in spans and (by_pid["t:1"], "channel.get") in spans
