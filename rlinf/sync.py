"""``rlinf.init()``: a synchronous, torch.distributed-style communicator for plain scripts.

``comm = rlinf.init()`` reads the environment a launcher sets, starts an event loop
(uvloop when installed) in a background thread, connects a :class:`~rlinf.Communicator`
on it and returns a :class:`SyncCommunicator`: blocking, in-place ``send`` / ``recv`` /
``broadcast`` / ``all_reduce`` / ``gather`` / ``all_to_all`` / ``barrier`` on torch
tensors (numpy arrays work too). A torch.distributed script ports by changing two lines::

    import torch.distributed as dist          ->   import rlinf
    dist.init_process_group("gloo")           ->   dist = rlinf.init()

Environment (first match wins):

* ``RLINF_MANAGER`` + ``RLINF_TOKEN``: join that manager (a ``Cluster`` or a standalone
  ``python -m rlinf.manager``).
* ``MASTER_ADDR`` + ``MASTER_PORT`` under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``;
  torchrun's agent already listens on ``MASTER_PORT``): rank 0 starts a manager on a
  free port and publishes its address (and a fresh random token, unless ``RLINF_TOKEN``
  is set) in torchrun's store; the other ranks read them from there. The token is then
  as private as torchrun's store, which has no authentication.
* ``MASTER_ADDR`` + ``MASTER_PORT`` otherwise (any launcher, see ``examples/``): rank 0
  hosts the manager at ``tcp://MASTER_ADDR:MASTER_PORT``. The token is ``RLINF_TOKEN``,
  or, when unset, derived from ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and the
  job ids (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``) — anyone who knows those can
  derive it too, so set ``RLINF_TOKEN`` to a secret when the network is shared.

The rank is ``RANK`` and the world size ``WORLD_SIZE``. Worker addresses are
``rank:<r>``, or ``<name>:<r>`` when ``RLINF_ADDRESS=<name>:<r>`` is set. The process
hosting the manager keeps it up on ``shutdown()`` until every other rank has left.

The one module-level state is the "current" communicator, kept only so that
``rlinf.shutdown()`` can find it. Collectives run on :class:`rlinf.collectives.group.Group` over all
ranks (topology-aware broadcast, reductions in rank order, mismatched calls detected);
every rank must call them in the same order, from one thread.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import ipaddress
import logging
import threading
from concurrent.futures import Future
from typing import Any, Coroutine

from .codec import into
from .config import LaunchEnv, Settings
from .communicator import Communicator
from .errors import ClosedError, CommTimeoutError
from .info import check_timeout, parse_address
from .control.manager import Manager

__all__ = ["init", "shutdown", "SyncCommunicator", "Request"]

log = logging.getLogger("rlinf.sync")

_OFFLOAD_BYTES = 1 << 20       # copies/reductions above this run in an executor
_current: SyncCommunicator | None = None


# -- environment ---------------------------------------------------------------------
def _rendezvous(settings: Settings, launch: LaunchEnv) -> dict[str, Any]:
    """Resolve what the launcher set (``RLINF_*`` in ``settings``, torchrun's variables
    in ``launch``) into addresses, rank and manager location."""
    address = settings.address
    if address:
        prefix, rank = parse_address(address)
        if launch.rank not in (None, rank):
            raise ValueError(f"RLINF_ADDRESS={address} disagrees with RANK={launch.rank}")
    elif launch.rank is not None:
        prefix, rank = "rank", launch.rank
    else:
        raise ValueError("rlinf.init() needs RANK (torchrun sets it) or RLINF_ADDRESS='<name>:<rank>'")
    world_size = launch.world_size
    if world_size is None or not 0 <= rank < world_size:
        raise ValueError(f"rlinf.init() needs WORLD_SIZE > rank (RANK={rank}, WORLD_SIZE={world_size})")
    out = {"prefix": prefix, "rank": rank, "world_size": world_size, "token": settings.token,
           "manager": None, "host": None, "store": None}
    if settings.manager:
        if not out["token"]:
            raise ValueError("RLINF_MANAGER is set but RLINF_TOKEN is not")
        out["manager"] = settings.manager
        return out
    out["manager_host"] = f"{prefix}:0"     # rank 0 runs the manager from here on
    master, port = launch.master_addr, launch.master_port
    if not master or port is None:
        raise ValueError("rlinf.init() needs MASTER_ADDR and MASTER_PORT (torchrun sets them) "
                         "or RLINF_MANAGER and RLINF_TOKEN")
    if ":" in master:    # an IPv6 address, bracketed or not (a host name never has one)
        raise ValueError(f"MASTER_ADDR={master!r} is an IPv6 address; rlinf's TCP endpoints are IPv4 "
                         f"only: use an IPv4 address or a host name that resolves to one")
    if launch.agent_store:
        run = f"{launch.run_id or ''}/{launch.restart_count}"
        out["store"] = (master, port, f"rlinf/{run}/{prefix}/manager")
        out["host"] = f"tcp://{_bind_host(master)}:0" if rank == 0 else None
        return out
    out["manager"] = f"tcp://{master}:{port}"
    out["host"] = f"tcp://{_bind_host(master)}:{port}" if rank == 0 else None
    if not out["token"]:
        job = "|".join(str(v) for v in (master, port, world_size, launch.run_id or "", launch.slurm_job_id or ""))
        out["token"] = hashlib.sha256(f"rlinf-derived-job-token|{job}".encode()).hexdigest()
        log.info("rlinf.init: no RLINF_TOKEN; using a token derived from the job's environment")
    return out


def _bind_host(master: str) -> str:
    """The interface rank 0's manager binds: MASTER_ADDR when it is an IP, else all."""
    if master in ("localhost", "localhost.localdomain"):
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(master))
    except ValueError:
        return "0.0.0.0"


def _store(host: str, port: int, timeout: float):
    from datetime import timedelta

    import torch.distributed as dist   # only under torchrun, which implies torch

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


# -- helpers -------------------------------------------------------------------------
def _at_exit(fn) -> None:
    """Run ``fn`` when the interpreter exits, while executors still take work (closing
    uses them): ``threading``'s exit hooks run before ``concurrent.futures`` shuts down
    (newest first), ``atexit`` hooks only after."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:   # already shutting down
        pass
    atexit.register(fn)


def _kind(x: Any) -> str:
    module = type(x).__module__
    return "tensor" if module.startswith("torch") else "array" if module.startswith("numpy") else type(x).__name__


def _nbytes(x: Any) -> int:
    if _kind(x) == "tensor":
        return x.numel() * x.element_size()
    n = getattr(x, "nbytes", 0)
    return n if isinstance(n, int) else 0


def _describe(x: Any) -> str:
    if _kind(x) in ("tensor", "array"):
        return f"{_kind(x)} {x.dtype}{list(x.shape)}"
    return _kind(x)


def _reduce_op(op: Any) -> str:
    name = getattr(op, "name", op)   # torch.distributed.ReduceOp.SUM has .name == "SUM"
    if not isinstance(name, str):
        raise TypeError(f"op must be a str like 'sum' or a ReduceOp, got {op!r}")
    name = {"prod": "product", "mean": "avg"}.get(name.lower(), name.lower())
    if name not in ("sum", "product", "min", "max", "avg"):
        raise ValueError(f"unsupported reduce op {op!r}: use sum, product, min, max or avg")
    return name


def _product(parts: list) -> Any:
    """Multiply in rank order (deterministic) into a copy of the first."""
    first = parts[0]
    if _kind(first) == "tensor":
        import torch

        with torch.no_grad():
            out = first.detach().clone()
            for t in parts[1:]:
                out.mul_(t.to(out.device))
        return out
    import numpy as np

    out = np.array(first, copy=True)
    for t in parts[1:]:
        np.multiply(out, t, out=out)
    return out


class Request:
    """Handle of an ``isend`` / ``irecv``, like torch's ``Work``: ``wait()``, ``is_completed()``."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; returns the operation's result (the source rank for irecv)."""
        return self._future.result(timeout)


class SyncCommunicator:
    """Blocking, torch.distributed-style operations on tensors; made by :func:`rlinf.init`.

    Tensors are sent and received in place: ``recv``, ``broadcast``, ``all_reduce``,
    ``gather`` (at ``dst``) and ``all_to_all`` write into the tensors given, which must
    match the sender's shape and dtype (``ValueError`` / ``TypeError`` otherwise, naming
    the ranks). ``send`` returns when the tensor may be modified again. Every call takes
    the ``timeout`` given to ``init`` (None: ``RLINF_TIMEOUT`` if set, else wait; a lost
    peer still fails fast with ``PeerLostError``).

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        address: this worker's rlinf address (``"rank:<r>"``).
        communicator: the asyncio :class:`~rlinf.Communicator` underneath, which lives
            on the background loop (``asyncio.run_coroutine_threadsafe`` to use it).
    """

    class ReduceOp:
        """``comm.ReduceOp.SUM`` etc., for scripts written against torch.distributed."""

        SUM, PRODUCT, MIN, MAX, AVG = "sum", "product", "min", "max", "avg"

    def __init__(self, env: dict[str, str] | None = None, *, timeout: float | None = None,
                 connect_timeout: float = 60.0) -> None:
        settings = Settings.from_env(env)        # env None: this process's environment
        spec = _rendezvous(settings, LaunchEnv.from_env(env))
        self.rank: int = spec["rank"]
        self.world_size: int = spec["world_size"]
        self._addresses = [f"{spec['prefix']}:{r}" for r in range(self.world_size)]
        self.address = self._addresses[self.rank]
        self._timeout = check_timeout(timeout, settings.timeout)
        self._manager: Manager | None = None
        self._closed = False
        try:
            import uvloop
            self._loop = uvloop.new_event_loop()
        except ImportError:
            self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlinf-facade", daemon=True)
        self._thread.start()
        try:
            manager, token = spec["manager"], spec["token"]
            if spec["host"]:
                self._manager = self._run(self._start_manager(spec["host"], token, settings))
                token = self._manager.token
            if spec["store"]:
                master, port, key = spec["store"]
                store = _store(master, port, connect_timeout)
                if self._manager is not None:
                    manager = f"tcp://{master}:{self._manager.address.rsplit(':', 1)[1]}"
                    store.set(key, f"{manager} {token}")
                else:
                    manager, published = store.get(key).decode().split(" ", 1)
                    token = token or published
            self.communicator = Communicator(self.address, manager=manager, token=token,
                                             connect_timeout=connect_timeout,
                                             manager_host=spec.get("manager_host"), settings=settings)
            self._run(self.communicator.start())
            self._group = self.communicator.group(self._addresses)
        except BaseException:
            self._stop_loop(self._abort())
            raise
        _at_exit(self.close)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SyncCommunicator rank={self.rank}/{self.world_size} {state}>"

    def __enter__(self) -> SyncCommunicator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    # -- plumbing ----------------------------------------------------------------------
    async def _start_manager(self, bind: str, token: str | None, settings: Settings) -> Manager:
        try:
            return await Manager(bind, token=token, settings=settings).start()
        except OSError as exc:
            raise OSError(f"rank 0 cannot host the rlinf manager at {bind} ({exc}); is MASTER_PORT free?") from exc

    def _run(self, coro: Coroutine) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a SyncCommunicator cannot be used from its own event loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()   # e.g. KeyboardInterrupt: do not leave the operation running
            raise

    def _call(self, coro: Coroutine) -> Any:
        """Run a point-to-point operation within ``timeout``."""
        self._refuse_if_closed(coro)
        return self._run(self._timed(coro))

    def _collective(self, coro: Coroutine) -> Any:
        """Run a collective. Its group call gets ``timeout`` itself, so that a timeout on
        one rank fails the call on every rank with ``CommTimeoutError`` (a cancellation
        from outside would reach the others as a plain "cancelled" error)."""
        self._refuse_if_closed(coro)
        return self._run(coro)

    def _refuse_if_closed(self, coro: Coroutine) -> None:
        if self._closed:
            coro.close()
            raise ClosedError("this rlinf communicator is shut down")

    async def _timed(self, coro: Coroutine) -> Any:
        if self._timeout is None:
            return await coro
        try:
            async with asyncio.timeout(self._timeout):
                return await coro
        except TimeoutError:
            raise CommTimeoutError(f"rank {self.rank}: operation did not finish within {self._timeout} s") from None

    def _peer(self, rank: Any, what: str) -> str:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {rank!r}")
        return self._addresses[rank]

    async def _copy(self, target: Any, source: Any, what: str) -> None:
        try:
            if _nbytes(target) > _OFFLOAD_BYTES:
                await asyncio.get_running_loop().run_in_executor(None, into.copy_into, target, source)
            else:
                into.copy_into(target, source)
        except (ValueError, TypeError) as exc:
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            raise kind(f"rank {self.rank}: {what}: {exc}") from None

    # -- point to point ----------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; returns when ``tensor`` may be modified."""
        self._call(self.communicator.send(tensor, self._peer(dst, "dst"), tag=tag))

    def recv(self, tensor: Any, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from rank ``src`` (any rank when None). Returns the source rank."""
        return self._call(self._recv(tensor, src, tag))

    async def _recv(self, tensor: Any, src: int | None, tag: int) -> int:
        if src is None:
            obj, address = await self.communicator.recv_any(tag=tag)
            src = parse_address(address)[1]
        else:
            obj = await self.communicator.recv(self._peer(src, "src"), tag=tag)
        await self._copy(tensor, obj, f"recv from rank {src}")
        return src

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Request:
        """Start a send; ``wait()`` on the returned :class:`Request` before modifying ``tensor``."""
        if self._closed:
            raise ClosedError("this rlinf communicator is shut down")
        return Request(asyncio.run_coroutine_threadsafe(
            self._timed(self.communicator.send(tensor, self._peer(dst, "dst"), tag=tag)), self._loop))

    def irecv(self, tensor: Any, src: int | None = None, tag: int = 0) -> Request:
        """Start a receive into ``tensor``; ``wait()`` returns the source rank."""
        if self._closed:
            raise ClosedError("this rlinf communicator is shut down")
        if src is not None:
            self._peer(src, "src")
        return Request(asyncio.run_coroutine_threadsafe(self._timed(self._recv(tensor, src, tag)), self._loop))

    # -- collectives (on rlinf.collectives.group.Group over every rank) -----------------------------
    def broadcast(self, tensor: Any, root: int = 0, *, src: int | None = None) -> None:
        """Overwrite ``tensor`` on every rank with rank ``root``'s (``src=`` as in torch)."""
        root = root if src is None else src
        self._peer(root, "root")
        self._collective(self._broadcast(tensor, root))

    async def _broadcast(self, tensor: Any, root: int) -> None:
        obj = await self._group.broadcast(tensor if self.rank == root else None, root=root, timeout=self._timeout)
        if self.rank != root:
            await self._copy(tensor, obj, f"broadcast from rank {root}")

    def all_reduce(self, tensor: Any, op: Any = "sum") -> None:
        """Reduce ``tensor`` over all ranks into every rank's, in place.

        ``op``: ``"sum"``, ``"product"``, ``"min"``, ``"max"``, ``"avg"`` (floating point
        only), or a ``torch.distributed.ReduceOp``. Every rank gets bitwise the same result.
        """
        self._collective(self._all_reduce(tensor, _reduce_op(op)))

    async def _all_reduce(self, tensor: Any, op: str) -> None:
        if op != "product":
            await self._group.all_reduce(tensor, "mean" if op == "avg" else op, inplace=True, timeout=self._timeout)
            return
        # rlinf.collectives.group has no product: gather everything, reduce in rank order everywhere
        parts = await self._group.all_gather(tensor, timeout=self._timeout)
        for r, part in enumerate(parts):
            if _kind(part) != _kind(tensor) or tuple(part.shape) != tuple(tensor.shape) or part.dtype != tensor.dtype:
                raise ValueError(f"all_reduce: rank {r} passed {_describe(part)}, rank {self.rank} passed "
                                 f"{_describe(tensor)}; every rank must pass the same shape and dtype")
        if sum(_nbytes(p) for p in parts) > _OFFLOAD_BYTES:
            result = await asyncio.get_running_loop().run_in_executor(None, _product, parts)
        else:
            result = _product(parts)
        await self._copy(tensor, result, "all_reduce")

    def gather(self, tensor: Any, gather_list: list | None = None, dst: int = 0) -> None:
        """Gather every rank's ``tensor`` into ``gather_list`` (given at ``dst`` only, one per rank)."""
        self._peer(dst, "dst")
        if self.rank == dst:
            if not isinstance(gather_list, (list, tuple)) or len(gather_list) != self.world_size:
                raise ValueError(f"gather: the destination rank needs a gather_list of {self.world_size} tensors")
        elif gather_list:    # None or empty, as torch.distributed accepts
            raise ValueError("gather: gather_list must be None or empty on ranks other than dst")
        self._collective(self._gather(tensor, gather_list, dst))

    async def _gather(self, tensor: Any, gather_list: list | None, dst: int) -> None:
        parts = await self._group.gather(tensor, root=dst, timeout=self._timeout)
        if self.rank == dst:
            for r, part in enumerate(parts):
                await self._copy(gather_list[r], part, f"gather from rank {r} into gather_list[{r}]")

    def all_to_all(self, output_list: list, input_list: list) -> None:
        """Send ``input_list[r]`` to rank r; receive rank r's into ``output_list[r]``."""
        for name, lst in (("output_list", output_list), ("input_list", input_list)):
            if not isinstance(lst, (list, tuple)) or len(lst) != self.world_size:
                raise ValueError(f"all_to_all: {name} must hold {self.world_size} tensors (one per rank)")
        self._collective(self._all_to_all(output_list, input_list))

    async def _all_to_all(self, output_list: list, input_list: list) -> None:
        parts = await self._group.all_to_all(list(input_list), timeout=self._timeout)
        for r, part in enumerate(parts):
            await self._copy(output_list[r], part, f"all_to_all from rank {r} into output_list[{r}]")

    def barrier(self) -> None:
        """Return once every rank has called ``barrier()``."""
        self._collective(self._group.barrier(timeout=self._timeout))

    # -- shutdown ----------------------------------------------------------------------
    def close(self) -> None:
        """Leave the cluster and stop the background loop. Idempotent.

        On the rank that hosts the manager, this waits (as long as they live) for the
        other ranks to leave before the manager stops.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_loop(self._aclose())

    destroy_process_group = close   # the torch.distributed spelling

    async def _aclose(self) -> None:
        await self.communicator.aclose()
        if self._manager is not None:
            while any(w.address in self._addresses for w in self._manager.roster()):
                await asyncio.sleep(0.05)   # the manager drops dead ranks itself (liveness checks)
        await self._abort()

    async def _abort(self) -> None:
        comm = getattr(self, "communicator", None)
        if comm is not None:
            await comm.aclose()
        if self._manager is not None:
            await self._manager.close()
        await self._loop.shutdown_default_executor()

    def _stop_loop(self, coro: Coroutine) -> None:
        try:
            asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


def init(backend: str = "auto", *, timeout: float | None = None, connect_timeout: float = 60.0) -> SyncCommunicator:
    """Join the job described by the environment; the torch.distributed-style communicator.

    Args:
        backend: ``"auto"`` (the only value: rlinf picks a transport per buffer).
        timeout: seconds each operation may take (None: ``RLINF_TIMEOUT`` if set, else
            no limit).
        connect_timeout: seconds to reach the manager (and, under torchrun, its store).

    Returns:
        The :class:`SyncCommunicator`; it is also "current" until :func:`shutdown`.

    Raises:
        ValueError: the environment names no rank, world size or rendezvous.
        RuntimeError: ``init`` was already called in this process without ``shutdown``.
        AuthenticationError, CommTimeoutError: the manager refused us or did not answer.
    """
    global _current
    if backend != "auto":
        raise ValueError(f"backend must be 'auto' (rlinf picks a transport per buffer), got {backend!r}")
    if _current is not None and not _current._closed:
        raise RuntimeError("rlinf.init() was already called in this process; call rlinf.shutdown() first")
    _current = SyncCommunicator(timeout=timeout, connect_timeout=connect_timeout)
    return _current


def shutdown() -> None:
    """Close the communicator made by :func:`init` (no-op if there is none)."""
    global _current
    comm, _current = _current, None
    if comm is not None:
        comm.close()
