"""Worker groups, written against a small launcher plug-in.

A launcher starts the ranks of a group somewhere (processes on this machine: the local
launcher in ``rlinf.launch.cluster``; Ray actors: ``rlinf.ray``) and gives the group one
:class:`RankHandle` per rank. Every rank runs :func:`rlinf.launch.worker.run_worker` and talks
to the driver with the pipe protocol of ``rlinf.launch.worker``; the handle turns those
messages into futures (ready, result, exited, one per pending call). So calls, join,
kill, fail-fast and close behave the same whatever placed the ranks.

A launcher implements :class:`Launcher` (``launch``) and a handle subclass: ``send``,
``kill``, ``kill_now`` and, optionally, ``terminate`` and ``reap``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..control.cleanup import remove_leftovers
from ..errors import CommTimeoutError, WorkerFailedError
from ..info import check_timeout
from ..util.futures import retrieve
from ..util.pipe import dump_value, load_value

__all__ = ["LaunchSpec", "Launcher", "RankHandle", "WorkerGroup", "wait_gone"]

log = logging.getLogger("rlinf.launch.cluster")

#: Seconds a killed worker may take to be reaped.
REAP_TIMEOUT = 5.0


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` of this machine (a child or not)
    to exit, with a pidfd (no polling). Returns whether it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LaunchSpec:
    """What ``Cluster.spawn`` asks a launcher to start: ranks ``name:0..name:n-1``."""

    target: Any
    name: str
    n: int
    args: tuple
    kwargs: dict
    env: dict[str, str]
    takes_calls: bool
    manager: str
    token: str = field(repr=False)


class Launcher(Protocol):
    """Starts the ranks of a group (see the module docstring)."""

    async def launch(self, spec: LaunchSpec, group: WorkerGroup) -> None:
        """Start ``spec.n`` ranks, adding each handle with ``group._add`` as soon as it
        exists (so a failure part-way leaves the group able to kill what started), and
        group-wide resources to release with ``group._on_release``."""


class RankHandle:
    """Driver-side handle of one rank: its futures and its pending calls.

    Messages of the pipe protocol arrive through :meth:`_handle`; a launcher calls
    :meth:`_finish` once the rank is gone. A ``("started", info)`` after the first one
    is a new incarnation (the launcher restarted it): the calls pending on the old one
    fail, ``ready`` is renewed, and the old one's leftovers are removed.
    """

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop, takes_calls: bool,
                 pid: int | None = None) -> None:
        self.address = address
        self.loop = loop
        self.takes_calls = takes_calls
        self.pid = pid
        self.socket_dirs: list[str] = []
        self.incarnations = 0
        self.killed = False
        self.finishing = False   # join() asked it to finish: a restarted incarnation is told too
        self.error: WorkerFailedError | None = None   # set once the rank is gone
        self.ready = self._future()
        self.result = self._future()
        self.exited = loop.create_future()
        self.calls: dict[int, asyncio.Future] = {}

    def _future(self) -> asyncio.Future:
        fut = self.loop.create_future()
        fut.add_done_callback(retrieve)   # raised through join()/call(), or moot
        return fut

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "started":
            info = message[1]
            self.incarnations += 1
            if self.incarnations > 1:
                self._restarted()
            self.pid = info.get("pid", self.pid)
            self.socket_dirs = list(info.get("socket_dirs", ()))
        elif kind == "ready":
            if not self.ready.done():
                self.ready.set_result(None)
            if self.finishing and not self.result.done():
                self.tell(("finish",))
        elif kind == "reply":
            fut = self.calls.pop(message[1], None)
            if fut is not None and not fut.done():
                self._settle(fut, message[2], message[3], f"call on {self.address}", "raised")
        elif kind == "result" and not self.result.done():
            self._settle(self.result, message[1], message[2], f"worker {self.address}", "failed")

    def _settle(self, fut: asyncio.Future, ok: bool, payload: Any, who: str, failed: str) -> None:
        """Complete ``fut`` with a pickled value (``ok``) or a remote traceback."""
        if not ok:
            fut.set_exception(WorkerFailedError(f"{who} {failed}", address=self.address, remote_traceback=payload))
            return
        try:
            value = load_value(payload, f"the value returned by the {who}")
        except ValueError as exc:
            fut.set_exception(WorkerFailedError(str(exc), address=self.address))
        else:
            fut.set_result(value)

    def _restarted(self) -> None:
        log.warning("rlinf: %s was restarted (pid %s before)", self.address, self.pid)
        self._fail_calls(WorkerFailedError(f"worker {self.address} (pid {self.pid}) died and was restarted "
                                           f"before it answered", address=self.address))
        if self.ready.done():
            self.ready = self._future()
        self._old_incarnation_gone(self.pid, self.socket_dirs)

    def _old_incarnation_gone(self, pid: int | None, socket_dirs: list[str]) -> None:
        """Remove the leftovers of an incarnation that a restart replaced."""
        remove_leftovers(pid, socket_dirs)

    def _fail_calls(self, error: WorkerFailedError) -> None:
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(error)
        self.calls.clear()

    def _finish(self, why: str, code: int | None = None, detail: str | None = None) -> None:
        """The rank is gone for good (its leftovers already removed): fail what waits."""
        if self.exited.done():
            return
        why = "was killed by group.kill()" if self.killed else why
        returned = self.result.done() and not self.result.cancelled() and self.result.exception() is None
        outcome = "after it returned (it takes no more calls)" if returned else "without returning"
        error = self.error = WorkerFailedError(f"worker {self.address} (pid {self.pid}) {why} {outcome}",
                                               address=self.address, remote_traceback=detail or "")
        for fut in (self.ready, self.result):
            if not fut.done():
                fut.set_exception(error)
        self._fail_calls(error)
        self.exited.set_result(code)

    # -- what a launcher implements -----------------------------------------------------
    def send(self, message: tuple) -> None:
        """Send ``message`` to the rank; raise :class:`WorkerFailedError` if it is gone."""
        raise NotImplementedError

    def tell(self, message: tuple) -> None:
        """Best-effort message to a live rank (used for finish/stop)."""
        if self.alive:
            with contextlib.suppress(WorkerFailedError):
                self.send(message)

    def kill(self) -> None:
        """Kill the rank hard, now; ``exited`` resolves once it is gone."""
        raise NotImplementedError

    def terminate(self) -> None:
        """Ask the rank to stop by the launcher's own means (a process: SIGTERM)."""

    async def reap(self, timeout: float) -> None:
        """After ``kill``: make sure the rank is gone and accounted for (bounded)."""
        if self.alive:
            await asyncio.wait([self.exited], timeout=timeout)

    def kill_now(self) -> None:
        """Kill and clean up synchronously: for when the loop cannot be used (a cancelled
        close, interpreter exit)."""
        raise NotImplementedError


#: Seconds a group call waits for the other ranks' calls once one failed (see ``_gather``).
CALL_GRACE = 0.5


async def _wait_exited(ranks: list[RankHandle], timeout: float) -> None:
    pending = [p.exited for p in ranks if p.alive]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


class WorkerGroup:
    """The workers of one ``spawn`` call: ``name:0 .. name:n-1``.

    ``timeout``: the default of :meth:`call` and :meth:`join` (the cluster's
    ``RLINF_TIMEOUT``; None: forever).
    """

    def __init__(self, name: str, ranks: list[RankHandle] | None = None, *, timeout: float | None = None) -> None:
        self.name = name
        self._timeout = timeout
        self._ranks: list[RankHandle] = [] if ranks is None else ranks
        self._release: list[Callable[[], None]] = []
        self._call_ids = itertools.count(1)
        #: being started by ``Cluster.spawn``: its ranks (maybe none yet) are still to come
        self._launching = False
        #: reaping after ``kill`` (held here: the loop keeps only weak references to tasks)
        self._reaping: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        alive = sum(p.alive for p in self._ranks)
        return f"<WorkerGroup {self.name} n={len(self._ranks)} alive={alive}>"

    def __len__(self) -> int:
        return len(self._ranks)

    def _add(self, rank: RankHandle) -> None:
        self._ranks.append(rank)

    def _on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once no rank is alive any more (group-wide launcher resources)."""
        self._release.append(fn)

    def _release_if_idle(self, *, force: bool = False) -> None:
        if not force and any(p.alive for p in self._ranks):
            return
        while self._release:
            fn = self._release.pop()
            try:
                fn()
            except Exception as exc:   # a leftover must not hide the caller's outcome
                log.warning("rlinf: releasing the resources of group %s failed: %r", self.name, exc)

    def _retire_if_done(self) -> bool:
        """Whether the group was started and every rank is gone for good; if so, its
        launcher resources are released first (its owner may then forget it: nothing is
        left to stop)."""
        if self._launching or any(p.alive for p in self._ranks):
            return False
        self._release_if_idle()
        return True

    @property
    def addresses(self) -> list[str]:
        """``["name:0", ..., "name:n-1"]``."""
        return [p.address for p in self._ranks]

    @property
    def pids(self) -> list[int]:
        """The process ids, in rank order (with the Ray launcher: of the actors)."""
        return [p.pid for p in self._ranks]

    def _select(self, ranks: list[int] | None) -> list[RankHandle]:
        if ranks is None:
            return self._ranks
        if isinstance(ranks, int) or not all(type(r) is int for r in ranks):
            raise TypeError(f"ranks must be a list of ints, got {ranks!r}")
        for r in ranks:
            if not 0 <= r < len(self._ranks):
                raise ValueError(f"rank {r} is not in 0..{len(self._ranks) - 1}")
        return [self._ranks[r] for r in ranks]

    async def call(self, method: str, *args: Any, ranks: list[int] | None = None,
                   timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the Worker of every rank (or of ``ranks``).

        The calls run concurrently; plain and ``async`` methods both work. Arguments
        and results are pickled over the driver's pipe: pass bulk data through ``comm``.

        Returns:
            The results, in the order of ``ranks`` (rank order by default).

        Raises:
            TypeError: the group runs a function, not a :class:`rlinf.Worker`, or the
                arguments cannot be pickled (nothing was sent).
            ValueError: ``method`` is private or a rank is out of range.
            WorkerFailedError: a call raised (remote traceback attached), its arguments
                could not be unpickled in the worker or its result here, or a worker died;
                raised at most :data:`CALL_GRACE` seconds after one call failed (the
                other calls keep running: they may be waiting for the failed one).
            CommTimeoutError: not all answered within ``timeout`` (None: ``RLINF_TIMEOUT``
                if set, else forever; the calls keep running).
        """
        if not isinstance(method, str) or not method.isidentifier():
            raise TypeError(f"method must be a method name, got {method!r}")
        if method.startswith("_"):
            raise ValueError(f"{method!r} is private and cannot be called remotely")
        timeout = check_timeout(timeout, self._timeout)
        ranks_ = self._select(ranks)
        if ranks_ and not ranks_[0].takes_calls:
            raise TypeError(f"group {self.name!r} runs a function; only rlinf.Worker subclasses take calls")
        try:
            arguments = dump_value((args, kwargs))   # once for every rank
        except Exception as exc:
            raise TypeError(f"the arguments of {method}() cannot be pickled: {exc!r}") from exc
        futures = []
        for p in ranks_:
            await p.ready   # spawn() returned, so this is done unless the worker died (or restarts)
            call_id = next(self._call_ids)
            fut = p.loop.create_future()
            fut.add_done_callback(retrieve)   # a second failure after the first is raised is moot
            p.calls[call_id] = fut
            try:
                p.send(("call", call_id, method, arguments))
            except BaseException:
                p.calls.pop(call_id, None)
                for f in futures:
                    f.cancel()
                raise
            futures.append(fut)
        return await _gather(futures, timeout, f"{self.name}.{method}()", grace=CALL_GRACE)

    async def join(self, timeout: float | None = None, *, ranks: list[int] | None = None) -> list[Any]:
        """Wait for the workers (all, or ``ranks``) to finish; their return values.

        A Worker without ``run()`` is told to finish first (it returns None). Returns
        once the processes have exited. On the first failure, the other joined workers
        are killed (nobody is left hanging, e.g. waiting for a message from the failed
        one) and the failure is raised. A rank killed with :meth:`kill` counts as
        failed: join the others with ``ranks``.

        Raises:
            WorkerFailedError: a worker raised (remote traceback attached) or died.
            CommTimeoutError: not all finished within ``timeout`` (None: ``RLINF_TIMEOUT``
                if set, else forever; they keep running).
        """
        timeout = check_timeout(timeout, self._timeout)
        ranks_ = self._select(ranks)
        for p in ranks_:
            p.finishing = True   # also told once ready, if it is (re)starting now
            if p.ready.done() and not p.result.done():
                p.tell(("finish",))
        try:
            results = await _gather([p.result for p in ranks_], timeout, f"join of {self.name}")
        except WorkerFailedError:
            await self._kill(ranks_, deliberate=False)
            raise
        await _wait_exited(ranks_, REAP_TIMEOUT)
        stuck = [p for p in ranks_ if p.alive]
        if stuck:   # returned, then hung on the way out (e.g. a non-daemon thread)
            log.warning("rlinf: %s returned but did not exit; killing them", [p.address for p in stuck])
            await self._kill(stuck, deliberate=False)
        self._release_if_idle()
        return results

    def kill(self, rank: int | None = None) -> asyncio.Task[None]:
        """Kill (SIGKILL; a Ray actor: ``ray.kill``) one rank, or every rank when
        ``rank`` is None, and reap it.

        For fault handling and tests: the worker gets no chance to clean up; its peers
        see it as lost (``PeerLostError``), and the driver removes its ipc socket files
        and shared memory.

        Acts when called, awaited or not: the signal is sent before ``kill`` returns
        (forgetting ``await`` cannot leave the worker running). The returned task
        completes once the killed ranks are reaped (bounded): ``await group.kill(1)``
        waits for that; the task runs to completion on its own when not awaited.
        Must be called from the driver's event loop.
        """
        ranks = self._ranks if rank is None else self._select([rank])
        self._signal_kill(ranks, deliberate=True)
        task = asyncio.get_running_loop().create_task(self._reaped(ranks), name=f"reap {self.name}")
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)
        return task

    async def _kill(self, ranks: list[RankHandle], *, deliberate: bool) -> None:
        self._signal_kill(ranks, deliberate=deliberate)
        await self._reaped(ranks)

    @staticmethod
    def _signal_kill(ranks: list[RankHandle], *, deliberate: bool) -> None:
        for p in ranks:
            if p.alive:
                p.killed = p.killed or deliberate
                p.kill()

    async def _reaped(self, ranks: list[RankHandle]) -> None:
        await _wait_exited(ranks, REAP_TIMEOUT)
        self._release_if_idle()

    async def _stop(self, grace: float) -> None:
        """Ask, then terminate (SIGTERM), then kill (``grace`` seconds each): ``Cluster.aclose``."""
        for p in self._ranks:
            p.tell(("stop",))
        await _wait_exited(self._ranks, grace)
        for p in self._ranks:
            if p.alive:
                p.terminate()   # the child treats SIGTERM as "stop" if its loop still runs
        await _wait_exited(self._ranks, grace)
        for p in self._ranks:
            if p.alive:
                p.kill()
        await _wait_exited(self._ranks, REAP_TIMEOUT)
        await asyncio.gather(*(p.reap(REAP_TIMEOUT) for p in self._ranks))
        self._release_if_idle()

    def _kill_now(self) -> None:
        for p in self._ranks:
            p.kill_now()
        self._release_if_idle(force=True)


async def _gather(futures: list[asyncio.Future], timeout: float | None, what: str, *,
                  grace: float = 0.0) -> list[Any]:
    """Wait for the futures; at the first failure give the others ``grace`` seconds more,
    then raise the error of the lowest failing rank among those finished. Not waiting
    for all of them: they may be waiting on the failed one (``join`` then kills them;
    ``call``'s keep running). The grace lets a failure that every rank shares (a method
    that does not exist) be reported at the lowest rank, whichever reply came first.
    """
    shields = [asyncio.shield(f) for f in futures]
    for s in shields:   # those still pending when we return fail later, unseen: that is fine
        s.add_done_callback(retrieve)
    try:
        async with asyncio.timeout(timeout):
            if shields:
                _, pending = await asyncio.wait(shields, return_when=asyncio.FIRST_EXCEPTION)
                if pending and grace > 0:
                    await asyncio.wait(pending, timeout=grace)
    except TimeoutError:
        raise CommTimeoutError(f"{what} did not finish within {timeout} s") from None
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]
