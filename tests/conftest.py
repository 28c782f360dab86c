"""Shared fixtures: a local cluster per test, and a check that no shared memory leaks."""

from __future__ import annotations

import asyncio
import os

import pytest

import rlinf


def _shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if "rlinf" in name}
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
