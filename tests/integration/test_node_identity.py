"""Node identity by what two processes can share (issue 23, finding 5).

Two workers with this host's name, kernel and network, but each in a mount namespace of
its own (a private tmpfs on ``/tmp``, and on ``/dev/shm`` unless said otherwise), as
containers with host networking are. They used to get one node id, so the router sent
them to each other's stream socket (not found), then to a ZeroMQ ``ipc://`` socket that
does not exist for them either: a 40 MiB message never arrived, and no error came.
Each worker is ``tests/integration/ns_worker.py``; the manager is this process's
cluster, on 127.0.0.1 (so the workers advertise loopback TCP endpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

import pytest

from rlinf.info import WorkerInfo
from rlinf.transports.shm import sweep

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mount namespaces are Linux's")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "integration", "ns_worker.py")
SKIP = 77


def _kept_under_tmp(*extra: str) -> list[str]:
    """What a worker needs from the real ``/tmp`` once its own covers it: the repository
    and the interpreter's directories, where they live there (CI clones to /tmp)."""
    wanted = [ROOT, sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
              *[p for p in sys.path if p and os.path.isdir(p)], *extra]
    under = sorted({os.path.realpath(p) for p in wanted} | {os.path.abspath(p) for p in wanted})
    under = [p for p in under if p.startswith("/tmp/")]
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]


async def _run_pair(cluster, tmp_path, *, private_shm: bool) -> list[dict]:
    marker = tmp_path / "seen-only-by-the-test"
    marker.write_text("x")
    keep = _kept_under_tmp(str(tmp_path)) if str(tmp_path).startswith("/tmp/") else _kept_under_tmp()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("RLINF_NODE_ID", None)
    procs = []
    try:
        for rank in (0, 1):
            spec = {"shm": private_shm, "keep": keep, "address": f"ns:{rank}", "peer": f"ns:{1 - rank}",
                    "manager": cluster.manager_address, "token": cluster.token, "first": rank == 0}
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, WORKER, json.dumps(spec), cwd=ROOT, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        async with asyncio.timeout(120):
            outs = await asyncio.gather(*(p.communicate() for p in procs))
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGKILL)
                await p.wait()
                sweep(p.pid)     # a worker killed here leaves its segments in a shared /dev/shm
    for p, (out, err) in zip(procs, outs):
        if p.returncode == SKIP:
            pytest.skip(out.decode().strip()[-300:])
        assert p.returncode == 0, err.decode()[-3000:]
    reports = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
    for report, (_, err) in zip(reports, outs):
        assert "error" not in report, f"{report['error']}\n{err.decode()[-3000:]}"
        assert os.path.basename(marker) not in report["tmp"]        # its /tmp is its own
    return reports


async def test_two_nodes_with_one_hostname_get_different_ids_and_talk_over_tcp(cluster, tmp_path):
    """Private /dev/shm and /tmp: different node ids, so TCP (bulk for 40 MiB), and every
    message arrives within seconds."""
    first, second = await _run_pair(cluster, tmp_path, private_shm=True)
    a, b = (WorkerInfo.from_wire(r["info"]) for r in (first, second))
    assert a.host == b.host == os.uname().nodename
    assert a.node_id != b.node_id
    assert first["route"] == second["route"] == "bulk"
    assert first["link"] == second["link"] == "StreamLink tcp"      # the TCP stream link (the default)
    assert second["big"] and second["small"] and first["big_back"] and (first["done"], second["fin"]) == ("done", "fin")
    assert first["seconds"] < 10 and second["seconds"] < 10


async def test_processes_sharing_dev_shm_but_not_tmp_keep_shared_memory(cluster, tmp_path):
    """Private /tmp only (systemd's PrivateTmp): one /dev/shm, so one node id and shared
    memory for the 40 MiB; the stream and ipc sockets are not there for the other, and
    small messages fall back to TCP at once instead of waiting for them."""
    first, second = await _run_pair(cluster, tmp_path, private_shm=False)
    a, b = (WorkerInfo.from_wire(r["info"]) for r in (first, second))
    assert a.node_id == b.node_id
    assert first["route"] == second["route"] == "shm"
    assert first["link"] == second["link"] == "ZmqLink tcp"
    assert second["big"] and second["small"] and first["big_back"] and (first["done"], second["fin"]) == ("done", "fin")
    assert first["seconds"] < 10 and second["seconds"] < 10
