"""The public surface of DESIGN.md §2: names exist, import is light, docs are current."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import rlinf

ROOT = pathlib.Path(__file__).resolve().parents[2]

DESIGN_NAMES = [
    "Cluster", "connect", "Channel", "ChannelStats", "Worker", "WorkerGroup", "Work", "WorkerInfo", "MembershipEvent", "CommStats",
    "LoadBalancePolicy", "ItemInfo", "ConsumerInfo", "policies", "init", "shutdown",
    "RlinfError", "ClosedError", "PeerLostError", "CommTimeoutError", "TransportUnavailableError",
    "EncodeError", "DecodeError", "ProtocolError", "AuthenticationError", "WorkerFailedError",
    "WouldBlock", "EndOfChannel",
]


def test_all_is_complete_and_resolvable():
    assert sorted(set(rlinf.__all__)) == sorted(rlinf.__all__), "duplicates in __all__"
    for name in rlinf.__all__:
        assert hasattr(rlinf, name), name
    missing = [n for n in DESIGN_NAMES if n not in rlinf.__all__]
    assert not missing, f"DESIGN.md names not exported: {missing}"
    for policy in ("FIFO", "RoundRobin", "WeightedRoundRobin", "ShortestQueue", "PerformanceAware"):
        assert issubclass(getattr(rlinf.policies, policy), rlinf.LoadBalancePolicy)


def test_error_tree():
    for name in DESIGN_NAMES[DESIGN_NAMES.index("RlinfError"):]:
        assert issubclass(getattr(rlinf, name), rlinf.RlinfError), name
    assert issubclass(rlinf.CommTimeoutError, TimeoutError)
    assert issubclass(rlinf.EncodeError, TypeError) and issubclass(rlinf.DecodeError, ValueError)


def test_import_has_no_heavy_side_effects():
    code = ("import sys, threading, rlinf; "
            "print(sorted(m for m in ('torch', 'cupy', 'ray') if m in sys.modules), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("]")[0] + "]" == "[]", out.stdout
    assert out.stdout.strip().endswith("1"), f"threads started at import: {out.stdout}"


def test_api_reference_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.multiproc
def test_readme_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## A short example\n\n(?:<!-- runnable -->\n)?```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6 and {line.split()[0] for line in lines} == {"rollout:0", "rollout:1"}
