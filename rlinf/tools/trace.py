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
    ``s`` on the sender, ``f`` on the receiver, with one ``id``; both events get it as
    ``args.flow``); a receive takes its send's path when it could not tell it (zmq,
    stream or bulk look the same once read). Events are sorted by time, metadata first.

    Args:
        processes: each process's events, as :func:`load` returns them.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {"rlinf": {...}}}``,
        where ``metadata.rlinf`` holds ``processes`` (address, incarnation, host, pid, and
        the ``offset_us`` / ``rtt_us`` applied), ``sends``, ``receives``,
        ``unmatched_sends``, ``unmatched_receives`` and ``unaligned``.
    """
    loaded = []
    for events in processes:
        info = dict(_meta(events, "rlinf_process") or {})
        clock = _meta(events, "rlinf_clock") or {}
        info["offset_us"], info["rtt_us"] = clock.get("offset_us"), clock.get("rtt_us")
        loaded.append((info, events))
    loaded.sort(key=lambda item: (str(item[0].get("address", "")), str(item[0].get("incarnation", ""))))
    out: list[dict] = []
    sends: dict[tuple, dict] = {}
    receives: list[tuple[tuple, dict]] = []
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
                sends[(address, incarnation, args.get("peer"), _hashable(args.get("tag")), args.get("n"))] = event
            elif name == "recv" and event.get("tid") == _RECV_LANE:
                receives.append(((args.get("peer"), args.get("inc"), address, _hashable(args.get("tag")),
                                  args.get("n")), event))
    matched = 0
    for key, recv in receives:
        send = sends.pop(key, None)
        if send is None:
            continue
        matched += 1
        flow = matched
        send["args"]["flow"] = recv["args"]["flow"] = flow
        if not recv["args"].get("path"):
            recv["args"]["path"] = send["args"].get("path", "")
        common = {"name": "message", "cat": "rlinf.flow", "id": flow}
        out.append({**common, "ph": "s", "pid": send["pid"], "tid": send["tid"], "ts": send["ts"]})
        out.append({**common, "ph": "f", "bp": "e", "pid": recv["pid"], "tid": recv["tid"], "ts": recv["ts"]})
    out.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    summary = {"processes": described, "sends": matched + len(sends), "receives": len(receives),
               "unmatched_sends": len(sends), "unmatched_receives": len(receives) - matched,
               "unaligned": unaligned}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": {"rlinf": summary}}


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
