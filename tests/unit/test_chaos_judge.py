"""The chaos soak's ledger (benchmarks/chaos.py): fault-to-error latencies are judged
per fault, and an error is not charged to a fault that another fault on the same
workers followed (X1's p99 was once a short stall charged with the next link cut's
error: 5.35 s instead of 2.47 s)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _chaos():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("chaos_judge", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _events(tmp_path, rows) -> str:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_error_is_charged_to_the_last_fault_on_its_peer(tmp_path):
    chaos = _chaos()
    started = [{"kind": "started", "w": f"w:{k}", "inc": 0, "t": 0.0} for k in range(chaos.WORKERS)]
    path = _events(tmp_path, started + [
        {"fault": "stall", "target": "w:4", "t": 1.0, "end": 2.1, "detail": "1.1 s"},           # no error of its own
        {"fault": "link_down", "target": "node2", "t": 3.8, "end": 6.4, "detail": "2.6 s"},   # w:4 and w:5
        {"kind": "re", "w": "w:0", "inc": 0, "t": 6.27, "src": "w:4", "err": chaos.LOST},
        {"fault": "stall", "target": "w:1", "t": 20.0, "end": 25.0, "detail": "5.0 s"},
        {"kind": "s", "w": "w:3", "inc": 0, "t": 22.3, "dst": "w:1", "seq": 0, "ok": False, "err": chaos.LOST},
    ])
    report = chaos.check(chaos.load(path))
    assert sorted(round(x, 2) for x in report.latencies) == [2.3, 2.47]
    assert report.totals["faults that caused no error"] == 1         # the short stall
