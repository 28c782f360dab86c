"""``rlinf.Worker`` and the code that runs inside a spawned worker process.

A spawned process connects as ``name:rank``, then either runs ``async def main(comm,
*args)`` or instantiates a :class:`Worker` subclass, calls its ``setup()``, serves
remote calls from the driver and, if it defines ``run()``, returns what ``run()``
returns. Driver and child talk over a private pipe (calls, results, stop); the pipe
closing means the driver died, and the child exits instead of lingering.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import traceback
from typing import Any

from . import control
from .comm import Communicator

__all__ = ["Worker"]


class Worker:
    """Base class for workers started with ``cluster.spawn(MyWorker, "name", n)``.

    Attributes set before ``setup()`` runs: ``comm`` (the :class:`Communicator`),
    ``address``, ``rank`` and ``world_size`` (of its group). Public methods (plain or
    ``async``) can be called from the driver with ``group.call("method", ...)``.
    """

    comm: Communicator
    address: str
    rank: int
    world_size: int

    async def setup(self) -> None:
        """Called once after connecting, before any remote call."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'address', '?')}>"


async def _serve_pipe(conn, worker: Worker | None, stop: asyncio.Event) -> None:
    """Answer the driver's calls; set ``stop`` on request or when the driver is gone."""
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue = asyncio.Queue()

    def on_readable() -> None:
        try:
            while conn.poll():
                requests.put_nowait(conn.recv())
        except (EOFError, OSError):
            requests.put_nowait(None)

    loop.add_reader(conn.fileno(), on_readable)
    try:
        while True:
            request = await requests.get()
            if request is None:          # the driver died: do not outlive it
                os._exit(1)
            if request[0] == "stop":
                stop.set()
                continue
            _, call_id, method, args, kwargs = request
            loop.create_task(_answer(conn, worker, call_id, method, args, kwargs))
    finally:
        loop.remove_reader(conn.fileno())


async def _answer(conn, worker: Worker | None, call_id: int, method: str, args, kwargs) -> None:
    try:
        if worker is None:
            raise TypeError("this worker runs a function; only rlinf.Worker subclasses take calls")
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is private and cannot be called remotely")
        fn = getattr(worker, method)
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        reply = ("reply", call_id, True, result)
    except Exception:
        reply = ("reply", call_id, False, traceback.format_exc())
    try:
        conn.send(reply)
    except Exception:   # result not picklable: report that instead
        conn.send(("reply", call_id, False, traceback.format_exc()))


async def _run_child(target, address: str, rank: int, world_size: int, manager: str, token: str,
                     args: tuple, kwargs: dict, conn) -> Any:
    async with Communicator(address, manager=manager, token=token) as comm:
        stop = asyncio.Event()
        is_class = isinstance(target, type) and issubclass(target, Worker)
        worker = None
        if is_class:
            worker = target(*args, **kwargs)
            worker.comm, worker.address, worker.rank, worker.world_size = comm, address, rank, world_size
            await worker.setup()
        server = asyncio.get_running_loop().create_task(_serve_pipe(conn, worker, stop))
        conn.send(("ready",))
        try:
            if not is_class:
                return await target(comm, *args, **kwargs)
            if hasattr(worker, "run"):
                return await worker.run()
            await stop.wait()
            return None
        finally:
            server.cancel()


def child_main(target, address: str, rank: int, world_size: int, manager: str, token: str,
               args: tuple, kwargs: dict, env: dict[str, str], conn) -> None:
    """Process entry point (module level so the spawn context can import it)."""
    os.environ.update(env)
    try:
        result = control.run(_run_child(target, address, rank, world_size, manager, token, args, kwargs, conn))
        message = ("result", True, result)
    except BaseException:
        message = ("result", False, traceback.format_exc())
    try:
        conn.send(message)
    except Exception:
        conn.send(("result", False, traceback.format_exc()))
    finally:
        conn.close()
    sys.exit(0 if message[1] else 1)
