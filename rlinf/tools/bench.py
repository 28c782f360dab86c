"""``rlinf bench``: run the benchmark scripts and print one table.

Each script in ``benchmarks/`` exposes ``run(quick) -> list[row]``, where a row is a
``Row`` (``benchmarks/_common.py``) or a dict with the same fields (``metric``,
``rlinf``, ``baseline``, ``baseline_value``, ``unit``, ``ratio``, ``target``). Every
script runs in its own child process, which imports it by path: benchmarks set
environment variables and start worker processes, and one failing must not take the
others down. A baseline that is not installed shows as "skipped"; so does a whole
script whose optional dependency is missing (an ``ImportError``) or that cannot run on
this machine (it raises ``unittest.SkipTest("why")``, e.g. no CUDA device).

    rlinf bench [--quick] [--only codec,p2p] [--markdown [--full] | --json]

``--markdown`` prints the table of current figures that opens ``docs/benchmarks.md``:
each script in its quick mode (``--full`` for the full runs), one row per metric with
the machine and the date of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

__all__ = ["ORDER", "find_benchmarks", "normalize", "run_module", "main"]

#: The suite, in the order it is printed; other scripts found in the folder follow.
ORDER = ("codec", "p2p", "transfer", "collectives", "channel", "balance_sim")

_FIELDS = ("metric", "rlinf", "baseline", "baseline_value", "unit", "ratio", "target", "note",
           "higher_is_better")


def default_dir() -> Path:
    """``benchmarks/`` next to the package (a source checkout or an editable install)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def find_benchmarks(directory: Path) -> dict[str, Path]:
    """Scripts in ``directory`` that define a module-level ``run(``, in suite order."""
    found = {}
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            text = path.read_text()
        except OSError:
            continue
        if re.search(r"^def run\(", text, re.MULTILINE):
            found[path.stem] = path
    ordered = {name: found.pop(name) for name in ORDER if name in found}
    ordered.update(found)
    return ordered


# ----------------------------------------------------------------------------- rows
def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def normalize(row: Any, source: str) -> dict[str, Any]:
    """One benchmark row as a plain dict with the table's fields."""
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        data = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
        data["ratio"] = getattr(row, "ratio", None)
    elif isinstance(row, dict):
        data = dict(row)
    else:
        data = {name: getattr(row, name, None) for name in _FIELDS}
    if "metric" not in data and "policy" in data and "median_imbalance" in data:
        # the balance simulation reports one row per policy, lower imbalance is better
        data = {"metric": f"Q3 imbalance, {data['policy']}", "rlinf": data["median_imbalance"],
                "baseline": "-", "baseline_value": None, "unit": "%", "ratio": None,
                "target": "<= 10%", "note": "meets target" if data.get("meets_target") else ""}
    out = {
        "source": source,
        "metric": str(data.get("metric") or source),
        "rlinf": _number(data.get("rlinf")),
        "baseline": str(data.get("baseline") or "-"),
        "baseline_value": _number(data.get("baseline_value")),
        "unit": str(data.get("unit") or ""),
        "target": str(data.get("target") or ""),
        "note": str(data.get("note") or ""),
        "higher_is_better": bool(data.get("higher_is_better", False)),
    }
    ratio = _number(data.get("ratio"))
    if ratio is None and out["rlinf"] and out["baseline_value"]:
        r, b = out["rlinf"], out["baseline_value"]
        ratio = r / b if out["higher_is_better"] else b / r
    out["ratio"] = ratio
    return out


def fmt(value: float | None, unit: str) -> str:
    """A value with a readable unit; ``None`` is a baseline that did not run."""
    if value is None:
        return "skipped"
    if unit == "s":
        value, unit = value * 1e6, "us"
    if unit == "us":
        if value < 1000:
            return f"{value:.1f} us"
        if value < 1e6:
            return f"{value / 1e3:.2f} ms"
        return f"{value / 1e6:.2f} s"
    if unit == "msg/s":
        return f"{value / 1e3:.0f}k msg/s" if value >= 1e4 else f"{value:.0f} msg/s"
    if unit == "%":
        return f"{value * 100:.1f}%" if value <= 1.5 else f"{value:.1f}%"
    return f"{value:.3g} {unit}".strip()


_TO_US = {"s": 1e6, "ms": 1e3, "us": 1.0}


def verdict(row: dict[str, Any]) -> str:
    """"ok" / "MISS" for a target this table can check (``>= 2x`` on the ratio,
    ``<= 10%`` or ``<= 60 us`` on the rlinf value), else ""."""
    m = re.fullmatch(r"\s*(>=|<=)\s*([0-9.]+)\s*(x|%|us|ms|s)\s*", row["target"])
    if not m:
        return ""
    op, limit, unit = m.group(1), float(m.group(2)), m.group(3)
    value = None
    if unit == "x":
        value = row["ratio"]
    elif unit == "%" and row["unit"] == "%" and row["rlinf"] is not None:
        value = row["rlinf"] * 100
    elif unit in _TO_US and row["unit"] in _TO_US and row["rlinf"] is not None:
        value = row["rlinf"] * _TO_US[row["unit"]] / _TO_US[unit]
    if value is None:
        return ""
    return "ok" if (value >= limit if op == ">=" else value <= limit) else "MISS"


# ----------------------------------------------------------------------------- running
def _child(path: str, quick: bool, out: str) -> int:
    """Inside the child: import ``path`` by path, run it, write the rows as JSON."""
    path_ = Path(path).resolve()
    for entry in (str(path_.parent.parent), str(path_.parent)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    result: dict[str, Any]
    try:
        spec = importlib.util.spec_from_file_location(path_.stem, path_)
        module = importlib.util.module_from_spec(spec)
        # registered under its name so worker processes it spawns can unpickle its functions
        sys.modules[path_.stem] = module
        spec.loader.exec_module(module)
        rows = module.run(quick)
        result = {"rows": [normalize(r, path_.stem) for r in rows]}
    except ImportError as exc:
        result = {"skipped": f"needs {exc.name or exc}"}
    except unittest.SkipTest as exc:
        result = {"skipped": str(exc) or "skipped"}
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    return 0


def run_module(name: str, path: Path, *, quick: bool, timeout: float | None,
               verbose: bool = False) -> dict[str, Any]:
    """Run one benchmark script in a child process; returns its rows or why not."""
    with tempfile.TemporaryDirectory(prefix="rlinf-bench-") as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "rlinf.tools.bench", "--child", str(path), "--out", out]
        if quick:
            cmd.append("--quick")
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, stdout=None if verbose else subprocess.PIPE,
                                  stderr=None if verbose else subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {timeout:.0f} s", "seconds": timeout}
        seconds = time.perf_counter() - started
        try:
            result = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            tail = "\n".join((proc.stdout or "").splitlines()[-20:])
            result = {"error": f"exited with status {proc.returncode}\n{tail}"}
        result["seconds"] = seconds
        return result


def _machine_short() -> str:
    """CPUs and memory: the machine column of the markdown table."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    return f"{os.cpu_count()} CPUs, {mem:.0f} GiB"


def _machine() -> str:
    torch = _dist_version("torch")
    return (f"{_machine_short()}, Python {platform.python_version()}, torch {torch}, "
            f"{platform.system()} {platform.machine()}")


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


# ----------------------------------------------------------------------------- output
def _table_rows(results: dict[str, dict]) -> list[list[str]]:
    rows = []
    for name, result in results.items():
        if "rows" in result:
            for r in result["rows"]:
                ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
                target = " ".join(x for x in (r["target"], verdict(r)) if x) or "-"
                rows.append([r["metric"], fmt(r["rlinf"], r["unit"]), r["baseline"],
                             fmt(r["baseline_value"], r["unit"]) if r["baseline"] != "-" else "-",
                             ratio, target])
            if not result["rows"]:
                rows.append([name, "-", "-", "-", "-", "no rows"])
        elif "skipped" in result:
            rows.append([name, "skipped", "-", "-", "-", result["skipped"]])
        else:
            rows.append([name, "error", "-", "-", "-", result.get("error", "?").strip().splitlines()[-1][:80]])
    return rows


_HEADER = ["metric", "rlinf", "baseline", "baseline value", "ratio (>1: rlinf better)", "target"]


def print_markdown(results: dict[str, dict], command: str) -> None:
    """The table with two more columns, machine and date (each row is from this run)."""
    header = [*_HEADER, "machine", "date"]
    extra = [_machine_short(), time.strftime("%Y-%m-%d")]
    print(f"`{command}` on {_machine()}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in _table_rows(results):
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in [*row, *extra]) + " |")


def print_table(results: dict[str, dict], command: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rlinf bench — {_machine()}", title_justify="left")
    for i, col in enumerate(_HEADER):
        table.add_column(col, justify="right" if i in (1, 3, 4) else "left")
    for row in _table_rows(results):
        style = "red" if row[1] == "error" else ("dim" if row[1] == "skipped" else None)
        table.add_row(*row, style=style)
    Console(width=max(120, _terminal_width())).print(table)
    spent = ", ".join(f"{name} {r.get('seconds', 0):.0f} s" for name, r in results.items())
    print(f"({command}; time: {spent})")


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repeats and messages (each script's quick mode)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only these benchmarks (repeat or comma-separate: codec,p2p)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks found and exit")
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder with the benchmark scripts (default: benchmarks/ of the checkout)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per benchmark")
    fmt_group = parser.add_mutually_exclusive_group()
    fmt_group.add_argument("--markdown", action="store_true",
                           help="print a Markdown table for docs/benchmarks.md, with machine and date "
                                "(runs each script in quick mode unless --full)")
    fmt_group.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--full", action="store_true", help="with --markdown: the full runs, not quick mode")
    parser.add_argument("--verbose", action="store_true", help="show each benchmark's own output")


def run(args: argparse.Namespace) -> int:
    """Run ``rlinf bench`` with parsed arguments; returns the exit status."""
    directory = args.dir or default_dir()
    if not directory.is_dir():
        print(f"rlinf bench: no benchmarks folder at {directory} (run from a source checkout, "
              "or pass --dir)", file=sys.stderr)
        return 2
    found = find_benchmarks(directory)
    if args.list:
        for name, path in found.items():
            print(f"{name:<14} {path}")
        return 0
    wanted = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in found]
    if unknown:
        print(f"rlinf bench: unknown benchmark(s) {', '.join(unknown)}; found: {', '.join(found)}",
              file=sys.stderr)
        return 2
    selected = {n: found[n] for n in (wanted or found)}
    if args.markdown and not args.full:
        args.quick = True
    results: dict[str, dict] = {}
    for name, path in selected.items():
        print(f"rlinf bench: running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        results[name] = run_module(name, path, quick=args.quick, timeout=args.timeout, verbose=args.verbose)
        status = ("ok" if "rows" in results[name] else
                  "skipped" if "skipped" in results[name] else "FAILED")
        print(f"rlinf bench: {name} {status} in {results[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
        if "error" in results[name]:
            print(results[name]["error"], file=sys.stderr)
    flags = (" --markdown" + (" --full" if args.full else "") if args.markdown else
             " --json" if args.json else "") + (" --quick" if args.quick and not args.markdown else "")
    command = "rlinf bench" + flags + (f" --only {','.join(wanted)}" if wanted else "")
    if args.json:
        print(json.dumps({"machine": _machine(), "command": command, "results": results}, indent=2))
    elif args.markdown:
        print_markdown(results, command)
    else:
        print_table(results, command)
    return 1 if any("error" in r for r in results.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlinf bench", description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.quick, args.out)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
