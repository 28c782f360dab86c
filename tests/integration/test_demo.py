"""``rlinf demo``: the RL job learns, reports, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.multiproc

torch = pytest.importorskip("torch")
pytest.importorskip("gymnasium")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X")


def test_reinforce_learns_in_process():
    """The algorithm alone (no messaging), seeded: a few updates lift the mean return."""
    from rlinf.demo import rl, workers

    torch.set_num_threads(1)
    cfg = workers.DEFAULTS
    policy = rl.make_policy(hidden=cfg["hidden"], seed=3)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg["lr"])
    runner = rl.EnvRunner(8, seed=3, gamma=cfg["gamma"])
    means = []
    try:
        for _ in range(8):
            episodes = runner.run(policy, 2000)
            means.append(np.mean([e["ret"] for e in episodes]))
            mean, std = rl.mean_std(rl.return_stats(episodes))
            optimizer.zero_grad()
            rl.reinforce_gradients(policy, episodes, mean, std)
            rl.set_flat_grads(policy, rl.flat_grads(policy) / sum(e["length"] for e in episodes))
            optimizer.step()
    finally:
        runner.close()
    print("mean return per update:", [round(m, 1) for m in means])
    assert means[0] < 35                       # a random policy scores ~22
    assert np.mean(means[-2:]) > 1.5 * means[0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_quick_learns_and_cleans_up(tmp_path):
    """``rlinf demo --quick`` (fixed seed, 10 iterations) on a real local cluster:
    rollout workers, a channel, two learners with all_reduce and a broadcast."""
    summary_path = tmp_path / "summary.json"
    out = subprocess.run([sys.executable, "-m", "rlinf", "demo", "--quick", "--plain", "--summary", str(summary_path)],
                         capture_output=True, text=True, timeout=360, env={**os.environ, "COLUMNS": "120"})
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(summary_path.read_text())
    assert result["iterations"] == 10
    first, last = result["first_iterations_mean"], result["last_iterations_mean"]
    print(f"mean return: first iterations {first:.1f}, last iterations {last:.1f}")
    assert first < 40                               # starts near a random policy (~22)
    assert last > 45 and last > 1.8 * first         # and clearly learns
    summary = result["summary"]
    # both learners took work from the channel, balanced by weight
    weights = [w["weight"] for w in summary["learners"]]
    assert len(weights) == 2 and min(weights) > 0.3 * sum(weights)
    assert all(r["episodes"] > 0 for r in summary["rollouts"])
    # every update reached the rollout workers (one broadcast per iteration)
    assert all(r["versions"] == 10 for r in summary["rollouts"])
    # the report
    for text in ("return per iteration", "traffic sent, by transport", "channel balance", "learner:1"):
        assert text in out.stdout, text
    # nothing left running
    pids = [w["pid"] for w in summary["learners"] + summary["rollouts"]]
    assert all(_gone(pid) for pid in pids), pids


def test_demo_rejects_bad_options():
    out = subprocess.run([sys.executable, "-m", "rlinf", "demo", "--policy", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "unknown --policy 'nope'" in out.stderr
