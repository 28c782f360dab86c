"""How fast a failed peer surfaces (DESIGN.md §1.3, BENCHMARKS.md F1): a receive pending on
a worker that was killed or stalled fails with ``PeerLostError`` within the
failure-detection time the docs state, computed here from the code
(:func:`rlinf.control.manager.detection_time`; ``tests/unit/test_docs_figures.py`` checks
that the docs state the same figure).

Two paths: a process on the manager's machine that dies is seen gone through ``/proc``
at the manager's next liveness check; a worker on another machine (here: one that says
so in its registration, so the manager judges it by its heartbeats alone, as it would a
remote one) is declared lost after ``RLINF_PEER_TIMEOUT`` of silence, whether it was
killed or stopped (SIGSTOP: its sockets stay open, nothing but the missing heartbeats
tells).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import rlinf
from rlinf.config import Settings
from rlinf.control.manager import CHECK_INTERVAL, detection_time

from . import workers

pytestmark = pytest.mark.multiproc

#: What a loaded 2-core CI machine may add to the figure: the embedded manager shares the
#: test's event loop (it credits silent workers with its own stalls, which delays their
#: verdict), and the event still has to travel to the test's communicator.
TOLERANCE = 1.0

_REMOTE = textwrap.dedent("""
    import asyncio, sys
    import rlinf

    async def main(manager, token, address):
        # "another machine": the manager cannot watch its pid, only its heartbeats
        async with rlinf.Communicator(address, manager=manager, token=token,
                                      meta={"machine": "elsewhere"}) as comm:
            await comm.send("up", "driver:0", timeout=60)
            await asyncio.Event().wait()

    asyncio.run(main(*sys.argv[1:4]))
""")


async def test_a_killed_local_worker_fails_pending_ops_within_a_liveness_check(cluster, driver):
    """kill -9 of a process on the manager's machine: seen gone at the next check."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.idle, "victim", 2)
        for _ in range(2):
            await driver.recv_any(tag=7)
        pending = driver.async_recv("victim:0")
        t0 = time.monotonic()
        os.kill(group.pids[0], signal.SIGKILL)
        with pytest.raises(rlinf.PeerLostError):
            await pending
        detected = time.monotonic() - t0
        assert detected < CHECK_INTERVAL + TOLERANCE, f"took {detected:.2f} s"
        with pytest.raises(rlinf.PeerLostError):
            await driver.send("x", "victim:0")
        # the survivor still works
        await driver.send("still here", "victim:1")
        assert "victim:1" in {p.address for p in await driver.peers()}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
async def test_a_remote_worker_killed_or_stalled_fails_pending_ops_within_the_detection_time(cluster, driver, sig):
    """Judged by heartbeats: lost after the peer timeout of silence, at the next check.
    Not sooner than half the peer timeout either (so it was the heartbeats that told,
    not a pid or a socket)."""
    settings = Settings.from_env()          # what the cluster's manager runs with
    bound = detection_time(settings)
    address = f"remote{sig.name.lower()}:0"
    async with asyncio.timeout(60):
        proc = subprocess.Popen([sys.executable, "-c", _REMOTE, cluster.manager_address, cluster.token, address],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert await driver.recv(address, timeout=30) == "up"
            pending = driver.async_recv(address)
            t0 = time.monotonic()
            os.kill(proc.pid, sig)
            with pytest.raises(rlinf.PeerLostError, match="was lost"):
                await pending
            detected = time.monotonic() - t0
            print(f"{sig.name}: the pending receive failed after {detected:.2f} s (figure {bound:g} s)")
            assert settings.peer_timeout / 2 < detected < bound + TOLERANCE, f"took {detected:.2f} s"
            with pytest.raises(rlinf.PeerLostError):
                await driver.send("x", address)
        finally:
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait, 30)
