"""The timeline trace: the switch (``rlinf.trace``) and ``rlinf trace merge``.

``rlinf.trace("traces/")`` (or ``RLINF_TRACE=traces/``) makes every communicator created
afterwards in this process, and in the processes it starts (workers of a
:class:`rlinf.Cluster`, channel servers), write its timeline there: one Chrome trace
(Perfetto) JSON file per process (see :mod:`rlinf.core._trace` for what is in it).

``rlinf trace merge traces/ -o trace.json`` joins them into one timeline, which
``ui.perfetto.dev`` and ``chrome://tracing`` open: each process's timestamps moved to the
manager's clock by the offset its file records, each send joined to its receive by an
arrow (a flow), every process named by its address. :func:`merge` does it on parsed
events and is pure; :func:`load` reads one file (also one a crash left unterminated).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any, Iterable

__all__ = ["trace", "load", "merge", "merge_dir", "add_arguments", "run"]

_SEND_LANE, _RECV_LANE = 1, 2


def trace(directory: str | os.PathLike[str] | None) -> str | None:
    """Turn the timeline trace on (or off, with None) for communicators created from now
    on in this process and for the processes it starts.

    It sets ``RLINF_TRACE`` in this process's environment, which is where both read it:
    a communicator when it is created (``Settings.from_env``), a child process when it
    starts. A communicator created with ``settings=`` follows its own ``trace`` field.

    Args:
        directory: where each process writes its file (created if missing); None: off.

    Returns:
        The directory, made absolute (so children that change directory agree), or None.

    Raises:
        OSError: the directory cannot be created.
    """
    if directory is None:
        os.environ.pop("RLINF_TRACE", None)
        return None
    path = os.path.abspath(os.fspath(directory))
    os.makedirs(path, exist_ok=True)
    os.environ["RLINF_TRACE"] = path
    return path


def load(path: str | os.PathLike[str]) -> list[dict]:
    """The events of one process's trace file (the JSON array form; a file whose
    process died before it closed it lacks the closing bracket, as the format allows).

    Raises:
        ValueError: not a trace file.
    """
    text = pathlib.Path(path).read_text(encoding="utf-8").rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    try:
        events = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a trace file ({exc})") from None
    if isinstance(events, dict):
        events = events.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a trace file (no list of events)")
    return events


def _meta(events: list[dict], name: str) -> dict | None:
    """The args of the last metadata event ``name`` (the clock record is rewritten as
    the estimate improves: the last one is the best)."""
    found = None
    for event in events:
        if event.get("ph") == "M" and event.get("name") == name:
            found = event.get("args") or {}
    return found


def merge(processes: Iterable[list[dict]]) -> dict:
    """One timeline from the events of several processes' traces.

    Each process gets a pid of its own (1, 2, ... in the order of its address), named
    ``address (pid P on host)``; its timestamps move by its clock offset to the manager
    (``rlinf_clock``; none recorded: left as they are, and listed under
    ``metadata.rlinf.unaligned``). Each send is joined to its receive by a flow (``ph``
    ``s`` on the sender, ``f`` on the receiver, with one ``id``; both events get the
    first as ``args.flow``). An event may stand for a run of messages (``n`` the first,
    ``count`` how many, see :mod:`rlinf.core._trace`): a flow joins each send run to
    each receive run it shares messages with. A receive takes its send's path when it
    could not tell it (zmq, stream or bulk look the same once read). Events are sorted
    by time, metadata first.

    Args:
        processes: each process's events, as :func:`load` returns them.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {"rlinf": {...}}}``,
        where ``metadata.rlinf`` holds ``processes`` (address, incarnation, host, pid, and
        the ``offset_us`` / ``rtt_us`` applied), ``sends`` and ``receives`` (messages),
        ``flows``, ``unmatched_sends``, ``unmatched_receives`` (messages) and ``unaligned``.
    """
    loaded = []
    for events in processes:
        info = dict(_meta(events, "rlinf_process") or {})
        clock = _meta(events, "rlinf_clock") or {}
        info["offset_us"], info["rtt_us"] = clock.get("offset_us"), clock.get("rtt_us")
        loaded.append((info, events))
    loaded.sort(key=lambda item: (str(item[0].get("address", "")), str(item[0].get("incarnation", ""))))
    out: list[dict] = []
    runs: dict[tuple, tuple[list, list]] = {}       # (src, inc, dst, tag) -> (send runs, receive runs)
    described, unaligned = [], []
    for pid, (info, events) in enumerate(loaded, start=1):
        address, incarnation = info.get("address", f"process {pid}"), info.get("incarnation", "")
        offset = info["offset_us"]
        if offset is None:
            unaligned.append(address)
            offset = 0.0
        described.append({**info, "merged_pid": pid})
        label = f"{address} (pid {info.get('pid', '?')} on {info.get('host', '?')})"
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}})
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for event in events:
            phase, name = event.get("ph"), event.get("name")
            if phase == "M":
                if name == "thread_name":
                    out.append({**event, "pid": pid})
                continue
            event = {**event, "pid": pid, "args": dict(event.get("args") or {})}
            if "ts" in event:
                event["ts"] = event["ts"] + offset
            out.append(event)
            args = event["args"]
            if name == "send" and event.get("tid") == _SEND_LANE:
                key = (address, incarnation, args.get("peer"), _hashable(args.get("tag")))
                runs.setdefault(key, ([], []))[0].append(event)
            elif name == "recv" and event.get("tid") == _RECV_LANE:
                key = (args.get("peer"), args.get("inc"), address, _hashable(args.get("tag")))
                runs.setdefault(key, ([], []))[1].append(event)
    flows = sends = receives = matched = 0
    for send_runs, recv_runs in runs.values():
        sends += sum(_count(e) for e in send_runs)
        receives += sum(_count(e) for e in recv_runs)
        for send, recv, both in _overlaps(send_runs, recv_runs):
            flows += 1
            matched += both
            send["args"].setdefault("flow", flows)
            recv["args"].setdefault("flow", flows)
            if not recv["args"].get("path"):
                recv["args"]["path"] = send["args"].get("path", "")
            common = {"name": "message", "cat": "rlinf.flow", "id": flows}
            out.append({**common, "ph": "s", "pid": send["pid"], "tid": send["tid"], "ts": send["ts"]})
            out.append({**common, "ph": "f", "bp": "e", "pid": recv["pid"], "tid": recv["tid"], "ts": recv["ts"]})
    out.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    summary = {"processes": described, "sends": sends, "receives": receives, "flows": flows,
               "unmatched_sends": sends - matched, "unmatched_receives": receives - matched,
               "unaligned": unaligned}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": {"rlinf": summary}}


def _count(event: dict) -> int:
    return int(event["args"].get("count", 1))


def _overlaps(sends: list[dict], receives: list[dict]) -> Iterable[tuple[dict, dict, int]]:
    """The pairs of a send run and a receive run that share messages (their ``n`` ranges
    overlap), with how many they share, in order."""
    sends = sorted(sends, key=lambda e: e["args"].get("n", 0))
    receives = sorted(receives, key=lambda e: e["args"].get("n", 0))
    i = j = 0
    while i < len(sends) and j < len(receives):
        s0, r0 = sends[i]["args"].get("n", 0), receives[j]["args"].get("n", 0)
        s1, r1 = s0 + _count(sends[i]), r0 + _count(receives[j])
        both = min(s1, r1) - max(s0, r0)
        if both > 0:
            yield sends[i], receives[j], both
        if s1 <= r1:
            i += 1
        else:
            j += 1


def _hashable(tag: Any) -> Any:
    return tuple(tag) if isinstance(tag, list) else tag


def merge_dir(directory: str | os.PathLike[str], output: str | os.PathLike[str]) -> dict:
    """Merge every ``*.json`` trace file of ``directory`` (except ``output``) into
    ``output``; returns ``metadata.rlinf`` of the result (see :func:`merge`).

    Raises:
        ValueError: no trace file in ``directory``, or one that is not a trace.
    """
    out_path = pathlib.Path(output).resolve()
    files = sorted(p for p in pathlib.Path(directory).glob("*.json") if p.resolve() != out_path)
    if not files:
        raise ValueError(f"no trace files (*.json) in {directory}")
    merged = merge(load(p) for p in files)
    out_path.write_text(json.dumps(merged), encoding="utf-8")
    return merged["metadata"]["rlinf"]


# ----------------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``rlinf trace``."""
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    p = sub.add_parser("merge", help="merge the per-process files of a trace directory into one timeline",
                       description="Merge the files RLINF_TRACE=DIR (or rlinf.trace(DIR)) made, one per process, "
                                   "into one Chrome trace / Perfetto JSON timeline, clocks aligned via the "
                                   "manager and each send joined to its receive.")
    p.add_argument("directory", help="the trace directory (RLINF_TRACE)")
    p.add_argument("-o", "--output", default="trace.json", help="the merged file (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """``rlinf trace merge DIR -o FILE``."""
    if getattr(args, "trace_command", None) != "merge":
        print("usage: rlinf trace merge DIR [-o trace.json]", file=sys.stderr)
        return 2
    try:
        summary = merge_dir(args.directory, args.output)
    except (OSError, ValueError) as exc:
        print(f"rlinf trace merge: {exc}", file=sys.stderr)
        return 1
    print(f"{args.output}: {len(summary['processes'])} processes, {summary['sends']} sends, "
          f"{summary['receives']} receives ({summary['unmatched_sends']} sends and "
          f"{summary['unmatched_receives']} receives unmatched); open it in ui.perfetto.dev or chrome://tracing")
    if summary["unaligned"]:
        print(f"  no clock offset recorded for {', '.join(summary['unaligned'])}: their times are left as they are",
              file=sys.stderr)
    return 0
