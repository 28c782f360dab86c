"""The local launcher: an embedded manager and worker processes on this machine.

``async with rlinf.Cluster() as cluster`` starts a manager (loopback, random token)
unless given one; ``spawn`` starts processes with the spawn context, each connecting as
``name:rank``. Closing the cluster stops every process it started (ask, then SIGTERM,
then SIGKILL; each step bounded) and the manager. Nothing is left behind, also after
crashes: a child reports its ipc socket directory when it starts, and the driver
removes it, and the shared memory named after the child's pid, if the child died
without doing so (SIGKILL, OOM killer).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import itertools
import logging
import multiprocessing
import multiprocessing.util   # registers its exit hook now, so ours (registered later) runs first
import os
import pickle
import shutil
import signal
from typing import Any, Callable, Iterator

from .comm import Communicator
from .errors import ClosedError, CommTimeoutError, WorkerFailedError
from .manager import Manager
from .worker import child_main, is_worker_class, pipe_recv, pipe_send

__all__ = ["Cluster", "WorkerGroup"]

log = logging.getLogger("rlinf.cluster")

#: Seconds a killed process may take to be reaped.
_REAP_TIMEOUT = 5.0


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _sweep_shm(pid: int) -> None:
    """Unlink the shared memory a dead child left (it names its files after its pid)."""
    try:
        from .transports.shm import sweep
    except ImportError:   # no shared-memory transport in this build
        return
    try:
        sweep(pid)
    except OSError as exc:
        log.warning("rlinf: could not remove the shared memory of pid %d: %s", pid, exc)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _Proc:
    """Driver-side handle of one child: its process, pipe, result and pending calls."""

    def __init__(self, address: str, process, conn, loop: asyncio.AbstractEventLoop, takes_calls: bool) -> None:
        self.address = address
        self.process = process
        self.pid = process.pid
        self.conn = conn
        self.loop = loop
        self.takes_calls = takes_calls
        self.ipc_dir = ""
        self.killed = False
        self.error: WorkerFailedError | None = None   # set once the process is gone
        self.ready = loop.create_future()
        self.result = loop.create_future()
        self.exited = loop.create_future()
        self.calls: dict[int, asyncio.Future] = {}
        for fut in (self.ready, self.result):   # raised through join()/call(), or moot
            fut.add_done_callback(_retrieve)
        loop.add_reader(conn.fileno(), self._on_message)
        loop.add_reader(process.sentinel, self._on_exit)

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    def _on_message(self) -> None:
        try:
            while not self.conn.closed and self.conn.poll():
                self._handle(pipe_recv(self.conn))
        except (EOFError, OSError):
            self._stop_reading(self.conn)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "started":
            self.ipc_dir = message[1].get("ipc_dir", "")
        elif kind == "ready":
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
        """The process is gone: reap it, fail what waits on it, remove its leftovers."""
        if self.exited.done():
            return
        if not self.conn.closed:
            self._on_message()   # a result may still sit in the pipe
        self._stop_reading(self.process.sentinel)
        _sweep_shm(self.pid)   # before reaping: until then the pid cannot be reused
        # The sentinel fires as the process closes its files, a moment before it can be
        # reaped: this wait is that moment (bounded), not a wait for the process to finish.
        self.process.join(1.0)
        code = self.process.exitcode
        why = "was killed by group.kill()" if self.killed else _exit_reason(code)
        error = self.error = WorkerFailedError(f"worker {self.address} (pid {self.pid}) {why} without returning",
                                               address=self.address)
        for fut in [self.ready, self.result, *self.calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        self.calls.clear()
        if self.ipc_dir:
            # Only this (now dead) child used it; a clean exit already removed it.
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if not self.conn.closed:
            self._stop_reading(self.conn)
            self.conn.close()
        self.exited.set_result(code)

    def _stop_reading(self, source) -> None:
        fd = source if isinstance(source, int) else (None if source.closed else source.fileno())
        if fd is None:
            return
        try:
            self.loop.remove_reader(fd)
        except (ValueError, OSError):
            pass

    def send(self, message: tuple) -> None:
        if self.error is not None:
            raise self.error
        if self.conn.closed:
            raise WorkerFailedError(f"worker {self.address} is gone", address=self.address)
        try:
            pipe_send(self.conn, message)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailedError(f"worker {self.address} is gone", address=self.address) from exc

    def tell(self, message: tuple) -> None:
        """Best-effort message to a live child (used for finish/stop)."""
        if self.alive:
            with contextlib.suppress(WorkerFailedError):
                self.send(message)

    def signal(self, signum: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill_now(self) -> None:
        """SIGKILL, reap and clean up synchronously: for when the loop cannot be used
        (a cancelled close, interpreter exit)."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(_REAP_TIMEOUT)
        _sweep_shm(self.pid)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


async def _wait_exited(procs: list[_Proc], timeout: float) -> None:
    pending = [p.exited for p in procs if p.alive]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


class WorkerGroup:
    """The processes of one ``spawn`` call: ``name:0 .. name:n-1``."""

    def __init__(self, name: str, procs: list[_Proc]) -> None:
        self.name = name
        self._procs = procs
        self._call_ids = itertools.count(1)

    def __repr__(self) -> str:
        alive = sum(p.alive for p in self._procs)
        return f"<WorkerGroup {self.name} n={len(self._procs)} alive={alive}>"

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def addresses(self) -> list[str]:
        """``["name:0", ..., "name:n-1"]``."""
        return [p.address for p in self._procs]

    @property
    def pids(self) -> list[int]:
        """The process ids, in rank order."""
        return [p.pid for p in self._procs]

    def _select(self, ranks: list[int] | None) -> list[_Proc]:
        if ranks is None:
            return self._procs
        if isinstance(ranks, int) or not all(type(r) is int for r in ranks):
            raise TypeError(f"ranks must be a list of ints, got {ranks!r}")
        for r in ranks:
            if not 0 <= r < len(self._procs):
                raise ValueError(f"rank {r} is not in 0..{len(self._procs) - 1}")
        return [self._procs[r] for r in ranks]

    async def call(self, method: str, *args: Any, ranks: list[int] | None = None,
                   timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the Worker of every rank (or of ``ranks``).

        The calls run concurrently; plain and ``async`` methods both work. Arguments
        and results are pickled over the driver's pipe: pass bulk data through ``comm``.

        Returns:
            The results, in the order of ``ranks`` (rank order by default).

        Raises:
            TypeError: the group runs a function, not a :class:`rlinf.Worker`.
            ValueError: ``method`` is private or a rank is out of range.
            WorkerFailedError: a call raised (remote traceback attached) or a worker died.
            CommTimeoutError: not all answered within ``timeout`` (the calls keep running).
        """
        if not isinstance(method, str) or not method.isidentifier():
            raise TypeError(f"method must be a method name, got {method!r}")
        if method.startswith("_"):
            raise ValueError(f"{method!r} is private and cannot be called remotely")
        procs = self._select(ranks)
        if procs and not procs[0].takes_calls:
            raise TypeError(f"group {self.name!r} runs a function; only rlinf.Worker subclasses take calls")
        futures = []
        for p in procs:
            await p.ready   # spawn() returned, so this is done unless the worker died
            call_id = next(self._call_ids)
            fut = p.loop.create_future()
            fut.add_done_callback(_retrieve)   # a second failure after the first is raised is moot
            p.calls[call_id] = fut
            try:
                p.send(("call", call_id, method, args, kwargs))
            except BaseException:
                p.calls.pop(call_id, None)
                for f in futures:
                    f.cancel()
                raise
            futures.append(fut)
        return await _gather(futures, timeout, f"{self.name}.{method}()")

    async def join(self, timeout: float | None = None, *, ranks: list[int] | None = None) -> list[Any]:
        """Wait for the workers (all, or ``ranks``) to finish; their return values.

        A Worker without ``run()`` is told to finish first (it returns None). Returns
        once the processes have exited. On the first failure, the other joined workers
        are killed (nobody is left hanging, e.g. waiting for a message from the failed
        one) and the failure is raised. A rank killed with :meth:`kill` counts as
        failed: join the others with ``ranks``.

        Raises:
            WorkerFailedError: a worker raised (remote traceback attached) or died.
            CommTimeoutError: not all finished within ``timeout`` (they keep running).
        """
        procs = self._select(ranks)
        for p in procs:
            if p.ready.done() and not p.result.done():
                p.tell(("finish",))
        try:
            results = await _gather([p.result for p in procs], timeout, f"join of {self.name}", first_error=True)
        except WorkerFailedError:
            await self._kill(procs, deliberate=False)
            raise
        await _wait_exited(procs, _REAP_TIMEOUT)
        stuck = [p for p in procs if p.alive]
        if stuck:   # returned, then hung on the way out (e.g. a non-daemon thread)
            log.warning("rlinf: %s returned but did not exit; killing them", [p.address for p in stuck])
            await self._kill(stuck, deliberate=False)
        return results

    async def kill(self, rank: int | None = None) -> None:
        """Kill (SIGKILL) one rank, or every rank when ``rank`` is None, and reap it.

        For fault handling and tests: the worker gets no chance to clean up; its peers
        see it as lost (``PeerLostError``), and the driver removes its ipc socket files.
        """
        await self._kill(self._procs if rank is None else self._select([rank]), deliberate=True)

    async def _kill(self, procs: list[_Proc], *, deliberate: bool) -> None:
        for p in procs:
            if p.alive:
                p.killed = p.killed or deliberate
                p.signal(signal.SIGKILL)
        await _wait_exited(procs, _REAP_TIMEOUT)

    async def _stop(self, grace: float) -> None:
        """Ask, then SIGTERM, then SIGKILL (``grace`` seconds each): ``Cluster.aclose``."""
        for p in self._procs:
            p.tell(("stop",))
        await _wait_exited(self._procs, grace)
        for p in self._procs:
            p.signal(signal.SIGTERM)   # the child treats it as "stop" if its loop still runs
        await _wait_exited(self._procs, grace)
        for p in self._procs:
            p.signal(signal.SIGKILL)
        await _wait_exited(self._procs, _REAP_TIMEOUT)
        for p in self._procs:
            if p.alive:   # not reaped by the sentinel callback yet (it cannot fail to exit)
                await asyncio.get_running_loop().run_in_executor(None, p.process.join, _REAP_TIMEOUT)
                p._on_exit()
            with contextlib.suppress(ValueError):
                p.process.close()


async def _gather(futures: list[asyncio.Future], timeout: float | None, what: str, *,
                  first_error: bool = False) -> list[Any]:
    """Wait for the futures; on failure raise the error of the lowest failing rank.

    ``first_error`` stops at the first failure (``join``: the caller then kills the
    rest, who may be waiting on the failed one); otherwise every future is awaited
    (``call``), which makes the reported rank deterministic.
    """
    when = asyncio.FIRST_EXCEPTION if first_error else asyncio.ALL_COMPLETED
    try:
        async with asyncio.timeout(timeout):
            if futures:
                await asyncio.wait([asyncio.shield(f) for f in futures], return_when=when)
    except TimeoutError:
        raise CommTimeoutError(f"{what} did not finish within {timeout} s") from None
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process while a child is started, so the child has it from
    its first instruction (before it imports torch and the target's module)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Cluster:
    """A local cluster: an embedded manager (unless ``manager`` is given) and processes.

    Use it as ``async with rlinf.Cluster() as cluster``. Closing it stops every process
    it started (asked to stop, then SIGTERM, then SIGKILL) and the embedded manager,
    and removes what dead children left behind.

    Args:
        manager: endpoint of an existing manager to join instead of starting one.
        token: its token (required with ``manager``; generated otherwise).
        bind: where the embedded manager listens (default loopback, any port).
        stop_timeout: on close, seconds a worker gets to stop when asked, and again
            after SIGTERM, before it is killed with SIGKILL.
    """

    def __init__(self, manager: str | None = None, *, token: str | None = None,
                 bind: str = "tcp://127.0.0.1:0", stop_timeout: float = 5.0) -> None:
        if stop_timeout < 0:
            raise ValueError(f"stop_timeout must be >= 0, got {stop_timeout!r}")
        if manager is not None and not token:
            raise ValueError("joining an existing manager needs its token")
        self._external = manager
        self._token = token
        self._bind = bind
        self._stop_timeout = stop_timeout
        self._manager: Manager | None = None
        self._groups: list[WorkerGroup] = []
        self._comms: list[Communicator] = []
        self._closed = False
        self._mp = multiprocessing.get_context("spawn")
        self._exit_hook = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.manager_address or "not started"
        return f"<Cluster {state} groups={[g.name for g in self._groups]}>"

    @property
    def manager_address(self) -> str:
        """The manager's endpoint (give it to workers as ``RLINF_MANAGER``)."""
        return self._external or (self._manager.address if self._manager else "")

    @property
    def token(self) -> str:
        """The cluster token (give it to workers as ``RLINF_TOKEN``)."""
        return self._token or (self._manager.token if self._manager else "")

    @property
    def manager(self) -> Manager | None:
        """The embedded manager (None when joining an external one)."""
        return self._manager

    async def __aenter__(self) -> Cluster:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def start(self) -> Cluster:
        """Start the embedded manager (``async with`` does this). Returns self."""
        if self._closed:
            raise ClosedError("cluster is closed")
        if self._external is None and self._manager is None:
            self._manager = await Manager(self._bind, token=self._token).start()
        if not self._exit_hook:
            # Runs before multiprocessing's own exit hook, which would otherwise wait
            # forever for the children of a cluster nobody closed.
            atexit.register(self._kill_now)
            self._exit_hook = True
        return self

    def _kill_now(self) -> None:
        """Kill every child now, synchronously (interpreter exit, cancelled close)."""
        for group in self._groups:
            for p in group._procs:
                p.kill_now()

    async def spawn(self, target: Callable | type, name: str, n: int = 1, *, args: tuple = (),
                    kwargs: dict | None = None, env: dict[str, str] | None = None,
                    ready_timeout: float | None = 120.0) -> WorkerGroup:
        """Start ``n`` processes ``name:0..name:n-1`` running ``target``.

        Args:
            target: ``async def main(comm, *args, **kwargs)`` or a :class:`rlinf.Worker`
                subclass (constructed with ``*args, **kwargs``). It must be importable by
                the child (module level; under ``if __name__ == "__main__":`` in scripts).
            name: the group name (no ``:``).
            n: number of processes.
            args, kwargs: passed to every rank (pickled).
            env: extra environment variables for the children, set before they start
                (so ``CUDA_VISIBLE_DEVICES``, ``RLINF_NODE_ID``, ``OMP_NUM_THREADS`` work).
            ready_timeout: seconds for all of them to connect (and run ``setup()``).

        Returns:
            The :class:`WorkerGroup`, once every process is connected and set up.

        Raises:
            WorkerFailedError: a process failed before it was ready (the others of the
                group are killed).
            CommTimeoutError: not all were ready in time (all of the group are killed).
            TypeError / ValueError: bad arguments, or a target the children cannot import.
        """
        if self._closed:
            raise ClosedError("cluster is closed")
        if not self.manager_address:
            raise ClosedError("cluster is not started: use 'async with rlinf.Cluster() as cluster'")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a group name must be a non-empty str without ':', got {name!r}")
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        takes_calls = is_worker_class(target)
        if not takes_calls and not (inspect.iscoroutinefunction(target)
                                    or inspect.iscoroutinefunction(getattr(target, "__call__", None))):
            raise TypeError(f"target must be an 'async def main(comm, ...)' or a rlinf.Worker subclass, "
                            f"got {target!r}")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError("env must map str to str")
        try:
            pickle.dumps(target)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError(f"target {target!r} cannot be sent to a child process; define it at module "
                            f"level ({exc})") from None
        loop = asyncio.get_running_loop()
        procs: list[_Proc] = []
        group = WorkerGroup(name, procs)
        self._groups.append(group)
        try:
            for rank in range(n):
                parent, child = self._mp.Pipe()
                address = f"{name}:{rank}"
                process = self._mp.Process(
                    target=child_main, name=f"rlinf-{address}", daemon=False,
                    args=(target, address, rank, n, self.manager_address, self.token, tuple(args),
                          dict(kwargs or {}), dict(env or {}), child),
                )
                try:
                    with _environ(dict(env or {})):
                        process.start()
                finally:
                    child.close()
                procs.append(_Proc(address, process, parent, loop, takes_calls))
            async with asyncio.timeout(ready_timeout):
                await asyncio.gather(*(asyncio.shield(p.ready) for p in procs))
        except BaseException as exc:
            await group._kill(procs, deliberate=False)
            if isinstance(exc, TimeoutError):
                raise CommTimeoutError(f"workers of {name!r} did not connect within {ready_timeout} s") from None
            if isinstance(exc, WorkerFailedError):
                # prefer the worker's own traceback over "exited without returning"
                failed = next((p.result.exception() for p in procs
                               if p.result.done() and not p.result.cancelled()
                               and p.result.exception() is not None and p.result.exception().remote_traceback),
                              None)
                raise (failed or exc) from None
            raise
        return group

    async def create_channel(self, name: str, *, maxsize: int = 0, policy: Any = "fifo", **options: Any):
        """Start channel ``name`` in its own process; it stops when the cluster closes.

        Returns a :class:`rlinf.channel.Channel` handle usable from this (driver) process.
        Options as for :meth:`rlinf.Communicator.create_channel`.
        """
        from .channel.client import create_cluster_channel

        return await create_cluster_channel(self, name, maxsize=maxsize, policy=policy, **options)

    def connect(self, address: str, **options: Any) -> Communicator:
        """A communicator for the driver itself: ``async with cluster.connect("driver:0")``.

        The cluster closes it on ``aclose`` if the caller has not.
        """
        if self._closed:
            raise ClosedError("cluster is closed")
        comm = Communicator(address, manager=self.manager_address, token=self.token, **options)
        self._comms.append(comm)
        return comm

    async def aclose(self) -> None:
        """Stop every worker and the embedded manager; remove dead children's leftovers.

        Idempotent. Bounded: about ``2 * stop_timeout`` seconds for workers that ignore
        every request to stop, plus the time to reap them.
        """
        if self._closed:
            return
        self._closed = True
        if self._exit_hook:
            atexit.unregister(self._kill_now)
        try:
            for comm in self._comms:
                await comm.aclose()
            await asyncio.gather(*(g._stop(self._stop_timeout) for g in self._groups))
        except BaseException:   # cancelled (Ctrl-C) or broken: still leave nothing running
            self._kill_now()
            raise
        finally:
            if self._manager is not None:
                await self._manager.close()
