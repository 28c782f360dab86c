"""Worker groups as Ray actors: Ray places and supervises, rlinf moves the data.

    import rlinf, rlinf.ray

    rlinf.ray.init()                                   # ray.init() unless connected; see init()
    async with rlinf.Cluster(bind="tcp://0.0.0.0:0") as cluster:
        group = await cluster.spawn(main, "rollout", n=4, launcher="ray",
                                    resources={"num_cpus": 1, "num_gpus": 1}, placement="spread")

Each rank is one Ray actor. Its constructor starts the rlinf worker on a thread of its
own, with its own event loop: the same code a local process runs
(:func:`rlinf.launch.worker.run_worker`), so ``async def main(comm, ...)`` targets and
:class:`rlinf.Worker` subclasses work unchanged. The worker registers with the
cluster's manager, which runs in the driver, and then talks to its peers directly over
rlinf's transports: Ray is not on the data path. The driver's group calls, ``join``,
``kill`` and failure reports travel through two actor methods (``messages``, a long
poll, and ``send``) that relay the pipe protocol of ``rlinf.launch.worker``.

The token goes to the actor as a constructor argument: Ray does not print those, and no
command line shows them. Each actor's ``RLINF_NODE_ID`` is its Ray node id, so
rlinf's routing (same node: shared memory and CUDA IPC; other nodes: TCP and NCCL)
follows Ray's placement. GPUs are Ray resources: Ray sets ``CUDA_VISIBLE_DEVICES``.

A dead actor is reported as ``lost`` by the manager (its heartbeats stop) and fails what
waits on it in the driver. With ``max_restarts``, Ray starts a new incarnation, which
registers again under the same address; the calls pending on the old one fail. Its
shared memory and ipc directory are removed on its node (by a Ray task when that is not
the driver's).

Importing this module imports Ray; ``import rlinf`` does not.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import threading
from typing import Any

try:
    import ray
    from ray import cloudpickle
    from ray.exceptions import RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
except ImportError as exc:   # pragma: no cover - depends on the environment
    raise ImportError("rlinf.ray needs Ray: pip install 'aiorlinf[ray]'") from exc

from ..errors import WorkerFailedError
from ..control.cleanup import remove_leftovers
from ..util.futures import retrieve
from .base import REAP_TIMEOUT, LaunchSpec, RankHandle, WorkerGroup, wait_gone
from .worker import run_worker

__all__ = ["RayLauncher", "init", "node_id"]

log = logging.getLogger("rlinf.ray")

#: ``placement`` values that reserve one placement-group bundle per rank.
PLACEMENT_STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK",
                        "strict_spread": "STRICT_SPREAD"}

#: What a call to a restarting actor raises (Ray < 2.3x has no such error: catch nothing).
_Unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())

_WILDCARDS = {"0.0.0.0", "*", "[::]", "::"}
_LOOPBACK = ("127.", "localhost", "[::1]")


def node_id() -> str:
    """The Ray node id of this process (Ray must be initialized)."""
    return ray.get_runtime_context().get_node_id()


def init(**ray_init_kwargs: Any) -> str:
    """Connect this driver to Ray, and make its rlinf node id Ray's.

    Calls ``ray.init(**ray_init_kwargs)`` unless Ray is initialized already (with no
    ``address``, Ray joins the cluster of ``RAY_ADDRESS`` or starts a local one). Then
    sets ``RLINF_NODE_ID`` of this process to its Ray node id, so communicators and
    channels the driver starts afterwards count as being on the same node as the actors
    Ray places there (shared memory instead of TCP). Spawning with ``launcher="ray"``
    needs no call to this, but then the driver routes as a node of its own.

    Returns:
        This process's Ray node id.
    """
    if not ray.is_initialized():
        ray.init(**ray_init_kwargs)
    node = os.environ["RLINF_NODE_ID"] = node_id()   # read by Settings.from_env() of later communicators
    return node


# ------------------------------------------------------------------------ in the actor
class _RankActor:
    """One rank inside a Ray actor: the worker runs on its own thread and event loop and
    speaks the pipe protocol of ``rlinf.launch.worker`` with this actor, which relays it."""

    def __init__(self, payload: bytes, address: str, rank: int, world_size: int, manager: str, token: str,
                 env: dict[str, str]) -> None:
        self._node = ray.get_runtime_context().get_node_id()
        os.environ.update({"RLINF_NODE_ID": self._node, **env})   # before the target's module loads
        target, args, kwargs = cloudpickle.loads(payload)
        self._conn, child = multiprocessing.Pipe()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlinf-relay")   # keeps order
        # Messages read from the worker, kept until the driver acknowledges them: a reply
        # lost on the way (Ray reports the actor unavailable) is sent again, never dropped.
        self._incarnation = os.urandom(8).hex()
        self._unacked: collections.deque[tuple[int, bytes]] = collections.deque()
        self._seq = 0
        self._reading = asyncio.Lock()
        self._eof = False
        self._thread = threading.Thread(
            target=run_worker, name=f"rlinf-{address}", daemon=True,
            args=(target, address, rank, world_size, manager, token, args, kwargs, child))
        self._thread.start()

    async def messages(self, incarnation: str, acked: int) -> tuple[str, str, list[tuple[int, bytes]]]:
        """The worker's messages after ``acked`` (at least one; waits for it), numbered,
        with this actor's node id and incarnation. ``acked`` counts only when
        ``incarnation`` is this actor's (a restarted actor numbers from 1 again). Once the
        worker has finished and everything was acknowledged, the actor exits."""
        if incarnation == self._incarnation:
            while self._unacked and self._unacked[0][0] <= acked:
                self._unacked.popleft()
        async with self._reading:   # one reader of the pipe at a time, also across retries
            if not self._unacked and not self._eof:
                batch, self._eof = await asyncio.get_running_loop().run_in_executor(None, self._read)
                for data in batch:
                    self._seq += 1
                    self._unacked.append((self._seq, data))
            if not self._unacked:
                ray.actor.exit_actor()
        return self._node, self._incarnation, list(self._unacked)

    def _read(self) -> tuple[list[bytes], bool]:
        """On a thread (the reads block): the worker's next message and those already
        behind it, and whether its end has closed."""
        batch: list[bytes] = []
        try:
            batch.append(self._conn.recv_bytes())
            while self._conn.poll():
                batch.append(self._conn.recv_bytes())
        except (EOFError, ConnectionResetError):
            # Reset: the worker closed its end with a request of ours unread (a "finish"
            # sent while it wrote its result); what it sent was read first.
            return batch, True
        return batch, False

    async def send(self, data: bytes) -> None:
        """Pass a pickled request to the worker (in the order sent; never blocks the actor)."""
        await asyncio.get_running_loop().run_in_executor(self._writer, self._conn.send_bytes, data)


_Actor = ray.remote(_RankActor)


def _clean_after(pid: int | None, socket_dirs: list[str], timeout: float) -> None:
    """Once process ``pid`` of this node is gone, remove its leftovers."""
    if pid is not None and not wait_gone(pid, timeout):
        log.warning("rlinf: pid %d outlived its Ray actor; leaving its shared memory", pid)
        return
    remove_leftovers(pid, socket_dirs)


_clean_remote = ray.remote(num_cpus=0, max_retries=0)(_clean_after)


# --------------------------------------------------------------------------- in the driver
class _RayRank(RankHandle):
    """The driver's handle of one actor: a long poll for the worker's messages."""

    def __init__(self, address: str, actor, loop: asyncio.AbstractEventLoop, takes_calls: bool,
                 driver_node: str) -> None:
        super().__init__(address, loop, takes_calls)
        self.actor = actor
        self.node = ""              # Ray node of the current incarnation, once it has said something
        self._old_node = ""
        self._driver_node = driver_node
        self._kill_sent = False
        self._cleanups: set[asyncio.Future] = set()
        self._poller = loop.create_task(self._poll(), name=f"rlinf-ray-{address}")

    async def _poll(self) -> None:
        unavailable = 0
        incarnation, acked = "", 0
        while True:
            try:
                node, current, batch = await self.actor.messages.remote(incarnation, acked)
            except _Unavailable:
                # Restarting (the next call waits for the new incarnation) or an RPC that
                # broke: ask again, backing off if it keeps failing at once.
                unavailable += 1
                if unavailable > 1:
                    await asyncio.sleep(min(0.05 * unavailable, 1.0))
                continue
            except RayActorError as exc:
                await self._gone(exc)
                return
            unavailable = 0
            if current != incarnation:   # a new incarnation numbers its messages from 1
                incarnation, acked = current, 0
            if node != self.node:
                self._old_node, self.node = self.node, node
            for seq, data in batch:
                if seq > acked:          # not a copy of one we already handled
                    acked = seq
                    self._handle(pickle.loads(data))

    def _clean_elsewhere(self, pid: int | None, socket_dirs: list[str], node: str):
        """Start a Ray task that cleans up after ``pid`` on ``node``; None if that is here."""
        if not node or node == self._driver_node:
            return None
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        return _clean_remote.options(scheduling_strategy=strategy).remote(pid, socket_dirs, REAP_TIMEOUT)

    def _cleanup(self, pid: int | None, socket_dirs: list[str], node: str) -> asyncio.Future:
        """Remove a dead incarnation's leftovers on its node."""
        ref = self._clean_elsewhere(pid, socket_dirs, node)
        if ref is None:
            fut = self.loop.run_in_executor(None, _clean_after, pid, socket_dirs, REAP_TIMEOUT)
        else:
            fut = asyncio.wrap_future(ref.future())
        self._cleanups.add(fut)
        fut.add_done_callback(self._cleaned)
        return fut

    def _cleaned(self, fut: asyncio.Future) -> None:
        self._cleanups.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("rlinf: could not clean up after %s: %r", self.address, fut.exception())

    def _old_incarnation_gone(self, pid: int | None, socket_dirs: list[str]) -> None:
        self._cleanup(pid, socket_dirs, self._old_node or self.node)

    async def _gone(self, exc: RayActorError) -> None:
        await asyncio.wait([self._cleanup(self.pid, self.socket_dirs, self.node)], timeout=REAP_TIMEOUT + 1)
        if self._kill_sent:
            self._finish("was killed")
        else:
            self._finish("died (its Ray actor is dead)", detail=str(exc))

    def send(self, message: tuple) -> None:
        if self.error is not None:
            raise self.error
        if not ray.is_initialized():
            raise WorkerFailedError(f"worker {self.address} is gone: Ray was shut down", address=self.address)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        # A failure shows as the actor's death, through the poll.
        asyncio.wrap_future(self.actor.send.remote(data).future()).add_done_callback(retrieve)

    def kill(self) -> None:
        self._kill_sent = True
        if ray.is_initialized():   # else Ray took its actors down with it
            ray.kill(self.actor, no_restart=True)

    async def reap(self, timeout: float) -> None:
        if self.alive:
            await asyncio.wait([self.exited], timeout=timeout)
        if self.alive:   # Ray never told us it died: give up on it
            self._poller.cancel()
            self._finish("did not stop")
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=timeout)
        await asyncio.gather(self._poller, return_exceptions=True)

    def kill_now(self) -> None:
        self._poller.cancel()
        if not self.alive or not ray.is_initialized():
            return
        ray.kill(self.actor, no_restart=True)
        if self._clean_elsewhere(self.pid, self.socket_dirs, self.node) is None:
            _clean_after(self.pid, self.socket_dirs, REAP_TIMEOUT)


class RayLauncher:
    """Starts each rank of a group as a Ray actor (``cluster.spawn(..., launcher="ray")``).

    Args:
        resources: per rank, as for Ray actors: ``num_cpus`` (default 1), ``num_gpus``
            (default 0), ``memory`` (bytes), and custom resources by name. Ray sets
            ``CUDA_VISIBLE_DEVICES`` for the GPUs it assigns.
        placement: where the ranks go. None: wherever Ray schedules them.
            ``"pack"`` / ``"spread"`` / ``"strict_pack"`` / ``"strict_spread"``: a
            placement group with one bundle (= ``resources``) per rank and that strategy,
            removed once the group's actors are gone. ``"node:<ray node id>"``: every
            rank on that node. Or any Ray scheduling strategy object (e.g. a
            ``PlacementGroupSchedulingStrategy`` of your own placement group).
        max_restarts: how often Ray restarts a rank that died (not ones killed with
            ``group.kill``); -1: without limit. A restarted rank registers again under
            its address; the calls pending on the old incarnation fail.

    Raises:
        ValueError / TypeError: bad resources, placement or max_restarts.
    """

    def __init__(self, *, resources: dict[str, float] | None = None, placement: Any = None,
                 max_restarts: int = 0) -> None:
        resources = {"num_cpus": 1, "num_gpus": 0, **(resources or {})}
        for key, value in resources.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value < 0:
                raise TypeError(f"resources must map names to numbers >= 0, got {key!r}: {value!r}")
        if type(max_restarts) is not int or max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1, got {max_restarts!r}")
        if isinstance(placement, str) and placement not in PLACEMENT_STRATEGIES \
                and not (placement.startswith("node:") and len(placement) > 5):
            raise ValueError(f"placement must be one of {sorted(PLACEMENT_STRATEGIES)}, 'node:<node id>', "
                             f"a Ray scheduling strategy or None, got {placement!r}")
        self.resources = resources
        self.placement = placement
        self.max_restarts = max_restarts
        if placement in PLACEMENT_STRATEGIES:
            self._bundle()   # checks that there is something to reserve

    def __repr__(self) -> str:
        return f"<RayLauncher resources={self.resources} placement={self.placement!r}>"

    def _actor_options(self) -> dict[str, Any]:
        options = {"max_restarts": self.max_restarts}
        custom = {}
        for key, value in self.resources.items():
            if key in ("num_cpus", "num_gpus", "memory"):
                options[key] = value
            else:
                custom[key] = value
        if custom:
            options["resources"] = custom
        return options

    def _bundle(self) -> dict[str, float]:
        names = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
        bundle = {names.get(k, k): v for k, v in self.resources.items() if v}
        if not bundle:
            raise ValueError(f"placement={self.placement!r} reserves resources per rank: give some "
                             f"(e.g. resources={{'num_cpus': 1}})")
        return bundle

    async def _strategies(self, n: int, group: WorkerGroup) -> list[Any]:
        if self.placement in PLACEMENT_STRATEGIES:
            pg = placement_group([self._bundle() for _ in range(n)], strategy=PLACEMENT_STRATEGIES[self.placement])
            group._on_release(lambda: remove_placement_group(pg))
            await pg.ready()   # within spawn's ready_timeout: resources Ray cannot find time out
            return [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(n)]
        if isinstance(self.placement, str):
            return [NodeAffinitySchedulingStrategy(self.placement[len("node:"):], soft=False)] * n
        return [self.placement] * n

    async def launch(self, spec: LaunchSpec, group: WorkerGroup) -> None:
        """Start ``spec.n`` actors (see :class:`rlinf.launch.base.Launcher`)."""
        if not ray.is_initialized():
            ray.init()
        manager = _reachable(spec.manager)
        driver_node = node_id()
        strategies = await self._strategies(spec.n, group)
        payload = cloudpickle.dumps((spec.target, spec.args, spec.kwargs))
        loop = asyncio.get_running_loop()
        options = self._actor_options()
        for rank in range(spec.n):
            address = f"{spec.name}:{rank}"
            actor = _Actor.options(scheduling_strategy=strategies[rank], **options).remote(
                payload, address, rank, spec.n, manager, spec.token, spec.env)
            group._add(_RayRank(address, actor, loop, spec.takes_calls, driver_node))


def _reachable(manager: str) -> str:
    """The manager's endpoint as the actors must dial it, on whichever node they are."""
    host = ""
    if manager.startswith("tcp://"):
        host, _, port = manager[len("tcp://"):].rpartition(":")
        if host in _WILDCARDS:
            return f"tcp://{ray.util.get_node_ip_address()}:{port}"
    if not host or host.startswith(_LOOPBACK):   # ipc:// or loopback: this host only
        here = ray.util.get_node_ip_address()
        elsewhere = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")} - {here})
        if elsewhere:
            raise ValueError(f"the manager listens on {manager}, which Ray nodes on {elsewhere} cannot reach: "
                             f"use rlinf.Cluster(bind='tcp://0.0.0.0:0')")
    return manager
