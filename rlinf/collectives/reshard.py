"""M->N batch resharding: :func:`reshard`.

A group of M *sources* holds one global batch, cut into contiguous shards in ``src``
order (shard sizes may differ, and may be 0). A group of N *destinations* wants it cut
into N contiguous slices, in ``dst`` order, by the rule of ``numpy.array_split``: with
``T`` rows in all, destination ``j`` gets ``T // N`` rows, plus one if
``j < T % N``. Each source sends each destination only the rows they share, straight
from source to destination; no rank ever holds the whole batch.

A shard is an array/tensor or any nesting of dict / list / tuple / namedtuple /
dataclass of them; every array in it has the same size along the batch dimension
``dim``. Other leaves (numbers, strings, None) are carried over from the first source
that contributes to a destination.

Protocol: every source sends its row count to every other participant (tiny messages),
so every participant computes the same transfer plan; then each source sends its
slices and each destination merges what it gets in source order. The call is
namespaced like a group collective (``"r:<id of src+dst>:<seq>"``), fails with
``PeerLostError`` if any participant is lost, raises ``ValueError`` on mismatched
``src``/``dst``/``dim`` between participants, and sends any failure to the others.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import sys
from typing import Any, Callable, Sequence

import numpy as np

from ..core.interface import HasCore
from ._engine import Call, execute
from .group import canonical_members, group_id

__all__ = ["reshard", "split_sizes", "transfer_plan", "batch_size", "slice_along", "merge_along"]


# -- pure parts (unit-tested) --------------------------------------------------------------
def split_sizes(total: int, n: int) -> list[int]:
    """Rows per destination: ``total // n`` each, one more for the first ``total % n``."""
    q, r = divmod(total, n)
    return [q + (j < r) for j in range(n)]


def transfer_plan(counts: Sequence[int], n_dst: int) -> list[tuple[int, int, int, int]]:
    """Who sends what: ``(source index, destination index, lo, hi)`` with ``lo:hi`` the
    rows of that source's shard. Sorted by destination, then source. A destination
    with no rows gets an empty slice from source 0 (so it learns the structure)."""
    sizes = split_sizes(sum(counts), n_dst)
    plan, d_lo = [], 0
    for j, size in enumerate(sizes):
        d_hi = d_lo + size
        if size == 0:
            plan.append((0, j, 0, 0))
        s_lo = 0
        for i, count in enumerate(counts):
            s_hi = s_lo + count
            lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
            if lo < hi:
                plan.append((i, j, lo - s_lo, hi - s_lo))
            s_lo = s_hi
        d_lo = d_hi
    return plan


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _axis(x: Any, dim: int, path: str) -> int:
    ndim = x.ndim
    axis = dim + ndim if dim < 0 else dim
    if not 0 <= axis < ndim:
        raise ValueError(f"{path}: an array of shape {tuple(x.shape)} has no dimension {dim}")
    return axis


def _zip_map(objs: list, fn: Callable[[list, str], Any], path: str = "$") -> Any:
    """Rebuild the structure of ``objs[0]`` with ``fn(arrays, path)`` at every array leaf,
    walking all ``objs`` in parallel (they must share the structure)."""
    first = objs[0]
    kind = type(first)
    if _is_array(first):
        if not all(_is_array(o) for o in objs):
            raise ValueError(f"shards differ in structure at {path}: an array in one, not in another")
        return fn(objs, path)
    if any(type(o) is not kind for o in objs):
        raise ValueError(f"shards differ in structure at {path}: "
                         f"{sorted({type(o).__name__ for o in objs})}")
    if isinstance(first, dict):
        keys = list(first)
        if any(len(o) != len(keys) or any(k not in o for k in keys) for o in objs):
            raise ValueError(f"shards differ in structure at {path}: different keys")
        values = {k: _zip_map([o[k] for o in objs], fn, f"{path}[{k!r}]") for k in keys}
        if kind is dict:
            return values
        out = copy.copy(first)
        out.update(values)
        return out
    if isinstance(first, (list, tuple)):
        if any(len(o) != len(first) for o in objs):
            raise ValueError(f"shards differ in structure at {path}: different lengths")
        values = [_zip_map([o[i] for o in objs], fn, f"{path}[{i}]") for i in range(len(first))]
        if hasattr(first, "_fields"):      # namedtuple
            return kind(*values)
        return values if kind is list else kind(values)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        out = copy.copy(first)
        for f in dataclasses.fields(first):
            object.__setattr__(out, f.name, _zip_map([getattr(o, f.name) for o in objs], fn, f"{path}.{f.name}"))
        return out
    return first


def batch_size(shard: Any, dim: int = 0) -> int:
    """The common size of every array in ``shard`` along ``dim``.

    Raises:
        ValueError: no arrays, or arrays of different sizes along ``dim``.
    """
    sizes: dict[str, int] = {}

    def visit(xs: list, path: str) -> Any:
        sizes[path] = xs[0].shape[_axis(xs[0], dim, path)]
        return xs[0]

    _zip_map([shard], visit)
    if not sizes:
        raise ValueError("a shard must hold at least one numpy array or torch tensor")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every array of a shard must have the same size along dim {dim}: {sizes}")
    return next(iter(sizes.values()))


def layout(shard: Any, dim: int = 0) -> list:
    """What every source of one reshard must agree on: per array, its path, kind and
    dtype, and its shape without ``dim``."""
    leaves: list = []

    def visit(xs: list, path: str) -> Any:
        x = xs[0]
        shape = list(x.shape)
        del shape[_axis(x, dim, path)]
        leaves.append([path, f"{type(x).__module__.split('.')[0]} {x.dtype}", shape])
        return x

    _zip_map([shard], visit)
    return leaves


def slice_along(shard: Any, lo: int, hi: int, dim: int = 0) -> Any:
    """Rows ``lo:hi`` along ``dim`` of every array in ``shard`` (views, not copies)."""
    def cut(xs: list, path: str) -> Any:
        x = xs[0]
        return x[(slice(None),) * _axis(x, dim, path) + (slice(lo, hi),)]

    return _zip_map([shard], cut)


def merge_along(pieces: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate same-structured pieces along ``dim`` (one piece is returned as is)."""
    if len(pieces) == 1:
        return pieces[0]

    def join(xs: list, path: str) -> Any:
        axis = _axis(xs[0], dim, path)
        try:
            if all(isinstance(x, np.ndarray) for x in xs):
                return np.concatenate(xs, axis=axis)
            import torch

            if all(isinstance(x, torch.Tensor) for x in xs):
                return torch.cat(xs, dim=axis)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"shards cannot be joined at {path}: {exc}") from exc
        raise ValueError(f"shards mix numpy arrays and torch tensors at {path}")

    return _zip_map(list(pieces), join)


def _addresses(addresses: Any, name: str) -> list[str]:
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, (list, tuple)):
        raise TypeError(f"{name} must be a list of worker addresses, got {type(addresses).__name__}")
    if not addresses:
        raise ValueError(f"{name} must name at least one worker")
    canonical_members(addresses)   # checks every address and rejects duplicates
    return list(addresses)


# -- the protocol ----------------------------------------------------------------------------
async def reshard(comm: HasCore, shard: Any, *, src: Sequence[str], dst: Sequence[str], dim: int = 0,
                  timeout: float | None = None) -> Any:
    """Move one global batch from the ``src`` workers to the ``dst`` workers (M -> N).

    Every participant (each worker in ``src`` or ``dst``, possibly both) calls it with the
    same ``src``, ``dst`` (in the same order: the order of the batch) and ``dim``.

    Args:
        comm: this worker's communicator.
        shard: a source's contiguous shard (array/tensor or nested structure of them,
            sharing the size along ``dim``; may be 0); None on a worker that is only
            a destination.
        src: the sources, in batch order. dst: the destinations, in batch order.
        dim: the batch dimension of every array.
        timeout: seconds (None: ``RLINF_TIMEOUT`` if set, else no limit).

    Returns:
        On a destination, its slice of the global batch, merged into one object of the
        shard's structure (a slice that comes whole from this worker's own shard is a
        view of it); None on a worker that is only a source. A source returns once its
        slices are sent and its buffers may be reused.

    Raises:
        TypeError / ValueError: bad arguments, a shard without arrays, mismatched calls
            or structures. PeerLostError: a participant was lost. CommTimeoutError.
    """
    src, dst = _addresses(src, "src"), _addresses(dst, "dst")
    members = canonical_members(set(src) | set(dst))
    core = comm.internal
    if core.address not in members:
        raise ValueError(f"{core.address} is neither a source nor a destination of this reshard")
    error = None
    if isinstance(dim, numbers.Integral) and not isinstance(dim, bool):
        dim = int(dim)    # numpy integers too
    else:   # raised inside the call, so the other participants hear of it
        error, dim = TypeError(f"dim must be an int, got {type(dim).__name__}"), repr(dim)
    call = Call(core, members, frozenset(members), f"r:{group_id(members)}", "reshard", None,
                 (tuple(src), tuple(dst), dim), f"reshard {len(src)}->{len(dst)}")
    call.arg_error = error
    return await execute(call, _reshard, shard, src, dst, dim, timeout=timeout)


def _check_layouts(src: list[str], layouts: dict[str, list]) -> None:
    """Sources whose shards differ in structure, dtype or the other dimensions cannot be
    merged (numpy would quietly promote dtypes where two meet, and not elsewhere)."""
    first = src[0]
    mine = {leaf[0]: leaf[1:] for leaf in layouts[first]}
    for m in src[1:]:
        theirs = {leaf[0]: leaf[1:] for leaf in layouts[m]}
        if theirs == mine:
            continue
        for path in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(path), theirs.get(path)
            if a != b:
                show = lambda x: f"{x[0]} {x[1]}" if x else "no array there"   # noqa: E731
                raise ValueError(f"the sources' shards differ at {path}: {first} has {show(a)}, {m} has "
                                 f"{show(b)} (shapes without the resharded dimension)")


async def _reshard(call: Call, shard: Any, src: list[str], dst: list[str], dim: int) -> Any:
    me = call.me
    counts: dict[str, int] = {}
    layouts: dict[str, list] = {}
    if me in src:
        if shard is None:
            raise ValueError(f"{me} is a source of this reshard and must pass its shard, not None")
        counts[me], layouts[me] = batch_size(shard, dim), layout(shard, dim)
        for m in call.others:
            call.send("n", [counts[me], layouts[me]], m)
    elif shard is not None:
        raise ValueError(f"{me} is only a destination of this reshard and must pass None as its shard")
    for m, told in (await call.collect("n", [m for m in src if m != me])).items():
        count = told[0] if isinstance(told, list) and len(told) == 2 else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{m} reported a bad shard size {count!r}")
        counts[m], layouts[m] = count, told[1]
    _check_layouts(src, layouts)   # every member sees the same layouts: all raise alike
    plan = transfer_plan([counts[m] for m in src], len(dst))
    kept: dict[int, Any] = {}
    if me in src:
        i = src.index(me)
        for s, j, lo, hi in plan:
            if s == i:
                piece = slice_along(shard, lo, hi, dim)
                if dst[j] == me:
                    kept[s] = piece
                else:
                    call.send("d", piece, dst[j])
    result = None
    if me in dst:
        j = dst.index(me)
        expected = [s for s, d, _, _ in plan if d == j]
        got = await call.collect("d", [src[s] for s in expected if s not in kept])
        result = merge_along([kept[s] if s in kept else got[src[s]] for s in expected], dim)
    await call.drain()
    return result
