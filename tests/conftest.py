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


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = _shm_entries()
    yield
    leaked = _shm_entries() - before
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
