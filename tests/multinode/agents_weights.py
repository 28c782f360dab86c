"""Agents of the weight store's multi-node test (``tests.multinode.agents_weights:NAME``)."""

from __future__ import annotations

import numpy as np


def tree(version: int, nbytes: int) -> dict:
    """Four float32 arrays of ``nbytes`` in all, every element equal to ``version``."""
    return {f"t{i}": np.full(nbytes // 16, float(version), np.float32) for i in range(4)}


async def publish(comm, ctl, nbytes: int, versions: int):
    """Publish version 1 of :func:`tree`, then serve the test's commands: ``next``
    publishes the next version, ``stats`` answers with the store's bytes moved per path,
    ``exit`` ends."""
    ws = await comm.weights("nodes")
    v = 1
    await ws.publish(tree(v, nbytes), v)
    ctl.emit("published", version=v)
    while (cmd := (await ctl.next())["command"]) != "exit":
        if cmd == "next" and v < versions:
            v += 1
            await ws.publish(tree(v, nbytes), v)
            ctl.emit("published", version=v)
        elif cmd == "stats":
            ctl.emit("stats", bytes_by_path=(await ws.stats()).bytes_by_path)
    return {}


async def pull(comm, ctl, nbytes: int, versions: int):
    """Pull each version 1..versions into the same arrays (the next one when told
    ``again``); report whether every element holds the version and the bytes moved
    per path; stay (a relay's copy leaves with its process) until told ``exit``."""
    ws = await comm.weights("nodes")
    into = tree(-1, nbytes)
    for v in range(1, versions + 1):
        if v > 1:
            await ctl.command("again")
        got = await ws.pull(into, newer_than=v - 1, timeout=60)
        intact = got == v and all(bool((a == float(v)).all()) for a in into.values())
        ctl.emit("pulled", version=got, intact=intact, by_path=(await ws.stats()).this_bytes_by_path)
    await ctl.command("exit")
    return {}
