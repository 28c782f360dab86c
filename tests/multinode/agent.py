"""Run one agent of ``agents.py`` as an rlinf worker inside an emulated node.

``python -m tests.multinode.agent FUNCTION KWARGS_JSON``, with ``RLINF_ADDRESS``,
``RLINF_MANAGER`` and ``RLINF_TOKEN`` set (``Nodes.agent`` does it); a FUNCTION written
``module:name`` is ``name`` of that module instead (``benchmarks.chaos:worker``). The worker joins as
any user's process would, ``rlinf.connect()`` from the environment, then runs
``await agents.FUNCTION(comm, ctl, **kwargs)``. It talks to the test through ``ctl``:
events out on stdout (``@@ {json}`` lines), commands in on stdin (JSON lines).
Whatever the function returns (a dict) is sent as a ``result`` event; an exception as
an ``error`` event with its traceback, and the process exits with status 1.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
import sys
import time
import traceback

import rlinf
from rlinf.control.client import run

from . import agents

EVENT_PREFIX = "@@ "


class Control:
    """The agent's side of the conversation with the test."""

    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._pending: list[dict] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self._reader), sys.stdin)

    def emit(self, kind: str, **fields) -> None:
        """Tell the test something (``now`` is the monotonic clock, shared by the nodes)."""
        sys.stdout.write(EVENT_PREFIX + json.dumps({"kind": kind, "now": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()

    async def command(self, name: str, timeout: float = 120.0) -> dict:
        """Wait for the test's next command ``name`` (others that come first are kept)."""
        for i, cmd in enumerate(self._pending):
            if cmd["command"] == name:
                return self._pending.pop(i)
        async with asyncio.timeout(timeout):
            while (cmd := await self._read(name))["command"] != name:
                self._pending.append(cmd)
        return cmd

    async def next(self, timeout: float = 300.0) -> dict:
        """The test's next command, whatever it is."""
        if self._pending:
            return self._pending.pop(0)
        async with asyncio.timeout(timeout):
            return await self._read("a command")

    async def _read(self, what: str) -> dict:
        line = await self._reader.readline()
        if not line:
            raise EOFError(f"the test closed our stdin while we waited for {what}")
        return json.loads(line)


async def _main(function: str, kwargs: dict) -> None:
    ctl = Control()
    await ctl.start()
    module, _, name = function.rpartition(":")
    target = getattr(importlib.import_module(module) if module else agents, name)
    try:
        async with asyncio.timeout(60):
            comm = await rlinf.connect().start()
        try:
            ctl.emit("started", address=comm.address, hostname=socket.gethostname(), pid=os.getpid())
            result = await target(comm, ctl, **kwargs)
            ctl.emit("result", **(result or {}))
        finally:
            async with asyncio.timeout(30):
                await comm.aclose()
        ctl.emit("closed")
    except BaseException as exc:
        ctl.emit("error", error="".join(traceback.format_exception(exc)))
        raise


if __name__ == "__main__":
    run(_main(sys.argv[1], json.loads(sys.argv[2])))
