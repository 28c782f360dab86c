"""The timeline trace without processes: the clock estimate, the recorder's file (the
Chrome trace event format) and the merge (offsets applied, sends joined to receives,
events sorted, processes and lanes named)."""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
import time
import types

import pytest

from rlinf import trace
from rlinf.config import Settings
from rlinf.control.clock import ClockSync
from rlinf.core import _trace, routing, wire
from rlinf.core._outmsg import OutMessage
from rlinf.core._trace import LANES, Recorder
from rlinf.core.communicator import CoreCommunicator
from rlinf.tools.trace import load, merge, merge_dir


# ----------------------------------------------------------------------------- the clock
def test_the_clock_takes_the_midpoint_of_the_shortest_round_trip():
    clock = ClockSync()
    assert clock.offset is None
    clock.sample(10.0, 15.5, 11.0)           # midpoint 10.5: the manager is 5 s ahead, +- 0.5 s
    assert clock.offset == (5.0, 1.0)
    clock.sample(20.0, 26.0, 22.0)           # a longer round trip: a looser bound, not kept
    assert clock.offset == (5.0, 1.0)
    clock.sample(30.0, 35.15, 30.1)          # a shorter one: kept
    assert clock.offset[0] == pytest.approx(5.1) and clock.offset[1] == pytest.approx(0.1)
    clock.sample(40.0, 0.0, 39.0)            # our clock stepped back: ignored
    assert clock.offset[1] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- the recorder
def _user(tag, nbytes: int, transport: str = routing.INLINE, future=None) -> OutMessage:
    return OutMessage(wire.plain_entry(wire.USER, tag, b"hdr", None), [], nbytes, future, False, transport=transport)


def test_the_recorder_writes_chrome_trace_events(tmp_path, monkeypatch):
    ticks = itertools.count(time.time_ns(), 1_000)      # 1 us per reading: a burst stays a burst under load
    monkeypatch.setattr(_trace, "_time_ns", lambda: next(ticks))

    async def scenario() -> Recorder:
        recorder = Recorder(str(tmp_path / "t"), "a:0", "inc-a-0123456789", clock=lambda: (0.002, 0.0005))
        recorder.start(asyncio.get_running_loop())
        outbox = types.SimpleNamespace(address="b:0", link=types.SimpleNamespace(kind="zmq"))   # a ZeroMQ link
        recorder.sent(outbox, _user(1, 100))
        recorder.sent(outbox, _user(1, 200))          # a burst: one event, a run of two
        recorder.sent(outbox, _user("coll:0", 1 << 20, routing.SHM))
        recorder.sent(outbox, OutMessage(wire.system_entry("shm"), [], 10, None, False))   # SYSTEM: not traced
        done = asyncio.get_running_loop().create_future()
        recorder.sent(outbox, _user(2, 1 << 21, routing.BULK, done))
        recorder.sent(types.SimpleNamespace(address="c:0", link=None), _user(1, 50))    # link not dialled yet
        recorder.received("b:0", "inc-b", wire.Entry(wire.USER, 1, b"hh", [1]), 40)
        start = recorder.now()
        done.set_result(None)
        await asyncio.sleep(0)        # the send's span ends when its future completes
        recorder.span("collective", "broadcast", start, tag="g:0", root="a:0", members=2)
        await recorder.aclose()
        await recorder.aclose()       # idempotent
        return recorder

    recorder = asyncio.run(scenario())
    text = pathlib.Path(recorder.path).read_text()
    assert text.endswith("]\n")
    events = json.loads(text)                        # the file is one valid JSON array
    meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "a:0"}
    assert meta[("rlinf_process", 0)]["incarnation"] == "inc-a-0123456789"
    assert {meta[("thread_name", tid)]["name"] for tid in LANES} == set(LANES.values())
    assert meta[("rlinf_clock", 0)] == {"offset_us": pytest.approx(2000.0), "rtt_us": pytest.approx(500.0)}
    assert events[-1]["name"] == "rlinf_clock"       # last: the best estimate

    timed = [e for e in events if e["ph"] == "X"]
    assert all(e["pid"] == events[0]["pid"] and e["dur"] >= 1.0 and e["ts"] > 1e15 for e in timed)
    sends = [e["args"] for e in timed if e["name"] == "send"]
    assert [(s["peer"], s["tag"], s["n"], s["count"], s["bytes"], s["path"]) for s in sends] == [
        ("b:0", 1, 0, 2, 300, "zmq"), ("b:0", "coll:0", 0, 1, 1 << 20, "shm"), ("b:0", 2, 0, 1, 1 << 21, "bulk"),
        ("c:0", 1, 0, 1, 50, "zmq")]
    recv = next(e["args"] for e in timed if e["name"] == "recv")
    assert recv == {"peer": "b:0", "tag": 1, "bytes": 42, "path": "", "n": 0, "count": 1, "inc": "inc-b"}
    span = next(e for e in timed if e["tid"] == 3)
    assert span["name"] == "broadcast" and span["args"] == {"tag": "g:0", "root": "a:0", "members": 2}


def test_tracing_is_off_unless_asked(tmp_path):
    off = CoreCommunicator("a:0", manager="tcp://127.0.0.1:9", token="t", settings=Settings())
    assert off.internal.trace is None
    on = CoreCommunicator("a:0", manager="tcp://127.0.0.1:9", token="t",
                          settings=Settings.from_env({"RLINF_TRACE": str(tmp_path / "d")}))
    assert isinstance(on.internal.trace, Recorder)
    assert on.internal.trace.path.startswith(str(tmp_path / "d"))


def test_the_switch_sets_the_variable_children_inherit(tmp_path, monkeypatch):
    monkeypatch.setenv("RLINF_TRACE", "")
    path = trace(tmp_path / "x")
    assert path == str(tmp_path / "x") and (tmp_path / "x").is_dir()
    assert Settings.from_env().trace == path
    assert trace(None) is None and Settings.from_env().trace is None


# ----------------------------------------------------------------------------- the merge
def _process(address: str, inc: str, pid: int, offset_us: float | None, events: list[dict]) -> list[dict]:
    head = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": address}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "rlinf_process",
             "args": {"address": address, "incarnation": inc, "host": "h", "pid": pid}},
            {"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "send"}}]
    body = [{"ph": "X", "pid": pid, "cat": "rlinf", "dur": 1.0, **e} for e in events]
    clock = [] if offset_us is None else [
        {"ph": "M", "pid": pid, "tid": 0, "name": "rlinf_clock", "args": {"offset_us": offset_us + 5, "rtt_us": 9}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "rlinf_clock", "args": {"offset_us": offset_us, "rtt_us": 3}}]
    return head + body + clock


def _send(ts, peer, tag, n, path="zmq"):
    return {"tid": 1, "ts": ts, "name": "send", "args": {"peer": peer, "tag": tag, "bytes": 8, "path": path, "n": n}}


def _recv(ts, peer, inc, tag, n, path=""):
    return {"tid": 2, "ts": ts, "name": "recv",
            "args": {"peer": peer, "inc": inc, "tag": tag, "bytes": 8, "path": path, "n": n}}


def test_merge_aligns_clocks_joins_sends_to_receives_and_sorts():
    b = _process("b:0", "ib", 22, -500.0, [_recv(2600.0, "a:0", "ia", 1, 0), _recv(2700.0, "a:0", "ia", 1, 1),
                                          _recv(2800.0, "a:0", "ia", "g:1", 0, "shm"),
                                          _send(2900.0, "a:0", 5, 0)])
    a = _process("a:0", "ia", 11, 1000.0, [_send(1000.0, "b:0", 1, 0), _send(1100.0, "b:0", 1, 1, "stream"),
                                          _send(1200.0, "b:0", "g:1", 0, "shm"), _send(1300.0, "b:0", 1, 2),
                                          {"tid": 3, "ts": 1050.0, "name": "broadcast", "args": {}}])
    merged = merge([b, a])
    events = merged["traceEvents"]
    json.dumps(merged)                     # plain JSON
    meta = [e for e in events if e["ph"] == "M"]
    assert events[:len(meta)] == meta      # metadata first, then time order
    timed = [e["ts"] for e in events[len(meta):]]
    assert timed == sorted(timed)
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {1: "a:0 (pid 11 on h)", 2: "b:0 (pid 22 on h)"}     # pids by address
    assert {(e["pid"], e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"} == \
        {(1, 1, "send"), (2, 1, "send")}
    assert not any(e["name"] in ("rlinf_clock", "rlinf_process") for e in meta)

    sends = {(e["args"]["tag"], e["args"]["n"]): e for e in events if e["name"] == "send" and e["pid"] == 1}
    recvs = {(e["args"]["tag"], e["args"]["n"]): e for e in events if e["name"] == "recv"}
    assert sends[(1, 0)]["ts"] == 2000.0 and recvs[(1, 0)]["ts"] == 2100.0     # offsets: the last record's
    for key in [(1, 0), (1, 1), ("g:1", 0)]:
        assert sends[key]["args"]["flow"] == recvs[key]["args"]["flow"]
    assert recvs[(1, 1)]["args"]["path"] == "stream"      # taken from its send
    assert recvs[("g:1", 0)]["args"]["path"] == "shm"
    assert "flow" not in sends[(1, 2)]["args"]            # never received
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(flows) == 6 and {e["id"] for e in flows} == {1, 2, 3}
    start = next(e for e in flows if e["ph"] == "s" and e["id"] == sends[(1, 0)]["args"]["flow"])
    assert (start["pid"], start["tid"], start["ts"]) == (1, 1, 2000.0)
    assert all(e["bp"] == "e" for e in flows if e["ph"] == "f")

    summary = merged["metadata"]["rlinf"]
    assert (summary["sends"], summary["receives"], summary["unmatched_sends"], summary["unmatched_receives"]) == \
        (5, 3, 2, 0)
    assert [(p["address"], p["offset_us"], p["merged_pid"]) for p in summary["processes"]] == \
        [("a:0", 1000.0, 1), ("b:0", -500.0, 2)]
    assert summary["unaligned"] == []


def test_merge_joins_runs_of_messages_by_the_ones_they_share():
    def run(event, count):
        event["args"]["count"] = count
        return event

    a = _process("a:0", "ia", 11, 0.0, [run(_send(10.0, "b:0", 1, 0), 3), run(_send(20.0, "b:0", 1, 3), 2)])
    b = _process("b:0", "ib", 22, 0.0, [run(_recv(15.0, "a:0", "ia", 1, 0), 1), run(_recv(16.0, "a:0", "ia", 1, 1), 3)])
    summary = merge([a, b])["metadata"]["rlinf"]
    # messages 0 | 1 2 | 3 of the receive runs: three flows; message 4 never arrived
    assert (summary["sends"], summary["receives"], summary["flows"]) == (5, 4, 3)
    assert (summary["unmatched_sends"], summary["unmatched_receives"]) == (1, 0)


def test_merge_leaves_a_process_without_a_clock_where_it_is():
    merged = merge([_process("a:0", "ia", 11, None, [_send(10.0, "b:0", 1, 0)])])
    assert merged["metadata"]["rlinf"]["unaligned"] == ["a:0"]
    assert next(e for e in merged["traceEvents"] if e["name"] == "send")["ts"] == 10.0


def test_load_reads_an_unterminated_file_and_refuses_others(tmp_path):
    events = _process("a:0", "ia", 11, 0.0, [_send(10.0, "b:0", 1, 0)])
    cut = tmp_path / "cut.json"          # what a process that died leaves
    cut.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in events))
    assert load(cut) == events
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a trace file"):
        load(bad)
    with pytest.raises(ValueError, match="no trace files"):
        merge_dir(tmp_path / "empty", tmp_path / "out.json")
