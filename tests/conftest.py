"""Shared fixtures: a local cluster per test, the launchers to run worker groups with (a
local Ray cluster, started once per test module, for ``"ray"``), and a check that no
shared memory leaks."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import rlinf
from rlinf.control.devices import NODE_TOKEN


def pytest_configure(config):
    """A suite started in the background by a non-interactive shell (``make test &``,
    ``nohup``) inherits SIGINT ignored (POSIX), and so do the processes it starts: the
    tests that press Ctrl-C, on themselves or on a child (``rlinf manager``), would
    fail for that alone. Give the suite Python's default Ctrl-C, as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

_NODE_TOKEN = NODE_TOKEN.format(uid=os.getuid())    # kept for the life of /dev/shm, by design


def _shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if "rlinf" in name and name != _NODE_TOKEN}
    except FileNotFoundError:
        return set()


@pytest.fixture
async def cluster():
    """An embedded-manager cluster, closed (all processes stopped) after the test."""
    async with asyncio.timeout(60):
        c = rlinf.Cluster()
        await c.__aenter__()
    try:
        yield c
    finally:
        async with asyncio.timeout(60):
            await c.aclose()


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for the tests of one module (it takes seconds to start): the
    Ray node ids, the driver's first. One node, or, when the module sets
    ``RAY_NODES = 2``, two Ray nodes on this machine, the head with two logical GPUs.

    The test process joins it as a driver whose rlinf node id is its Ray node id, as
    ``rlinf.ray.init`` does, so it shares shared memory with the actors on its node."""
    ray = pytest.importorskip("ray")
    import rlinf.ray

    saved = os.environ.get("RLINF_NODE_ID")
    nodes = None
    try:
        # Logical CPUs: each actor asks for one by default; the machine has far fewer.
        if getattr(request.module, "RAY_NODES", 1) == 2:
            from ray.cluster_utils import Cluster as RayCluster

            nodes = RayCluster(initialize_head=True,
                               head_node_args={"num_cpus": 16, "num_gpus": 2, "include_dashboard": False})
            nodes.add_node(num_cpus=16)
            head = rlinf.ray.init(address=nodes.address, log_to_driver=False)
        else:
            head = rlinf.ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False)
        yield [head] + [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()
        if saved is None:
            os.environ.pop("RLINF_NODE_ID", None)
        else:
            os.environ["RLINF_NODE_ID"] = saved


@pytest.fixture(params=["local", "ray"])
def launcher(request) -> str:
    """Each launcher of ``cluster.spawn`` in turn (list it before ``cluster``/``driver``:
    the driver must join after Ray, as a driver of a Ray job would)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.fixture
async def driver(cluster):
    """The test process itself as worker ``driver:0`` of ``cluster``."""
    async with asyncio.timeout(30):
        comm = await cluster.connect("driver:0").start()
    try:
        yield comm
    finally:
        async with asyncio.timeout(30):
            await comm.aclose()


def _ours_or_orphaned(name: str) -> bool:
    """Segments are named ``rlinf-<pid>-...``. Count a new one against this test when its
    owner is this process, one of its descendants, or dead (nobody will unlink it);
    live processes of unrelated jobs on the same machine are not ours to judge."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return True
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return True                      # owner is gone: an orphaned segment
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            return True
        pid = int(fields[1])                 # walk up to the parent
    return False


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = _shm_entries()
    yield
    leaked = {n for n in _shm_entries() - before if _ours_or_orphaned(n)}
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
