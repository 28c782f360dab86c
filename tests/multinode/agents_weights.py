"""Agents of the weight store's multi-node test (``tests.multinode.agents_weights:NAME``)."""

from __future__ import annotations

import numpy as np

import rlinf


def tree(version: int, nbytes: int) -> dict:
    """Four float32 arrays of ``nbytes`` in all, every element equal to ``version``."""
    return {f"t{i}": np.full(nbytes // 16, float(version), np.float32) for i in range(4)}


async def publish(comm, ctl, nbytes: int, versions: int, first: int = 1, small_first: bool = False):
    """Publish versions ``1..first`` of :func:`tree` at once (version 1 an eighth of the
    size when ``small_first``), then serve the test's
    commands: ``next`` publishes the next version, ``stats`` answers with the store's
    bytes moved per path and the pulls waiting, ``exit`` ends."""
    ws = await comm.weights("nodes")
    v = 0
    while v < first:
        v += 1
        await ws.publish(tree(v, nbytes // 8 if small_first and v == 1 else nbytes), v)
        ctl.emit("published", version=v)
    while (cmd := (await ctl.next())["command"]) != "exit":
        if cmd == "next" and v < versions:
            v += 1
            await ws.publish(tree(v, nbytes), v)
            ctl.emit("published", version=v)
        elif cmd == "stats":
            stats = await ws.stats()
            ctl.emit("stats", bytes_by_path=stats.bytes_by_path, waiting=stats.waiting)
    return {}


async def pull(comm, ctl, nbytes: int, versions: int, small_first: bool = False):
    """Pull each version 1..versions into the same arrays (the next one when told
    ``again``; version 1 into smaller ones when ``small_first``); report whether every
    element holds the version and the bytes moved per path; stay (a relay's copy
    leaves with its process) until told ``exit``; a ``PeerLostError`` is reported
    (``lost``) and ends the pulling."""
    ws = await comm.weights("nodes")
    into = tree(-1, nbytes)
    for v in range(1, versions + 1):
        if v > 1:
            await ctl.command("again")
        target = tree(-1, nbytes // 8) if small_first and v == 1 else into
        try:
            got = await ws.pull(target, newer_than=v - 1, timeout=60)
        except rlinf.PeerLostError as exc:
            ctl.emit("lost", version=v, error=str(exc))
            break
        intact = got == v and all(bool((a == float(v)).all()) for a in target.values())
        ctl.emit("pulled", version=got, intact=intact, by_path=(await ws.stats()).this_bytes_by_path)
    await ctl.command("exit")
    return {}
