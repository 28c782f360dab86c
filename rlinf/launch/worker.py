"""``rlinf.Worker`` and the code that runs inside a spawned worker process.

A spawned process connects as ``name:rank``, then either runs ``async def main(comm,
*args)`` or instantiates a :class:`Worker` subclass, calls its ``setup()``, serves
remote calls from the driver and, if it defines ``run()``, returns what ``run()``
returns.

Driver and child talk over a private pipe. Child to driver: ``("started", info)`` once
the communicator is up (``info`` names its socket directories, which the driver
removes if the child is killed before it can), ``("ready",)`` after ``setup()``,
``("reply", call_id, ok, value_or_traceback)``, ``("result", ok, value_or_traceback)``.
Driver to child: ``("call", call_id, method, arguments)``; ``("finish",)`` (a Worker
without ``run()`` returns None; others ignore it); ``("stop",)`` (cancel the work and
close cleanly: what closing the cluster sends). SIGTERM means ``stop`` too. The pipe
closing means the driver died: the child stops as well instead of lingering (and exits
hard if stopping takes longer than a grace period). Messages travel as ``rlinf.util.pipe``
frames; the result is written after the loop has finished, blocking until it is all
in the pipe. A value (a reply's or the result's, when ``ok``) and a call's ``arguments``
(``(args, kwargs)``) travel pickled a second time, as bytes inside the message: a side
that cannot unpickle one (its class is not importable there, say) fails that call or
that result with the reason, instead of losing the message and leaving its caller
waiting.

:func:`run_worker` is the whole child side and needs no process of its own: the local
launcher runs it as a process (:func:`child_main`), the Ray launcher on a thread of an
actor (``rlinf.ray``), where the actor relays the pipe to the driver.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
import threading
import traceback
from typing import Any

from ..control import client as control
from ..communicator import Communicator
from ..info import socket_dirs
from ..util.pipe import MessagePipe, dump_value, load_value

__all__ = ["Worker", "run_worker"]

#: Seconds a child whose driver died may take to close cleanly before it exits hard.
_ORPHAN_GRACE = 10.0


class Worker:
    """Base class for workers started with ``cluster.spawn(MyWorker, "name", n)``.

    The driver's ``args``/``kwargs`` go to ``__init__``. Set before ``setup()`` runs:
    ``comm`` (the :class:`~rlinf.Communicator`), ``address`` (``"name:rank"``), ``rank``
    and ``world_size`` (of its group).

    Optional hooks, plain or ``async``: ``setup(self)`` (once, before any remote call)
    and ``run(self)`` (the worker's main loop; its return value is what
    ``group.join()`` returns for this rank). Without ``run()`` the worker serves calls
    until ``group.join()`` or the cluster stops it. Public methods, plain or ``async``,
    can be called from the driver with ``group.call("method", *args, **kwargs)``;
    arguments and results travel pickled over a pipe (use ``comm`` for bulk data).
    """

    comm: Communicator
    address: str
    rank: int
    world_size: int

    async def setup(self) -> None:
        """Called once after connecting, before any remote call."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'address', '?')}>"


def is_worker_class(target: Any) -> bool:
    return isinstance(target, type) and issubclass(target, Worker)


class _Child:
    """The child's end of the pipe, while the loop runs: dispatches the driver's requests.
    ``run_worker`` owns the pipe; this only starts and stops watching it."""

    def __init__(self, pipe: MessagePipe, main_task: asyncio.Task) -> None:
        self.pipe = pipe
        self.main_task = main_task
        self.loop = asyncio.get_running_loop()
        self.worker: Worker | None = None
        self.finish = asyncio.Event()
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()
        # Only a process of its own treats SIGTERM as "stop" (signals reach the main thread).
        self.on_signals = threading.current_thread() is threading.main_thread()
        if self.on_signals:
            self.loop.add_signal_handler(signal.SIGTERM, self.stop)
        pipe.start(self.loop, self._dispatch, self._orphaned)   # EOF: the driver died, do not outlive it

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.pipe.stop()   # what is still queued goes out with the result
        if self.on_signals:
            self.loop.remove_signal_handler(signal.SIGTERM)

    def send(self, message: tuple) -> None:
        try:
            self.pipe.send(message)
        except OSError:
            self._orphaned()

    def stop(self) -> None:
        """Cancel the worker's main coroutine (once); the communicator then closes."""
        if not self.stopping:
            self.stopping = True
            self.main_task.cancel()

    def _orphaned(self) -> None:
        self.stop()
        timer = threading.Timer(_ORPHAN_GRACE, os._exit, (1,))
        timer.daemon = True
        timer.start()

    def _dispatch(self, request: tuple) -> None:
        kind = request[0]
        if kind == "stop":
            self.stop()
        elif kind == "finish":
            self.finish.set()
        elif kind == "call":
            task = self.loop.create_task(self._answer(*request[1:]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _answer(self, call_id: int, method: str, arguments: bytes) -> None:
        try:
            if self.worker is None:
                raise TypeError("this worker runs a function; only rlinf.Worker subclasses take calls")
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private and cannot be called remotely")
            args, kwargs = load_value(arguments, f"the arguments of {method}()")
            result = getattr(self.worker, method)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            reply = ("reply", call_id, True, dump_value(result))
        except Exception:   # also: the result cannot be pickled
            reply = ("reply", call_id, False, traceback.format_exc())
        self.send(reply)


async def _run_child(target, address: str, rank: int, world_size: int, manager: str, token: str,
                     args: tuple, kwargs: dict, pipe: MessagePipe) -> Any:
    child = _Child(pipe, asyncio.current_task())
    try:
        async with Communicator(address, manager=manager, token=token) as comm:
            child.send(("started", {"pid": os.getpid(), "socket_dirs": socket_dirs(comm.info)}))
            if not is_worker_class(target):
                child.send(("ready",))
                return await target(comm, *args, **kwargs)
            worker = target(*args, **kwargs)
            worker.comm, worker.address, worker.rank, worker.world_size = comm, address, rank, world_size
            ready = worker.setup()     # a plain ``def setup`` is fine too
            if inspect.isawaitable(ready):
                await ready
            child.worker = worker
            child.send(("ready",))
            run = getattr(worker, "run", None)
            if run is not None:
                result = run()
                return await result if inspect.isawaitable(result) else result
            await child.finish.wait()
            return None
    finally:
        child.close()


def run_worker(target, address: str, rank: int, world_size: int, manager: str, token: str,
               args: tuple, kwargs: dict, conn) -> bool:
    """Run one rank to the end on a new event loop, report its result over ``conn`` (a
    ``multiprocessing`` pipe end, which it owns from now on) and close ``conn``. Returns
    whether it succeeded. Any thread may run it."""
    pipe = MessagePipe(conn)
    try:
        result = control.run(_run_child(target, address, rank, world_size, manager, token, args, kwargs, pipe))
        message = ("result", True, dump_value(result))
    except asyncio.CancelledError:
        message = ("result", False, f"{address} was stopped before it returned\n")
    except BaseException:   # also: the result cannot be pickled
        message = ("result", False, traceback.format_exc())
    try:
        pipe.send_blocking(message)   # no loop any more: wait until the driver has it all
    except OSError:
        pass   # the driver is gone: nobody is left to tell
    finally:
        pipe.close()
    return message[1]


def child_main(target, address: str, rank: int, world_size: int, manager: str, token: str,
               args: tuple, kwargs: dict, env: dict[str, str], conn) -> None:
    """Process entry point (module level so the spawn context can import it)."""
    os.environ.update(env)
    ok = run_worker(target, address, rank, world_size, manager, token, args, kwargs, conn)
    sys.exit(0 if ok else 1)
