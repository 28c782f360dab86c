"""The local launcher: an embedded manager and worker processes on this machine.

``async with rlinf.Cluster() as cluster`` starts a manager (loopback, random token)
unless given one; ``spawn`` starts processes with the spawn context, each connecting as
``name:rank``. Closing the cluster stops every process it started (politely, then by
force) and the manager, so nothing is left behind, also after crashes.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
from typing import Any, Callable

from .comm import Communicator
from .errors import ClosedError, CommTimeoutError, WorkerFailedError
from .manager import Manager
from .worker import child_main

__all__ = ["Cluster", "WorkerGroup"]

_STOP_GRACE = 3.0


class _Proc:
    """Driver-side handle of one child: its process, pipe, result and pending calls."""

    def __init__(self, address: str, process, conn, loop: asyncio.AbstractEventLoop) -> None:
        self.address = address
        self.process = process
        self.conn = conn
        self.loop = loop
        self.ready = loop.create_future()
        self.result = loop.create_future()
        self.calls: dict[int, asyncio.Future] = {}
        loop.add_reader(conn.fileno(), self._on_message)
        loop.add_reader(process.sentinel, self._on_exit)

    def _on_message(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self._stop_reading()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            if not self.ready.done():
                self.ready.set_result(None)
        elif kind == "reply":
            fut = self.calls.pop(message[1], None)
            if fut is not None and not fut.done():
                ok, payload = message[2], message[3]
                if ok:
                    fut.set_result(payload)
                else:
                    fut.set_exception(WorkerFailedError(f"call on {self.address} raised",
                                                        address=self.address, remote_traceback=payload))
        elif kind == "result" and not self.result.done():
            ok, payload = message[1], message[2]
            if ok:
                self.result.set_result(payload)
            else:
                self.result.set_exception(WorkerFailedError(f"worker {self.address} failed",
                                                            address=self.address, remote_traceback=payload))

    def _on_exit(self) -> None:
        self._on_message()   # a result may still sit in the pipe
        self._stop_reading()
        self.process.join(0)
        error = WorkerFailedError(f"worker {self.address} exited with code {self.process.exitcode} "
                                  "without returning", address=self.address)
        for fut in [self.ready, self.result, *self.calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        self.calls.clear()
        for fut in (self.ready, self.result):   # reported through join()/call(); avoid "never retrieved"
            if fut.done() and not fut.cancelled():
                fut.exception()

    def _stop_reading(self) -> None:
        for fd in (self.conn.fileno() if not self.conn.closed else None, self.process.sentinel):
            if fd is not None:
                try:
                    self.loop.remove_reader(fd)
                except (ValueError, OSError):
                    pass

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailedError(f"worker {self.address} is gone", address=self.address) from exc


class WorkerGroup:
    """The processes of one ``spawn`` call: ``name:0 .. name:n-1``."""

    def __init__(self, name: str, procs: list[_Proc]) -> None:
        self.name = name
        self._procs = procs
        self._call_ids = itertools.count(1)

    def __repr__(self) -> str:
        alive = sum(p.process.is_alive() for p in self._procs)
        return f"<WorkerGroup {self.name} n={len(self._procs)} alive={alive}>"

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self._procs]

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._procs]

    def _select(self, ranks: list[int] | None) -> list[_Proc]:
        if ranks is None:
            return self._procs
        for r in ranks:
            if not isinstance(r, int) or not 0 <= r < len(self._procs):
                raise ValueError(f"rank {r!r} is not in 0..{len(self._procs) - 1}")
        return [self._procs[r] for r in ranks]

    async def call(self, method: str, *args: Any, ranks: list[int] | None = None,
                   timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the Worker of every (selected) rank.

        Returns:
            The results in rank order.

        Raises:
            WorkerFailedError: a call raised (with the remote traceback) or a worker died.
            CommTimeoutError: not all answered within ``timeout``.
        """
        if not isinstance(method, str):
            raise TypeError("method must be a method name (str)")
        procs = self._select(ranks)
        await asyncio.gather(*(p.ready for p in procs))
        futures = []
        for p in procs:
            call_id = next(self._call_ids)
            fut = p.loop.create_future()
            p.calls[call_id] = fut
            p.send(("call", call_id, method, args, kwargs))
            futures.append(fut)
        return await _gather(futures, timeout, f"{self.name}.{method}()")

    async def join(self, timeout: float | None = None) -> list[Any]:
        """Wait for every worker to finish; their return values in rank order.

        A Worker without ``run()`` is asked to stop first. On the first failure the
        remaining workers are killed (nobody is left hanging) and it is raised.

        Raises:
            WorkerFailedError (remote traceback attached), CommTimeoutError.
        """
        for p in self._procs:
            if p.ready.done() and not p.result.done() and p.process.is_alive():
                try:
                    p.send(("stop",))
                except WorkerFailedError:
                    pass
        try:
            return await _gather([p.result for p in self._procs], timeout, f"join of {self.name}")
        except WorkerFailedError:
            await self.kill()
            raise

    async def kill(self, rank: int | None = None) -> None:
        """Kill (SIGKILL) one rank, or every rank when ``rank`` is None, and reap it."""
        procs = self._procs if rank is None else self._select([rank])
        for p in procs:
            if p.process.is_alive():
                p.process.kill()
        for p in procs:
            await asyncio.get_running_loop().run_in_executor(None, p.process.join, 5.0)
            p._on_exit()

    async def _stop(self) -> None:
        """Ask politely, then terminate, then kill: used by ``Cluster.aclose``."""
        for p in self._procs:
            if p.process.is_alive():
                try:
                    p.send(("stop",))
                except WorkerFailedError:
                    pass
        loop = asyncio.get_running_loop()
        for p in self._procs:
            await loop.run_in_executor(None, p.process.join, _STOP_GRACE)
            if p.process.is_alive():
                p.process.terminate()
                await loop.run_in_executor(None, p.process.join, 2.0)
            if p.process.is_alive():
                p.process.kill()
                await loop.run_in_executor(None, p.process.join, 2.0)
            p._on_exit()


async def _gather(futures: list[asyncio.Future], timeout: float | None, what: str) -> list[Any]:
    try:
        async with asyncio.timeout(timeout):
            return list(await asyncio.gather(*(asyncio.shield(f) for f in futures)))
    except TimeoutError:
        raise CommTimeoutError(f"{what} did not finish within {timeout} s") from None


class Cluster:
    """A local cluster: embedded manager (unless ``manager`` is given) and worker processes.

    Args:
        manager: endpoint of an existing manager to join instead of starting one.
        token: its token (required with ``manager``; generated otherwise).
        bind: where the embedded manager listens (default loopback, any port).
    """

    def __init__(self, manager: str | None = None, *, token: str | None = None,
                 bind: str = "tcp://127.0.0.1:0") -> None:
        if manager is not None and not token:
            raise ValueError("joining an existing manager needs its token")
        self._external = manager
        self._token = token
        self._bind = bind
        self._manager: Manager | None = None
        self._groups: list[WorkerGroup] = []
        self._comms: list[Communicator] = []
        self._closed = False
        self._mp = multiprocessing.get_context("spawn")

    def __repr__(self) -> str:
        return f"<Cluster {self.manager_address} groups={[g.name for g in self._groups]}>"

    @property
    def manager_address(self) -> str:
        return self._external or (self._manager.address if self._manager else "")

    @property
    def token(self) -> str:
        return self._token or (self._manager.token if self._manager else "")

    @property
    def manager(self) -> Manager | None:
        """The embedded manager (None when joining an external one)."""
        return self._manager

    async def __aenter__(self) -> Cluster:
        if self._external is None:
            self._manager = await Manager(self._bind, token=self._token).start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def spawn(self, target: Callable | type, name: str, n: int = 1, *, args: tuple = (),
                    kwargs: dict | None = None, env: dict[str, str] | None = None,
                    ready_timeout: float | None = 60.0) -> WorkerGroup:
        """Start ``n`` processes ``name:0..n-1`` running ``target``.

        ``target`` is ``async def main(comm, *args, **kwargs)`` (module level, so the
        spawn context can import it) or a :class:`rlinf.Worker` subclass (constructed
        with ``*args, **kwargs``). Returns once every process is connected.

        Raises:
            WorkerFailedError: a process failed before it was ready.
        """
        if self._closed:
            raise ClosedError("cluster is closed")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a group name must be a non-empty str without ':', got {name!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        loop = asyncio.get_running_loop()
        procs = []
        for rank in range(n):
            parent, child = self._mp.Pipe()
            address = f"{name}:{rank}"
            process = self._mp.Process(
                target=child_main, name=f"rlinf-{address}", daemon=False,
                args=(target, address, rank, n, self.manager_address, self.token, tuple(args),
                      dict(kwargs or {}), dict(env or {}), child),
            )
            process.start()
            child.close()
            procs.append(_Proc(address, process, parent, loop))
        group = WorkerGroup(name, procs)
        self._groups.append(group)
        try:
            async with asyncio.timeout(ready_timeout):
                await asyncio.gather(*(asyncio.shield(p.ready) for p in procs))
        except TimeoutError:
            raise CommTimeoutError(f"workers of {name!r} did not connect within {ready_timeout} s") from None
        except WorkerFailedError as exc:
            failed = next((p for p in procs if p.result.done() and not p.result.cancelled()
                           and p.result.exception() is not None), None)
            if failed is not None:
                raise failed.result.exception() from None
            raise exc
        return group

    def connect(self, address: str, **options: Any) -> Communicator:
        """A communicator for the driver itself (``async with cluster.connect("driver:0")``)."""
        comm = Communicator(address, manager=self.manager_address, token=self.token, **options)
        self._comms.append(comm)
        return comm

    async def aclose(self) -> None:
        """Stop every worker and the embedded manager. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for comm in self._comms:
                await comm.aclose()
            await asyncio.gather(*(g._stop() for g in self._groups))
        finally:
            if self._manager is not None:
                await self._manager.close()
