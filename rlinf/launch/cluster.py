"""The cluster and its local launcher: an embedded manager and worker processes.

``async with rlinf.Cluster() as cluster`` starts a manager (loopback, random token)
unless given one; ``spawn`` starts processes with the spawn context, each connecting as
``name:rank`` (or Ray actors with ``launcher="ray"``: ``rlinf.ray``; the group logic
is shared, see ``rlinf.launch.base``). Closing the cluster stops every process it started (ask, then SIGTERM,
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
import logging
import multiprocessing
import multiprocessing.util   # registers its exit hook now, so ours (registered later) runs first
import os
import pickle
import signal
import sys
from typing import Any, Callable, Iterator

from ..channel.client import create_cluster_channel
from ..communicator import Communicator
from ..config import Settings
from ..errors import ClosedError, CommTimeoutError, WorkerFailedError
from ..control.cleanup import remove_leftovers
from .base import REAP_TIMEOUT, LaunchSpec, Launcher, RankHandle, WorkerGroup
from ..control.manager import Manager
from ..util.pipe import MessagePipe
from .worker import child_main, is_worker_class

__all__ = ["Cluster", "WorkerGroup"]

log = logging.getLogger("rlinf.launch.cluster")

def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _main_is_a_file() -> bool:
    """Whether ``__main__`` is a file that spawned children can import again."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(path) and os.path.isfile(path)


class _Proc(RankHandle):
    """A rank that is a child process of this driver: its process and pipe (``conn``,
    owned from now on)."""

    def __init__(self, address: str, process, conn, loop: asyncio.AbstractEventLoop, takes_calls: bool) -> None:
        super().__init__(address, loop, takes_calls, pid=process.pid)
        self.process = process
        self.pipe = MessagePipe(conn)
        self.pipe.start(loop, self._handle)   # its EOF says nothing the exit sentinel does not
        loop.add_reader(process.sentinel, self._on_exit)

    def _on_exit(self) -> None:
        """The process is gone: reap it, fail what waits on it, remove its leftovers."""
        if self.exited.done():
            return
        # A result may still sit in the pipe: the child wrote all of it before exiting.
        self.pipe.drain()
        self._stop_reading(self.process.sentinel)
        remove_leftovers(self.pid, self.socket_dirs)   # before reaping: until then the pid cannot be reused
        # The sentinel fires as the process closes its files, a moment before it can be
        # reaped: this wait is that moment (bounded), not a wait for the process to finish.
        self.process.join(1.0)
        self.pipe.close()
        code = self.process.exitcode
        if code is not None:   # reaped: release its pipe fds now, not at cluster close
            self.process.close()
        self._finish(_exit_reason(code), code)

    def _stop_reading(self, fd: int) -> None:
        try:
            self.loop.remove_reader(fd)
        except (ValueError, OSError):
            pass

    def send(self, message: tuple) -> None:
        if self.error is not None:
            raise self.error
        if self.pipe.closed:
            raise WorkerFailedError(f"worker {self.address} is gone", address=self.address)
        try:
            self.pipe.send(message)   # queued; written as the child reads
        except OSError as exc:
            raise WorkerFailedError(f"worker {self.address} is gone", address=self.address) from exc

    def _signal(self, signum: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    async def reap(self, timeout: float) -> None:
        if self.alive:   # not reaped by the sentinel callback yet (it cannot fail to exit)
            await self.loop.run_in_executor(None, self.process.join, timeout)
            self._on_exit()
        with contextlib.suppress(ValueError):
            self.process.close()

    def kill_now(self) -> None:
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(REAP_TIMEOUT)
        remove_leftovers(self.pid, self.socket_dirs)


class _LocalLauncher:
    """Starts each rank as a process of this machine (the spawn context)."""

    def __init__(self, mp) -> None:
        self._mp = mp

    async def launch(self, spec: LaunchSpec, group: WorkerGroup) -> None:
        loop = asyncio.get_running_loop()
        for rank in range(spec.n):
            parent, child = self._mp.Pipe()
            address = f"{spec.name}:{rank}"
            process = self._mp.Process(
                target=child_main, name=f"rlinf-{address}", daemon=False,
                args=(spec.target, address, rank, spec.n, spec.manager, spec.token, spec.args,
                      spec.kwargs, spec.env, child),
            )
            try:
                with _environ(spec.env):
                    process.start()   # pickles the arguments (the target was checked before)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                parent.close()
                raise TypeError(f"the args/kwargs of {spec.name!r} cannot be sent to a child process: "
                                f"{exc!r}") from None
            finally:
                child.close()
            group._add(_Proc(address, process, parent, loop, spec.takes_calls))


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

    ``RLINF_TIMEOUT`` (read when the cluster is constructed) is the default ``timeout``
    of its groups' ``call`` and ``join``.
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
        self._timeout = Settings.from_env().timeout    # here, not at import: launchers set variables late
        self._manager: Manager | None = None
        self._groups: list[WorkerGroup] = []
        self._comms: list[Communicator] = []
        self._closed = False
        self._local = _LocalLauncher(multiprocessing.get_context("spawn"))
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
        """Kill every worker now, synchronously (interpreter exit, cancelled close)."""
        for group in self._groups:
            group._kill_now()

    async def spawn(self, target: Callable | type, name: str, n: int = 1, *, args: tuple = (),
                    kwargs: dict | None = None, env: dict[str, str] | None = None,
                    ready_timeout: float | None = 120.0, launcher: str | Launcher = "local",
                    resources: dict[str, float] | None = None, placement: Any = None,
                    max_restarts: int | None = None) -> WorkerGroup:
        """Start ``n`` workers ``name:0..name:n-1`` running ``target``.

        Args:
            target: ``async def main(comm, *args, **kwargs)`` or a :class:`rlinf.Worker`
                subclass (constructed with ``*args, **kwargs``). It must be importable by
                the child (module level; under ``if __name__ == "__main__":`` in scripts).
            name: the group name (no ``:``).
            n: number of workers.
            args, kwargs: passed to every rank (pickled).
            env: extra environment variables for the workers, set before they start
                (so ``CUDA_VISIBLE_DEVICES``, ``RLINF_NODE_ID``, ``OMP_NUM_THREADS`` work).
            ready_timeout: seconds for all of them to connect (and run ``setup()``).
            launcher: ``"local"`` (processes of this machine), ``"ray"`` (Ray actors,
                placed by Ray: see ``docs/ray.md``; needs ``aiorlinf[ray]``), or a launcher
                object such as ``rlinf.ray.RayLauncher(...)``.
            resources, placement, max_restarts: for ``launcher="ray"`` only; see
                :class:`rlinf.ray.RayLauncher`.

        Returns:
            The :class:`WorkerGroup`, once every worker is connected and set up.

        Raises:
            WorkerFailedError: a worker failed before it was ready (the others of the
                group are killed).
            CommTimeoutError: not all were ready in time (all of the group are killed).
            TypeError / ValueError: bad arguments, a target the children cannot import, or
                ``name`` is the name of a group of this cluster that still runs.
            ImportError: ``launcher="ray"`` without Ray installed.
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
        if launcher == "local" and getattr(target, "__module__", None) == "__main__" and not _main_is_a_file():
            raise TypeError(f"target {target!r} is defined in a program that has no file (stdin, python -c "
                            f"or a notebook): child processes cannot import it; put it in a module")
        chosen = self._launcher(launcher, resources=resources, placement=placement, max_restarts=max_restarts)
        spec = LaunchSpec(target, name, n, tuple(args), dict(kwargs or {}), dict(env or {}), takes_calls,
                          self.manager_address, self.token)
        # finished groups need no stopping: holding them would keep their results alive
        self._groups = [g for g in self._groups if not g._retire_if_done()]
        if any(g.name == name for g in self._groups):
            raise ValueError(f"a group named {name!r} is still running in this cluster: its workers "
                             f"would take each other's addresses; join or kill it first, or pick another name")
        group = WorkerGroup(name, timeout=self._timeout)
        self._groups.append(group)
        group._launching = True
        try:
            async with asyncio.timeout(ready_timeout):
                await chosen.launch(spec, group)
                await asyncio.gather(*(asyncio.shield(p.ready) for p in group._ranks))
        except BaseException as exc:
            await group._kill(group._ranks, deliberate=False)
            if isinstance(exc, TimeoutError):
                raise CommTimeoutError(f"workers of {name!r} did not connect within {ready_timeout} s") from None
            if isinstance(exc, WorkerFailedError):
                # prefer the worker's own traceback over "exited without returning"
                failed = next((p.result.exception() for p in group._ranks
                               if p.result.done() and not p.result.cancelled()
                               and p.result.exception() is not None and p.result.exception().remote_traceback),
                              None)
                raise (failed or exc) from None
            raise
        finally:
            group._launching = False
        return group

    def _launcher(self, launcher: str | Launcher, **ray_options: Any) -> Launcher:
        given = {k: v for k, v in ray_options.items() if v is not None}
        if launcher == "ray":
            from .ray import RayLauncher   # imports ray: only when asked for

            return RayLauncher(**given)
        if given:
            raise ValueError(f"{sorted(given)} are options of launcher='ray'"
                             + ("" if launcher == "local" else "; give them to the launcher object"))
        if launcher == "local":
            return self._local
        if isinstance(launcher, str) or not callable(getattr(launcher, "launch", None)):
            raise ValueError(f"launcher must be 'local', 'ray' or a launcher object, got {launcher!r}")
        return launcher

    async def create_channel(self, name: str, *, maxsize: int = 0, policy: Any = "fifo", **options: Any):
        """Start channel ``name`` in its own process; it stops when the cluster closes.

        Returns a :class:`rlinf.channel.Channel` handle usable from this (driver) process.
        Options as for :meth:`rlinf.Communicator.create_channel`.
        """
        return await create_cluster_channel(self, name, maxsize=maxsize, policy=policy, **options)

    def connect(self, address: str, **options: Any) -> Communicator:
        """A communicator for the driver itself: ``async with cluster.connect("driver:0")``.

        The cluster closes it on ``aclose`` if the caller has not.

        Raises:
            ValueError: this cluster has an open communicator with that address.
        """
        if self._closed:
            raise ClosedError("cluster is closed")
        self._comms = [c for c in self._comms if not c.closed]
        if any(c.address == address for c in self._comms):
            raise ValueError(f"this cluster already has a communicator {address!r}: close it first")
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
                try:
                    await comm.aclose()
                except CommTimeoutError as exc:   # its peers are being stopped: what they missed is moot
                    log.warning("rlinf: %s", exc)
            await asyncio.gather(*(g._stop(self._stop_timeout) for g in self._groups))
        except BaseException:   # cancelled (Ctrl-C) or broken: still leave nothing running
            self._kill_now()
            raise
        finally:
            if self._manager is not None:
                await self._manager.close()
