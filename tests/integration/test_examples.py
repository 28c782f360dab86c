"""Smoke tests: every example runs as it is, as a subprocess, within a timeout."""

from __future__ import annotations

import difflib
import importlib.util
import os
import subprocess
import sys

import pytest

import rlinf

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

needs_init = pytest.mark.skipif(not hasattr(rlinf, "init"), reason="rlinf/__init__.py does not export init yet")


def _run(args: list[str], timeout: float = 120, **kwargs) -> str:
    """Run a command from the repository root; returns its output, fails with it.

    Output is block-buffered (no PYTHONUNBUFFERED), so that each ``print(..., flush=True)``
    of the processes sharing the pipe lands as one write, not interleaved word by word.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args} did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args} exited with {done.returncode}:\n{output}"
    return output


def _example(name: str, *args: str, timeout: float = 120) -> str:
    return _run([sys.executable, os.path.join(EXAMPLES, name), *args], timeout=timeout)


def test_worker_group():
    out = _example("worker_group.py")
    assert "step 4:" in out and "ranks 0 and 2 only" in out and out.rstrip().endswith("done")


@pytest.mark.skipif(importlib.util.find_spec("rlinf.channel.client") is None
                    or not hasattr(rlinf.Cluster, "create_channel"),
                    reason="the channel (rlinf.channel.client, Cluster.create_channel) has not landed yet")
def test_channel_pipeline():
    assert "produced 60, consumed 60" in _example("channel_pipeline.py")


def test_async_rl():
    out = _example("async_rl.py")
    assert "version 5: trained on 8 rollouts" in out and "stale dropped 0, staleness max 1" in out


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'aiorlinf[ray]')")
def test_ray_pipeline(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)              # a local Ray of its own
    out = _example("ray_pipeline.py", timeout=180)
    assert "produced 40, consumed 40" in out and "with launcher ray" in out


def test_ray_pipeline_runs_unchanged_with_the_local_launcher():
    out = _example("ray_pipeline.py", "--launcher", "local")
    assert "produced 40, consumed 40" in out and "with launcher local" in out


def test_multi_node():
    out = _example("multi_node.py")
    assert "nodeA:0 (nodeA) -> nodeB:0 (nodeB): bulk over tcp" in out
    assert "nodeA:0 (nodeA) -> nodeA:1 (nodeA): shm over stream" in out


def test_rollout_server():
    out = _example("rollout_server.py")
    assert "wave 1 done: [200, 200, 200]" in out and "requests served per actor" in out


def test_weight_sync():
    out = _example("weight_sync.py", timeout=180)
    assert out.count("checksums match") == 2


def test_torch_port_differs_in_two_lines():
    with open(os.path.join(EXAMPLES, "torch_dist.py")) as f:
        torch_lines = f.readlines()
    with open(os.path.join(EXAMPLES, "torch_port_rlinf.py")) as f:
        rlinf_lines = f.readlines()
    changed = [line for line in difflib.unified_diff(torch_lines, rlinf_lines, n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert sorted(changed) == sorted(["-import torch.distributed as dist\n", "+import rlinf\n",
                                      '-    dist.init_process_group("gloo")\n', "+    dist = rlinf.init()\n"])


@needs_init
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed")
def test_torch_port_under_torchrun():
    out = _run([TORCHRUN, "--standalone", "--nproc-per-node", "3", os.path.join(EXAMPLES, "torch_port_rlinf.py")],
               timeout=180)
    for r in range(3):
        assert f"rank {r}/3: all collectives ok" in out, out


def test_local_launcher(tmp_path):
    """examples/local_launch.py sets torchrun's environment, and stops the rest on a failure."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\n"
                      "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR')\n"
                      "os.write(1, (' '.join(os.environ[k] for k in keys) + '\\n').encode())  # one write\n"
                      "if os.environ['RANK'] == '1' and len(sys.argv) > 1:\n"
                      "    sys.exit(3)\n"
                      "if len(sys.argv) > 1:\n"
                      "    sys.stdin.read()   # blocks until terminated\n")
    launcher = os.path.join(EXAMPLES, "local_launch.py")
    out = _run([sys.executable, launcher, "3", str(script)], timeout=60)
    assert sorted(line for line in out.splitlines() if line) == [f"{r} {r} 3 127.0.0.1" for r in range(3)], out
    failed = subprocess.run([sys.executable, launcher, "3", str(script), "fail"], cwd=ROOT, timeout=60,
                            capture_output=True, text=True, stdin=subprocess.PIPE)
    assert failed.returncode == 1 and "stopping the others" in failed.stderr
