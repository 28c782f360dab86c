"""Flow control across emulated machines (issue 24): on a slow link, small messages on
other tags overtake a bulk transfer in progress, while the order per tag holds."""

from __future__ import annotations

import pytest

from .agents import MiB

pytestmark = pytest.mark.multiproc


def test_a_ping_on_another_tag_overtakes_a_40_mib_transfer_on_a_slow_link(nodes):
    """Node 1's link is limited to 100 Mbit/s, so 40 MiB take ~3.5 s. Pings on tag 1
    meanwhile come back in well under a second, many of them while the transfer is still
    on its way; the small message sent on tag 0 after the large one arrives after it.
    Before issue 24 (H1) every ping waited for the whole transfer (one round trip of
    ~3.5 s)."""
    n = nodes(3)
    n.start_manager(0)
    n.rate_limit(1, "100mbit")
    sink = n.agent(2, "bulk_sink", "dst:0", peer="src:0", nbytes=40 * MiB)
    src = n.agent(1, "bulk_and_pings", "src:0", peer="dst:0", nbytes=40 * MiB)
    out = src.expect("result", timeout=120)
    got = sink.expect("result", timeout=60)
    assert got["big_first"] and got["after_second"], got
    rtts = sorted(out["rtts"])
    assert out["during"] >= 10, out                 # pings came back while 40 MiB were on their way
    assert rtts[-1] < 1.0, rtts[-5:]                # none waited for the transfer
    assert got["echoed"] == len(rtts)
