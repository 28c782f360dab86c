"""Collectives over any set of workers, formed on the fly: :class:`Group`.

``comm.group(addresses)`` needs no setup call anywhere: the same addresses, in any
order, give every member the same group (members are sorted canonically). See
``docs/collectives.md`` for the algorithms and the rules; in short:

* **Namespacing.** Every member numbers its own calls on a group (0, 1, 2, ...), so
  members must make the same calls on a group in the same order. All messages of call
  ``seq`` travel under the internal tag ``"g:<group id>:<seq>"`` (a str tag, so never
  a user's), which keeps groups, calls and point-to-point traffic apart. Two ``Group``
  objects with the same members on one communicator are the same group (they share
  the numbering).
* **Mismatches.** Every message carries the call's signature ``(kind, root, extra)``.
  A member that receives another signature at the same sequence number (a different
  collective, root, or all_reduce shape) raises ``ValueError``.
* **No hangs.** Any failure of a call on one member (mismatch, bad argument, timeout,
  cancellation, a lost member) is sent to every other member as an *abort*, which they
  raise. A member that waits for a message from a member that is lost fails with
  ``PeerLostError`` within the detection bound. Rooted collectives make the root
  receive from every member and every member receive from the root, so a wrong root
  cannot deadlock, and a lost member is always noticed by someone who then aborts the
  call for all. (Machinery: :mod:`rlinf.collectives._engine`.)
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from ._engine import Call, calls_made, execute
from ..codec import buffer_nbytes, is_device_buffer
from ..errors import ProtocolError
from ..info import parse_address
from ..util.memory import page_aligned, page_aligned_like
from ..core.interface import Core
from ..core.work import Work

__all__ = ["Group", "REDUCE_OPS", "canonical_members", "group_id", "tree_children", "choose_broadcast",
           "node_plan", "chunk_plan", "reduce_in_order", "split_bounds"]

#: Broadcast payloads of at least this many bytes take the topology-aware path.
LARGE_BROADCAST = 1 << 20
#: Chunk size of the pipelined cross-node broadcast chain.
CHUNK = 4 << 20
#: Small broadcasts to this many members or more go down a binomial tree.
TREE_MIN_MEMBERS = 9
#: all_reduce arrays of at least this many bytes are reduce-scattered then all-gathered.
REDUCE_SCATTER_MIN = 1 << 20
#: Reductions over this many bytes run in an executor, off the event loop.
_OFFLOAD_BYTES = 8 << 20
_ALIGN = 64
REDUCE_OPS = ("sum", "max", "min", "mean")


# -- pure parts (unit-tested) ------------------------------------------------------------
def canonical_members(addresses: Any, me: str | None = None) -> tuple[str, ...]:
    """Sort ``addresses`` canonically (by group name, then numeric rank).

    Raises:
        TypeError: not a list/tuple of str. ValueError: empty, malformed, duplicated,
            or ``me`` given and not among them.
    """
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, (list, tuple, set, frozenset)):
        raise TypeError(f"a group takes a list of worker addresses, got {type(addresses).__name__}")
    if not addresses:
        raise ValueError("a group needs at least one member")
    keyed = sorted((parse_address(a), a) for a in addresses)
    members = tuple(a for _, a in keyed)
    dups = sorted({a for a in members if members.count(a) > 1})
    if dups:
        raise ValueError(f"duplicate group members: {dups}")
    if me is not None and me not in members:
        raise ValueError(f"{me} is not a member of the group {list(members)}; only members can use it")
    return members


def group_id(members: Sequence[str], name: str = "") -> str:
    """A short stable id of a canonical member list and a group name (the same on every
    member)."""
    text = "\n".join(members) + (f"\n#{name}" if name else "")
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def tree_children(rel: int, n: int) -> list[int]:
    """Children of relative rank ``rel`` (root = 0) in a binomial tree of ``n``, biggest subtree first."""
    children, mask = [], 1
    while mask < n and not rel & mask:
        if rel + mask < n:
            children.append(rel + mask)
        mask <<= 1
    return children[::-1]


def choose_broadcast(nbytes: int, n: int) -> str:
    """``"direct"`` (root sends to all), ``"tree"`` (binomial) or ``"topology"``."""
    if nbytes >= LARGE_BROADCAST:
        return "topology"
    return "tree" if n >= TREE_MIN_MEMBERS else "direct"


def node_plan(members: Sequence[str], root: str,
              node_of: Callable[[str], Any]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Split a large broadcast by node.

    Returns:
        ``(local, chain, locals_)``: the root's same-node members; the chain of the other
        nodes' leaders (lowest-ranked member of each node, nodes in member order), which
        the payload is pipelined along; and each leader's same-node members. A member
        whose node is unknown (``node_of`` returns None) counts as a node of its own.
    """
    nodes: dict[Any, list[str]] = {}
    for m in members:
        key = node_of(m)
        nodes.setdefault(("?", m) if key is None else key, []).append(m)
    root_key = next(k for k, ms in nodes.items() if root in ms)
    local = [m for m in nodes[root_key] if m != root]
    chain, locals_ = [], {}
    for key, ms in nodes.items():
        if key != root_key:
            chain.append(ms[0])
            locals_[ms[0]] = ms[1:]
    return local, chain, locals_


def chunk_plan(sizes: Sequence[int], chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """``(buffer index, offset, length)`` of every chunk of buffers of ``sizes``."""
    return [(i, off, min(chunk, size - off)) for i, size in enumerate(sizes) for off in range(0, size, chunk)]


def split_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges covering ``range(length)``; the first ``length % n`` get one more."""
    q, r = divmod(length, n)
    bounds, lo = [], 0
    for j in range(n):
        hi = lo + q + (j < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def reduce_in_order(parts: Sequence[Any], op: str) -> Any:
    """Reduce equal-shaped arrays/tensors in the given order (so every member gets
    bitwise-equal results). ``mean`` divides by ``len(parts)``. Returns a new array."""
    first = parts[0]
    is_np = isinstance(first, np.ndarray)
    if is_np:
        acc = page_aligned_like(first)   # not first.copy(): see rlinf.util.memory
        np.copyto(acc, first)
    else:
        acc = first.clone()
    for p in parts[1:]:
        if op in ("sum", "mean"):
            if is_np or acc.dtype != _torch().bool:
                acc += p
            else:
                acc |= p
        elif is_np:
            (np.maximum if op == "max" else np.minimum)(acc, p, out=acc)
        else:
            torch = _torch()
            (torch.maximum if op == "max" else torch.minimum)(acc, p, out=acc)
    if op == "mean":
        acc /= len(parts)
    return acc


def _torch():
    import torch   # only reached with torch tensors in hand

    return torch


# -- the algorithms ------------------------------------------------------------------------
async def _broadcast(call: Call, obj: Any) -> Any:
    members, me, root, n = call.members, call.me, call.root, len(call.members)
    others = call.others
    if not others:
        return obj
    if me != root:
        # any member may be our parent; only the root's loss is ours to detect (a lost
        # forwarder never acknowledges, so the root fails and aborts the call for all)
        phase, parent, payload = await call.recv(("d", "h"), needs=(root,))
        if phase == "h":
            value = await _chain_member(call, parent, payload)
        else:
            value, forward = payload
            if forward == "tree":
                r = members.index(root)
                rel = (call.index - r) % n
                await call.fan_out("d", payload, [members[(r + c) % n] for c in tree_children(rel, n)])
            elif forward:
                await call.fan_out("d", (value, None), forward)
        await call.drain()            # forwarded before acknowledging: a member that acked
        call.send("a", None, root)    # and then died owes nobody anything
        return value
    header, buffers = call.core.codec.encode(obj)
    algorithm = choose_broadcast(sum(buffer_nbytes(b) for b in buffers), n)
    if algorithm == "direct":
        await call.fan_out("d", (obj, None), others)
    elif algorithm == "tree":
        await call.fan_out("d", (obj, "tree"), [members[(call.index + c) % n] for c in tree_children(0, n)])
    else:
        await _topology_root(call, obj, header, buffers)
    await call.collect("a", others)
    await call.drain()
    return obj


async def _topology_root(call: Call, obj: Any, header: bytes, buffers: list) -> None:
    """One copy per other node, pipelined along a chain of node leaders; same-node
    members get it through one multicast (shared memory written once)."""
    core = call.core
    nodes = {p.address: p.node_id for p in core.roster()}
    nodes[call.me] = core.info.node_id
    local, chain, locals_ = node_plan(call.members, call.root, nodes.get)
    if chain:
        if any(is_device_buffer(b) for b in buffers):   # device buffers: no host chunking here
            for leader in chain:
                call.send("d", (obj, locals_[leader]), leader)
        else:
            sizes = [buffer_nbytes(b) for b in buffers]
            call.send("h", {"header": header, "sizes": sizes, "chain": chain, "locals": locals_}, chain[0])
            for i, off, length in chunk_plan(sizes):
                call.send("c", (i, off, np.frombuffer(buffers[i], np.uint8, length, off)), chain[0])
    await call.fan_out("d", (obj, None), local)


async def _chain_member(call: Call, parent: str, info: dict) -> Any:
    """A node leader in the chain: assemble the chunks, forward each as it arrives,
    then hand the object to this node's members."""
    chain, sizes = info["chain"], info["sizes"]
    try:
        position = chain.index(call.me)
    except ValueError:
        raise ProtocolError(f"{call.me} got a broadcast chain it is not in, in {call.what}") from None
    successor = chain[position + 1] if position + 1 < len(chain) else None
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    blob = page_aligned(total)   # chunks are copied in: see rlinf.util.memory
    if successor is not None:
        call.send("h", info, successor)
    for _ in chunk_plan(sizes):
        _, _, (i, off, part) = await call.recv("c", parent)
        start = offsets[i] + off
        piece = blob[start:start + part.nbytes]
        piece[...] = part
        if successor is not None:
            call.send("c", (i, off, piece), successor)
    value = call.core.codec.decode(info["header"], [memoryview(blob[o:o + s]) for o, s in zip(offsets, sizes)])
    await call.fan_out("d", (value, None), info["locals"].get(call.me, []))
    return value


async def _gather(call: Call, obj: Any) -> list | None:
    if call.me != call.root:
        call.send("d", obj, call.root)
        await call.recv("go", call.root)   # the root's "go" also exposes a root mismatch
        await call.drain()
        return None
    others = call.others
    for m in others:
        call.send("go", None, m)
    got = await call.collect("d", others)
    got[call.me] = obj
    await call.drain()
    return [got[m] for m in call.members]


async def _scatter(call: Call, objs: Any) -> Any:
    if call.me != call.root:
        _, _, value = await call.recv("d", call.root)
        call.send("a", None, call.root)
        await call.drain()
        return value
    _check_per_member(objs, len(call.members), "scatter")
    others = call.others
    for m in others:
        call.send("d", objs[call.members.index(m)], m)
    await call.collect("a", others)
    await call.drain()
    return objs[call.index]


async def _all_gather(call: Call, obj: Any) -> list:
    others = call.others
    await call.fan_out("d", obj, others)
    got = await call.collect("d", others)
    got[call.me] = obj
    await call.drain()
    return [got[m] for m in call.members]


async def _all_to_all(call: Call, objs: Any) -> list:
    members = call.members
    _check_per_member(objs, len(members), "all_to_all")
    others = call.others
    for m in others:
        call.send("d", objs[members.index(m)], m)
    got = await call.collect("d", others)
    got[call.me] = objs[call.index]
    await call.drain()
    return [got[m] for m in members]


async def _barrier(call: Call) -> None:
    await _all_gather(call, None)


async def _all_reduce(call: Call, array: Any, op: str, inplace: bool) -> Any:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    # every check before the exchange: a failure here reaches the other members as the same error
    if isinstance(array, np.ndarray):
        if array.dtype.kind not in "biufc":
            raise TypeError(f"all_reduce needs a numeric array, got dtype {array.dtype}")
        if inplace and not array.flags.writeable:
            raise ValueError("all_reduce(inplace=True) needs a writable array")
        flat, family, floating = np.ascontiguousarray(array).reshape(-1), "numpy", array.dtype.kind in "fc"
        dtype = array.dtype.str
    elif type(array).__module__.startswith("torch") and hasattr(array, "is_floating_point"):
        if array.is_complex() and op in ("max", "min"):
            raise TypeError(f"op={op!r} is not defined for complex tensors ({array.dtype})")
        if inplace and (array.is_inference() or any(
                step == 0 and n > 1 for n, step in zip(array.shape, array.stride()))):
            raise ValueError("all_reduce(inplace=True) needs a tensor it can write: this one is an inference "
                             "tensor, or its elements share memory (an expand()ed view)")
        flat, family = array.detach().contiguous().reshape(-1), "torch"
        floating, dtype = array.is_floating_point() or array.is_complex(), str(array.dtype)
    else:
        raise TypeError(f"all_reduce takes a numpy array or a torch tensor, got {type(array).__name__}")
    if op == "mean" and not floating:
        raise TypeError(f"op='mean' needs a floating-point array, got {dtype}")
    call.extra = (op, family, dtype, tuple(array.shape))
    members, n, me = call.members, len(call.members), call.index
    nbytes = flat.nbytes if family == "numpy" else flat.numel() * flat.element_size()
    if n == 1:
        result = reduce_in_order([flat], op)
    elif nbytes < REDUCE_SCATTER_MIN:
        parts = await _all_gather(call, flat)
        result = await _reduce(parts, op, nbytes * n)
    else:   # reduce-scatter (member j reduces slice j), then all-gather the reduced slices
        bounds = split_bounds(flat.shape[0], n)
        for m in call.others:
            lo, hi = bounds[members.index(m)]
            call.send("rs", flat[lo:hi], m)
        got = await call.collect("rs", call.others)
        got[call.me] = flat[bounds[me][0]:bounds[me][1]]
        mine = await _reduce([got[m] for m in members], op, nbytes)
        await call.fan_out("ag", mine, call.others)
        result = page_aligned_like(flat) if family == "numpy" else _torch().empty_like(flat)
        result[bounds[me][0]:bounds[me][1]] = mine
        for src, payload in (await call.collect("ag", call.others)).items():
            lo, hi = bounds[members.index(src)]
            result[lo:hi] = payload
    await call.drain()
    result = result.reshape(array.shape)
    if not inplace:
        return result
    if family == "numpy":
        array[...] = result
    else:
        with _torch().no_grad():   # a parameter (requires_grad) is written in place too
            array.copy_(result)
    return array


async def _reduce(parts: list, op: str, nbytes: int) -> Any:
    if nbytes < _OFFLOAD_BYTES:
        return reduce_in_order(parts, op)
    return await asyncio.get_running_loop().run_in_executor(None, reduce_in_order, parts, op)


def _check_per_member(objs: Any, n: int, what: str) -> None:
    if not isinstance(objs, (list, tuple)):
        raise TypeError(f"{what} takes a list with one object per member, got {type(objs).__name__}")
    if len(objs) != n:
        raise ValueError(f"{what} takes one object per member: got {len(objs)} for {n} members")


# -- the public class ------------------------------------------------------------------------
def _cancelled_before_start(call: Call, task: asyncio.Task) -> None:
    """An ``async_*`` Work cancelled before its task ever ran: ``execute`` never saw the
    call (it took its sequence number all the same), so tell the other members, as a
    cancellation inside it does, instead of leaving them waiting for us."""
    if task.cancelled() and call.task is None:
        call.abort_others(asyncio.CancelledError())
        call.retire()


class Group:
    """A collective group over ``addresses`` (same list, any order, on every member).

    Created with ``comm.group(addresses)``; nothing is sent until the first call. Each
    collective is a coroutine taking ``timeout=None`` (seconds; None: ``RLINF_TIMEOUT``
    if set, else forever; expiry raises :class:`~rlinf.CommTimeoutError` on this member
    and is sent to the others) and has an ``async_`` twin that fixes the call's place in
    the group's order at once and returns a :class:`~rlinf.Work`.

    Every call raises :class:`~rlinf.PeerLostError` when a member it still needs is lost
    (within the detection bound), ``ValueError`` when members made mismatched calls (or
    one passed a bad argument), and :class:`~rlinf.ClosedError` once the communicator is
    closed; a failure on one member is sent to the others, which raise it too. Calls
    return when this member's part is done and the buffers it sent may be reused; the
    objects they return are owned by the caller. See ``docs/collectives.md``.

    Args:
        comm: this worker's communicator (it must be one of ``addresses``).
        addresses: the members' ``"group:rank"`` addresses.
        name: tells apart groups over the same members (every member passes the same).
            Calls are numbered per group in each member, and a member restarted under
            its address numbers from 0 again while the others go on: after a restart,
            make the group under a new name on every member (say, the restart count).

    Raises:
        TypeError / ValueError: malformed or duplicated addresses, ``comm`` not a member,
            or a ``name`` that is not a str.
    """

    def __init__(self, comm, addresses: Sequence[str], name: str = "") -> None:
        if not isinstance(name, str):
            raise TypeError(f"a group name is a str, got {type(name).__name__}")
        core: Core = comm.internal
        self._core = core
        self._members = canonical_members(addresses, core.address)
        self._set = frozenset(self._members)
        self._id = group_id(self._members, name)
        self._namespace = f"g:{self._id}"
        self._rank = self._members.index(core.address)
        shown = ", ".join(self._members[:6]) + (", ..." if len(self._members) > 6 else "")
        self._label = f"group {self._id} [{shown}]"

    def __repr__(self) -> str:
        return (f"<Group {self._id} [{self._label.split('[', 1)[1]} size={self.size} rank={self._rank} "
                f"calls={calls_made(self._core, self._namespace)}>")

    @property
    def members(self) -> list[str]:
        """The members in canonical order (the order of ``gather``/``all_gather`` results)."""
        return list(self._members)

    @property
    def rank(self) -> int:
        """This worker's index in :attr:`members`."""
        return self._rank

    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def id(self) -> str:
        """The group's stable id (the same on every member)."""
        return self._id

    def _call(self, kind: str, root: Any = None) -> Call:
        resolved, error = None, None
        if kind in ("broadcast", "gather", "scatter"):
            if isinstance(root, int) and not isinstance(root, bool) and 0 <= root < len(self._members):
                resolved = self._members[root]
            elif isinstance(root, str) and root in self._set:
                resolved = root
            else:
                error = ValueError(f"root must be a member address or index of {list(self._members)}, got {root!r}")
                resolved = repr(root)
        call = Call(self._core, self._members, self._set, self._namespace, kind, resolved, None, self._label)
        call.arg_error = error
        return call

    def _work(self, call: Call, body: Callable[..., Awaitable[Any]], *args: Any, timeout: float | None) -> Work:
        task = asyncio.get_running_loop().create_task(execute(call, body, *args, timeout=timeout))
        task.add_done_callback(lambda t: _cancelled_before_start(call, t))
        return Work(task, call.what)

    async def broadcast(self, obj: Any = None, *, root: str | int, timeout: float | None = None) -> Any:
        """Send ``obj`` from ``root`` to every member; returns it on every member.

        Non-roots pass None (ignored). The root returns once every member has received
        it (each acknowledges). Small payloads go directly (or down a binomial tree in
        large groups); large ones cross each node boundary once and fan out inside each
        node through one multicast. The root gets its own ``obj`` back.
        """
        return await execute(self._call("broadcast", root), _broadcast, obj, timeout=timeout)

    def async_broadcast(self, obj: Any = None, *, root: str | int, timeout: float | None = None) -> Work:
        """:meth:`broadcast`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("broadcast", root), _broadcast, obj, timeout=timeout)

    async def gather(self, obj: Any, *, root: str | int, timeout: float | None = None) -> list | None:
        """Collect every member's ``obj`` at ``root``: a list in :attr:`members` order
        there, None elsewhere (non-roots return once the root has joined the call)."""
        return await execute(self._call("gather", root), _gather, obj, timeout=timeout)

    def async_gather(self, obj: Any, *, root: str | int, timeout: float | None = None) -> Work:
        """:meth:`gather`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("gather", root), _gather, obj, timeout=timeout)

    async def scatter(self, objs: Sequence[Any] | None = None, *, root: str | int,
                      timeout: float | None = None) -> Any:
        """``root`` passes one object per member (in :attr:`members` order); each member
        gets its own. Non-roots pass None."""
        return await execute(self._call("scatter", root), _scatter, objs, timeout=timeout)

    def async_scatter(self, objs: Sequence[Any] | None = None, *, root: str | int,
                      timeout: float | None = None) -> Work:
        """:meth:`scatter`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("scatter", root), _scatter, objs, timeout=timeout)

    async def all_gather(self, obj: Any, *, timeout: float | None = None) -> list:
        """Every member's ``obj``, on every member, in :attr:`members` order."""
        return await execute(self._call("all_gather"), _all_gather, obj, timeout=timeout)

    def async_all_gather(self, obj: Any, *, timeout: float | None = None) -> Work:
        """:meth:`all_gather`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("all_gather"), _all_gather, obj, timeout=timeout)

    async def all_to_all(self, objs: Sequence[Any], *, timeout: float | None = None) -> list:
        """``objs[i]`` goes to ``members[i]``; returns what each member sent to this one,
        in :attr:`members` order (this member's own slot is its ``objs[rank]``, not a copy)."""
        return await execute(self._call("all_to_all"), _all_to_all, objs, timeout=timeout)

    def async_all_to_all(self, objs: Sequence[Any], *, timeout: float | None = None) -> Work:
        """:meth:`all_to_all`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("all_to_all"), _all_to_all, objs, timeout=timeout)

    async def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every member has entered the barrier."""
        await execute(self._call("barrier"), _barrier, timeout=timeout)

    def async_barrier(self, *, timeout: float | None = None) -> Work:
        """:meth:`barrier`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("barrier"), _barrier, timeout=timeout)

    async def all_reduce(self, array: Any, op: str = "sum", *, inplace: bool = False,
                         timeout: float | None = None) -> Any:
        """Reduce a numpy array or torch tensor elementwise over all members.

        ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"mean"`` (floating point only).
        Every member must pass the same shape and dtype (else ``ValueError``). Members
        reduce in :attr:`members` order, so every member gets bitwise-equal results.

        Returns:
            A new array/tensor of the same type, dtype, shape and device; the input is
            left untouched unless ``inplace=True`` (torch-style), which writes the result
            into ``array`` and returns it.
        """
        return await execute(self._call("all_reduce"), _all_reduce, array, op, inplace, timeout=timeout)

    def async_all_reduce(self, array: Any, op: str = "sum", *, inplace: bool = False,
                         timeout: float | None = None) -> Work:
        """:meth:`all_reduce`, started now; returns a :class:`~rlinf.Work`."""
        return self._work(self._call("all_reduce"), _all_reduce, array, op, inplace, timeout=timeout)
