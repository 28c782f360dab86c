"""The chaos soak (``benchmarks/chaos.py``), short: a minute of faults of every kind on
three emulated nodes, with a fixed seed; the same workers, injector and ledger as the
10-minute run (its docstring states the rules). Nothing may be lost silently,
duplicated or reordered.
"""

from __future__ import annotations

import pytest

from benchmarks import chaos

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SEED = 23
SECONDS = 55


@pytest.mark.timeout(600)        # ~55 s of faults, plus starting 9 processes and ending on 2 loaded cores
def test_a_minute_of_chaos_loses_nothing_silently(nodes):
    lines = []
    report = chaos.soak(nodes(3), SECONDS, SEED, log=lines.append, finish_timeout=30)
    text = chaos.format_report(report, SECONDS)
    print("\n".join(lines) + "\n" + text)
    totals = report.totals
    assert all(totals.get(f"faults: {kind}", 0) >= 1 for kind in chaos.KINDS), text
    for what in ("silent losses", "duplicates", "out of order", "corrupt", "phantom", "wrong collective results",
                 "crashed workers"):
        assert totals.get(what, 0) == 0, f"{what}: {totals.get(what)}\n{text}"
    assert not report.problems, text
    assert totals["messages delivered"] > 0 and totals["channel items got"] > 0, text
    assert totals["collective rounds completed"] > 0, text
