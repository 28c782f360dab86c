"""Where each tensor of a published tree lives in its flat bucket, and the copies in and out.

A tree (nested dicts, lists and tuples of torch tensors and numpy arrays) is flattened
into leaves in a fixed order; each leaf gets a 64-byte-aligned byte range of one flat
buffer (the *bucket*). :class:`Layout` records the structure, keys, dtypes, shapes and
offsets, travels as plain data, and is checked against a puller's tree before anything
is copied. The copies themselves (:func:`pack`, :func:`unpack`) move contiguous CPU
leaves as raw bytes through a :class:`~rlinf.util.copier.Copier` (split across threads)
and everything else (GPU tensors, non-contiguous sources or targets) with a typed copy.

Pure: no messaging here.
"""

from __future__ import annotations

import bisect

import hashlib
from typing import Any

import numpy as np

from ..util.copier import Copier, byte_view, wrote

__all__ = ["Layout", "flatten", "match", "pack", "unpack", "fresh", "build", "describe_path"]

_ALIGN = 64
_MAX_DEPTH = 64


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "copy_") and hasattr(x, "dtype")


def describe_path(path: tuple) -> str:
    """``('layers', 0, 'weight')`` -> ``"layers/0/weight"`` (for messages)."""
    return "/".join(str(k) for k in path) or "<root>"


def _dtype_name(x: Any, path: tuple) -> str:
    if _is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    dtype = x.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.kind in "SUVMm":
        raise TypeError(f"{describe_path(path)}: arrays of {dtype} cannot be published (plain numbers only)")
    if dtype.byteorder not in "=|":
        raise TypeError(f"{describe_path(path)}: byte order {dtype.str!r} is not supported; use the native order")
    return dtype.name


def flatten(tree: Any) -> tuple[Any, list[tuple[tuple, Any]]]:
    """``(skeleton, leaves)``: the containers of ``tree`` with each leaf replaced by its
    index (``["d", [[key, sub], ...]]``, ``["l", [...]]``, ``["t", [...]]`` or an int),
    and the ``(path, tensor_or_array)`` leaves in that order.

    Raises:
        TypeError: a leaf that is not a torch tensor or numpy array, or a dict key that is
            not a str or int.
    """
    leaves: list[tuple[tuple, Any]] = []

    def walk(x: Any, path: tuple) -> Any:
        if len(path) > _MAX_DEPTH:
            raise TypeError(f"{describe_path(path)}: nested deeper than {_MAX_DEPTH}")
        if _is_torch(x) or isinstance(x, np.ndarray):
            leaves.append((path, x))
            return len(leaves) - 1
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{describe_path(path)}: dict keys must be str or int, got {k!r}")
                items.append([k, walk(v, path + (k,))])
            return ["d", items]
        if isinstance(x, (list, tuple)):
            return ["t" if isinstance(x, tuple) else "l", [walk(v, path + (i,)) for i, v in enumerate(x)]]
        raise TypeError(f"{describe_path(path)}: a weight tree holds torch tensors and numpy arrays "
                        f"(in dicts, lists and tuples), not {type(x).__name__}")

    return walk(tree, ()), leaves


class Layout:
    """The byte layout of one published tree (or one shard of it).

    Attributes:
        paths, dtypes, shapes, offsets, sizes, kinds: per leaf (kind ``"t"``: torch,
            ``"n"``: numpy). total: the bucket's size in bytes. key: a digest of it all
            (pullers cache layouts by it).
    """

    __slots__ = ("skeleton", "paths", "dtypes", "shapes", "offsets", "sizes", "kinds", "total", "key")

    def __init__(self, skeleton: Any, paths: list[tuple], dtypes: list[str], shapes: list[tuple],
                 offsets: list[int], sizes: list[int], kinds: list[str]) -> None:
        self.skeleton, self.paths, self.dtypes, self.shapes = skeleton, paths, dtypes, shapes
        self.offsets, self.sizes, self.kinds = offsets, sizes, kinds
        self.total = max([o + n for o, n in zip(offsets, sizes)], default=0)
        self.key = ""
        self.key = hashlib.blake2b(repr(self.to_wire()[:-1]).encode(), digest_size=12).hexdigest()

    def __repr__(self) -> str:
        return f"<Layout {len(self.paths)} tensors, {self.total} bytes>"

    @classmethod
    def of(cls, tree: Any) -> tuple[Layout, list[Any]]:
        """The layout of ``tree`` and its leaves, in layout order."""
        skeleton, leaves = flatten(tree)
        dtypes, shapes, offsets, sizes, kinds, end = [], [], [], [], [], 0
        for path, x in leaves:
            dtypes.append(_dtype_name(x, path))
            shapes.append(tuple(int(s) for s in x.shape))
            n = int(x.nbytes) if not _is_torch(x) else x.numel() * x.element_size()
            offsets.append(end)
            sizes.append(n)
            kinds.append("t" if _is_torch(x) else "n")
            end += -(-n // _ALIGN) * _ALIGN
        return cls(skeleton, [p for p, _ in leaves], dtypes, shapes, offsets, sizes, kinds), [x for _, x in leaves]

    def to_wire(self) -> list:
        return [self.skeleton, [list(p) for p in self.paths], self.dtypes, [list(s) for s in self.shapes],
                self.offsets, self.sizes, self.kinds, self.key]

    @classmethod
    def from_wire(cls, data: list) -> Layout:
        skeleton, paths, dtypes, shapes, offsets, sizes, kinds, _ = data
        return cls(skeleton, [tuple(p) for p in paths], list(dtypes), [tuple(s) for s in shapes], list(offsets),
                   list(sizes), list(kinds))


def match(layouts: list[Layout], targets: list[tuple[tuple, Any]]) -> list[tuple[list[Any], list[int]]]:
    """Pair the ``(path, target)`` leaves of a puller's tree with the leaves of the
    published ``layouts`` (one per shard): for each layout, ``(targets, indices)``.
    Checks everything first: every key, shape and dtype matched, and nothing published
    is missing from the targets.

    Raises:
        ValueError: naming the first mismatch (a missing or extra key, a shape, a
            dtype, a read-only target).
    """
    index = {p: (s, i) for s, layout in enumerate(layouts) for i, p in enumerate(layout.paths)}
    out: list[tuple[list[Any], list[int]]] = [([], []) for _ in layouts]
    for path, target in targets:
        where = index.pop(path, None)
        if where is None:
            raise ValueError(f"{describe_path(path)}: not in the published tree")
        s, i = where
        layout = layouts[s]
        name = _dtype_name(target, path)
        shape = tuple(int(d) for d in target.shape)
        if shape != layout.shapes[i] or name != layout.dtypes[i]:
            raise ValueError(f"{describe_path(path)}: the target is {name}{list(shape)}, the published "
                             f"tensor is {layout.dtypes[i]}{list(layout.shapes[i])}")
        if isinstance(target, np.ndarray) and not target.flags.writeable:
            raise ValueError(f"{describe_path(path)}: the target array is read-only")
        out[s][0].append(target)
        out[s][1].append(i)
    if index:
        raise ValueError(f"{describe_path(min(index, key=str))}: published, but not in the target tree")
    return out


def _torch():
    import torch   # optional dependency: only trees with torch tensors get here

    return torch


def _typed(buf: np.ndarray, layout: Layout, i: int, kind: str, base: int = 0) -> Any:
    """Leaf ``i`` of ``layout`` over ``buf`` (the bucket's bytes from ``base`` on), as a
    tensor (``kind`` "t") or array."""
    raw = buf[layout.offsets[i] - base:layout.offsets[i] - base + layout.sizes[i]]
    if kind == "t":
        torch = _torch()
        return torch.from_numpy(raw).view(getattr(torch, layout.dtypes[i])).reshape(layout.shapes[i])
    return raw.view(np.dtype(layout.dtypes[i])).reshape(layout.shapes[i])


def _typed_copy(dst: Any, src: Any) -> None:
    if _is_torch(dst):
        with _torch().no_grad():
            dst.copy_(src if _is_torch(src) else _torch().from_numpy(src))
    else:
        np.copyto(dst, src.numpy() if _is_torch(src) else src)


def pack(layout: Layout, leaves: list[Any], buf: np.ndarray, copier: Copier) -> None:
    """Copy ``leaves`` (in layout order) into the uint8 bucket ``buf`` (thread-safe; runs
    off the event loop for large trees). Returns when every byte is in."""
    pairs, others = [], []
    for i, x in enumerate(leaves):
        n = layout.sizes[i]
        if not n:
            continue
        raw = byte_view(x)
        if raw is not None:
            pairs.append((buf[layout.offsets[i]:layout.offsets[i] + n], raw))
        else:
            others.append((_typed(buf, layout, i, "t" if _is_torch(x) else "n"), x))
    _copy_pairs(copier, pairs, [], others)


def _copy_pairs(copier: Copier, pairs: list, written: list, others: list) -> None:
    """The byte copies (then the targets written through byte views are told, see
    :func:`~rlinf.util.copier.wrote`), then the typed ones."""
    copier.copy(pairs)
    for target in written:
        wrote(target)
    for dst, src in others:
        _typed_copy(dst, src)


def unpack(layout: Layout, buf: np.ndarray, targets: list[Any], order: list[int], copier: Copier,
           base: int = 0) -> None:
    """Copy leaf ``order[j]`` of the bucket into ``targets[j]`` for every ``j``, from
    ``buf``: the bucket's bytes from offset ``base`` on (thread-safe). Returns when every
    target holds its bytes."""
    pairs, others, written = [], [], []
    for target, i in zip(targets, order):
        n = layout.sizes[i]
        if not n:
            continue
        raw = byte_view(target, write=True)
        if raw is not None:
            pairs.append((raw, buf[layout.offsets[i] - base:layout.offsets[i] - base + n]))
            written.append(target)
        else:
            others.append((target, _typed(buf, layout, i, "t" if _is_torch(target) else "n", base)))
    _copy_pairs(copier, pairs, written, others)


def unpack_range(layout: Layout, buf: np.ndarray, lo: int, hi: int, targets: dict[int, Any],
                 copier: Copier) -> None:
    """Copy the bytes ``[lo, hi)`` of the shard ``buf`` (all of its bucket, uint8) into
    the targets of the leaves they belong to (``targets``: leaf index -> tensor or
    array), for a shard that lands in order: a contiguous CPU target gets that part of
    its bytes; another one (GPU, non-contiguous) its whole leaf, at the range that ends
    it (every byte before ``hi`` is in ``buf`` then). Thread-safe."""
    pairs, others, written = [], [], []
    i = max(0, bisect.bisect_right(layout.offsets, lo) - 1)
    while i < len(layout.offsets) and layout.offsets[i] < hi:
        off, n = layout.offsets[i], layout.sizes[i]
        target = targets.get(i)
        if n and off + n > lo and target is not None:
            raw = byte_view(target, write=True)
            if raw is not None:
                a, b = max(lo, off), min(hi, off + n)
                pairs.append((raw[a - off:b - off], buf[a:b]))
                written.append(target)
            elif off + n <= hi:
                others.append((target, _typed(buf, layout, i, "t" if _is_torch(target) else "n")))
        i += 1
    _copy_pairs(copier, pairs, written, others)


def fresh(layouts: list[Layout]) -> tuple[Any, list[list[Any]]]:
    """A new tree shaped like the published one (CPU tensors / arrays of the kinds that
    were published, uninitialised; the shards' dicts merged) and, per layout, its
    leaves in layout order."""
    per_layout, trees = [], []
    for layout in layouts:
        leaves = []
        for i, kind in enumerate(layout.kinds):
            if kind == "t":
                torch = _torch()
                leaves.append(torch.empty(layout.shapes[i], dtype=getattr(torch, layout.dtypes[i])))
            else:
                leaves.append(np.empty(layout.shapes[i], np.dtype(layout.dtypes[i])))
        per_layout.append(leaves)
        trees.append(build(layout.skeleton, leaves))
    tree = trees[0]
    for other in trees[1:]:
        tree = _merge(tree, other)
    return tree, per_layout


def _merge(a: Any, b: Any) -> Any:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        raise ValueError("the shards of a version overlap outside of dicts: publish each shard as a dict "
                         "of distinct keys")
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out else v
    return out


def build(skeleton: Any, leaves: list[Any]) -> Any:
    """The tree of ``skeleton`` (see :func:`flatten`) with its leaf indices replaced."""
    if isinstance(skeleton, int):
        return leaves[skeleton]
    kind, items = skeleton
    if kind == "d":
        return {k: build(v, leaves) for k, v in items}
    built = [build(v, leaves) for v in items]
    return tuple(built) if kind == "t" else built
