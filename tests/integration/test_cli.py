"""The ``rlinf`` command: --help everywhere, ``top`` against live clusters, ``bench``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import rlinf
from rlinf.tools import cli, top

from . import workers
from .wait import until

pytestmark = pytest.mark.multiproc

SUBCOMMANDS = ("manager", "top", "bench", "demo")


async def _run(*args: str, timeout: float = 60, env: dict | None = None) -> tuple[int, str, str]:
    """Run ``python -m rlinf ARGS`` without blocking the loop (an embedded manager may
    live on it); returns (status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlinf", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})})
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


# ----------------------------------------------------------------------------- --help
def test_console_script_help():
    """The installed ``rlinf`` entry point works and lists every subcommand."""
    import subprocess

    exe = shutil.which("rlinf", path=os.path.dirname(sys.executable)) or shutil.which("rlinf")
    if exe is None:
        pytest.skip("the rlinf console script is not installed in this environment")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rlinf {command}")
    assert "--" in out   # lists its options


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "manager" in capsys.readouterr().out


async def test_python_dash_m_works():
    status, out, err = await _run("--version")
    assert status == 0, err
    assert out.strip() == f"rlinf {rlinf.__version__}"


# ----------------------------------------------------------------------------- top
def test_rates_come_from_consecutive_reports():
    """msgs/s and bytes/s are counter differences over the reporting worker's uptime."""
    tracker = top.RateTracker()

    def snap(uptime, msgs_out, bytes_out):
        return {"workers": [{"address": "a:0", "incarnation": "x", "stats": {
            "uptime": uptime, "msgs_out": msgs_out, "bytes_out": bytes_out, "msgs_in": 0, "bytes_in": 0}}]}

    assert tracker.update(snap(1.0, 10, 1000))["a:0"].msgs_out == 0.0   # one report: no rate yet
    rates = tracker.update(snap(3.0, 110, 5000))
    assert rates["a:0"].msgs_out == pytest.approx(50.0)
    assert rates["a:0"].bytes_out == pytest.approx(2000.0)
    # the same report again (the worker has not reported since): the rate is kept
    assert tracker.update(snap(3.0, 110, 5000))["a:0"].msgs_out == pytest.approx(50.0)


def test_render_shows_workers_channels_and_new_events():
    from rich.console import Console

    view = top.View()
    base = {"manager": "tcp://127.0.0.1:1", "version": 1, "events": [{"kind": "joined", "address": "a:0"}],
            "workers": [{"address": "a:0", "incarnation": "x", "node_id": "n1", "pid": 7, "age": 5.0,
                         "devices": [{"kind": "cuda", "index": 0}], "silence": 0.1, "meta": {}, "stats": {}},
                        {"address": "ch:0", "incarnation": "y", "node_id": "n1", "pid": 8, "age": 4.0,
                         "devices": [], "silence": 9.0, "meta": {"kind": "channel", "channel": "rollouts"},
                         "stats": {"channel": {"length": 3, "weight": 12.5, "consumers": [
                             {"name": "a:0", "pending_count": 2, "speed": 4.0, "busy_fraction": 0.5}]}}}]}
    view.update(base)
    failed = {"kind": "failed", "address": "c:0", "reason": "IndexError: [bold]3[/] out of range"}
    view.update({**base, "version": 3, "events": base["events"] + [{"kind": "lost", "address": "b:0"}, failed]})
    console = Console(width=200, record=True)
    console.print(top.render(view))
    text = console.export_text()
    for expected in ("a:0", "cuda:0", "silent 9.0s", "rollouts", "pending 2", "busy 50%", "lost", "b:0",
                     "failed", "c:0 (IndexError: [bold]3[/] out of range)"):    # a reason is text, not markup
        assert expected in text, expected
    assert view.event_times[0] is None and view.event_times[1] is not None   # only the new ones are stamped


async def _snapshot_when(cluster, predicate) -> dict:
    """The manager's snapshot once ``predicate(snapshot)`` holds (heartbeats carry stats
    about once a second)."""
    snap: dict = {}

    def holds() -> bool:
        nonlocal snap
        snap = cluster.manager.snapshot()
        return predicate(snap)

    await until(holds, timeout=60, what="the workers' reported stats")
    return snap


def _channel_report(snap: dict, name: str) -> dict:
    """The ``ChannelStats`` the server of channel ``name`` reported ({} before its first)."""
    for w in snap["workers"]:
        if (w.get("meta") or {}).get("channel") == name:
            return w["stats"].get("channel") or {}
    return {}


async def test_top_once_json_reports_workers_and_channel(cluster, driver):
    async with asyncio.timeout(90):
        group = await cluster.spawn(workers.idle, "idle", 2)
        for _ in group.addresses:
            await driver.recv_any(tag=7)
        channel = await driver.create_channel("top-test")
        weights = [2.0, 0.5, 3.25]
        for i, weight in enumerate(weights):
            await channel.put({"x": i}, weight=weight)
        # wait until the workers' heartbeats carry counters that include the "up" messages,
        # and the channel server's its three queued items (nobody consumes them)
        wanted = {"driver:0", *group.addresses}

        def reported(snap):
            return (all(w["stats"].get("msgs_in" if w["address"] == "driver:0" else "msgs_out", 0) >= 1
                        for w in snap["workers"] if w["address"] in wanted)
                    and _channel_report(snap, "top-test").get("put_count") == len(weights))

        await _snapshot_when(cluster, reported)
        status, out, err = await _run("top", "--manager", cluster.manager_address, f"--token={cluster.token}",
                                      "--once", "--json")
        assert status == 0, err
        snap = json.loads(out)
        by_address = {w["address"]: w for w in snap["workers"]}
        assert wanted <= set(by_address)
        assert by_address["idle:0"]["pid"] == group.pids[0]
        assert by_address["idle:1"]["stats"]["msgs_out"] >= 1      # it sent "up"
        assert by_address["driver:0"]["stats"]["msgs_in"] >= 2
        assert [e for e in snap["events"] if e["kind"] == "joined" and e["address"] == "idle:1"]
        [ch] = [c for c in snap["channels"] if c["name"] == "top-test"]
        assert ch["address"] == "channel.top-test:0"
        assert ch["channel"]["length"] == len(weights)
        assert ch["channel"]["weight"] == pytest.approx(sum(weights))
        assert ch["channel"]["consumers"] == []

        # a consumer appears with its pending count, speed and busy share
        assert await channel.get(timeout=10) == {"x": 0}
        snap = await _snapshot_when(cluster, lambda s: _channel_report(s, "top-test").get("get_count", 0) >= 1)
        [consumer] = _channel_report(snap, "top-test")["consumers"]
        assert consumer["name"] == "driver:0"
        assert {"pending_count", "pending_weight", "speed", "busy_fraction"} <= set(consumer)

        # the same through the rich view, once
        status, out, err = await _run("top", "--manager", cluster.manager_address, f"--token={cluster.token}",
                                      "--once", env={"COLUMNS": "200"})
        assert status == 0, err
        assert "idle:1" in out and "workers" in out
        assert "top-test" in out and "driver:0 pending" in out
        await channel.close()


async def test_top_with_a_wrong_token_fails_cleanly(cluster):
    async with asyncio.timeout(30):
        status, out, err = await _run("top", "--manager", cluster.manager_address, "--token", "not-the-token",
                                      "--once", "--json", "--timeout", "3")
        assert status == 1
        assert "rlinf top:" in err and out == ""


async def test_bad_addresses_fail_cleanly():
    """A clear message and a status, no traceback (both printed one before)."""
    async with asyncio.timeout(60):
        status, out, err = await _run("top", "--manager", "127.0.0.1:5555", "--token", "t", "--once", "--json")
        assert status == 2 and "bad manager address" in err and "Traceback" not in err
        status, out, err = await _run("manager", "--bind", "bogus", "--token", "t")
        assert status != 0 and "cannot bind bogus" in err and "Traceback" not in err


async def test_manager_command_serves_workers():
    """``rlinf manager`` prints where to join; a worker joins it and ``top`` sees it."""
    token = "cli-test-token"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlinf", "manager", "--bind", "tcp://127.0.0.1:0", f"--token={token}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
            assert line.startswith("rlinf manager listening on tcp://127.0.0.1:"), line
            address = line.split()[-1]
            rest = b""
            while b"rlinf top" not in rest:
                rest += await proc.stdout.readline()
            assert f"RLINF_MANAGER={address}".encode() in rest
            async with rlinf.connect("joiner:0", manager=address, token=token):
                status, out, err = await _run("top", "--manager", address, f"--token={token}", "--once", "--json")
                assert status == 0, err
                assert [w["address"] for w in json.loads(out)["workers"]] == ["joiner:0"]
    finally:
        if proc.returncode is None:
            proc.send_signal(2)   # Ctrl-C: a clean stop
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0


# ----------------------------------------------------------------------------- bench
_FAKE_ROWS = textwrap.dedent('''
    from dataclasses import dataclass

    @dataclass
    class Row:
        metric: str
        rlinf: float
        baseline: str
        baseline_value: float | None
        unit: str
        higher_is_better: bool = False
        target: str = ""

    def run(quick=False):
        assert quick
        return [Row("X1 thing", 0.002, "raw", 0.004, "s", target=">= 1.5x"),
                Row("X1 thing", 0.002, "ray", None, "s"),
                {"metric": "X2 rate", "rlinf": 2e5, "baseline": "zmq", "baseline_value": 1e5,
                 "unit": "msg/s", "higher_is_better": True, "target": ">= 3x"}]
''')


def test_bench_runs_scripts_by_path_and_prints_one_table(tmp_path: Path):
    import subprocess

    (tmp_path / "fake.py").write_text(_FAKE_ROWS)
    (tmp_path / "needs_ray.py").write_text("import ray_is_not_installed_here\ndef run(quick=False):\n    return []\n")
    (tmp_path / "broken.py").write_text("def run(quick=False):\n    raise RuntimeError('kaboom')\n")
    (tmp_path / "_helper.py").write_text("def run(quick=False):\n    raise AssertionError('not a benchmark')\n")
    out = subprocess.run([sys.executable, "-m", "rlinf", "bench", "--quick", "--dir", str(tmp_path), "--markdown"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr          # "broken" failed
    table = out.stdout
    assert "| X1 thing | 2.00 ms | raw | 4.00 ms | 2.00x | >= 1.5x ok |" in table
    assert "| X1 thing | 2.00 ms | ray | skipped | - | - |" in table
    assert "| X2 rate | 200k msg/s | zmq | 100k msg/s | 2.00x | >= 3x MISS |" in table
    assert "| needs_ray | skipped |" in table and "ray_is_not_installed_here" in table
    assert "| broken | error |" in table and "kaboom" in table
    assert "_helper" not in table and "kaboom" in out.stderr


def test_bench_markdown_is_the_docs_table(tmp_path: Path):
    """``rlinf bench --markdown``: quick mode without asking (the fake asserts it), and
    the machine and date of the run on every row (the table that opens benchmarks.md)."""
    import subprocess
    import time

    from rlinf.tools import bench

    (tmp_path / "fake.py").write_text(_FAKE_ROWS)
    out = subprocess.run([sys.executable, "-m", "rlinf", "bench", "--dir", str(tmp_path), "--markdown"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("`rlinf bench --markdown` on ")
    header = "| metric | rlinf | baseline | baseline value | ratio (>1: rlinf better) | target | machine | date |"
    assert header in lines
    suffix = f" | {bench._machine_short()} | {time.strftime('%Y-%m-%d')} |"
    rows = [line for line in lines if line.startswith("| X")]
    assert len(rows) == 3 and all(row.endswith(suffix) for row in rows), rows
    assert rows[0] == "| X1 thing | 2.00 ms | raw | 4.00 ms | 2.00x | >= 1.5x ok" + suffix


def test_bench_quick_subset():
    """The real runner on a real, fast benchmark (the balance simulation)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "rlinf", "bench", "--quick", "--only", "balance_sim"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for policy in ("fifo", "round_robin", "shortest_queue", "performance_aware"):
        assert f"Q3 imbalance, {policy}" in out.stdout
    assert "unknown benchmark" in subprocess.run(
        [sys.executable, "-m", "rlinf", "bench", "--only", "nope"], capture_output=True, text=True,
        timeout=60).stderr


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_bench_quick_all_rows():
    """``rlinf bench --quick``: every benchmark completes and prints its rows (about a
    minute and a half on 2 cores); one that cannot run here (gpu without CUDA) is skipped."""
    import subprocess

    from rlinf.tools import bench

    found = bench.find_benchmarks(bench.default_dir())
    out = subprocess.run([sys.executable, "-m", "rlinf", "bench", "--quick", "--json"],
                         capture_output=True, text=True, timeout=330)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout)["results"]
    assert set(results) == set(found)
    for name, result in results.items():
        assert result.get("rows") or "skipped" in result, (name, result)
        for row in result.get("rows", ()):
            assert row["metric"] and (row["rlinf"] is not None or row["note"]), (name, row)
    if "gpu" in results and not Path("/dev/nvidia0").exists():
        assert "skipped" in results["gpu"], results["gpu"]
