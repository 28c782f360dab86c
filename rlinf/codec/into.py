"""Copying a received object into existing arrays/tensors (``comm.recv_into``).

The received object's arrays are views over the receive buffers; :func:`copy_into`
walks it beside the caller's target and copies each array into the target's, in place.
It checks the whole structure first, so a mismatch raises before anything is written
and leaves the target untouched. No new array is allocated.

Rules, by the kind of each node of the target:

* numpy array / torch tensor: the message must hold the same kind with the same shape
  and dtype (byte order included). torch targets may live on any device and may be
  leaf tensors that require grad (model parameters): the copy runs under ``no_grad``.
* dict: the same keys; list / tuple (namedtuples included): the same length;
  dataclass: the same class. Then each item by these rules.
* anything else (numbers, strings, None): a placeholder. It is not written (it cannot
  be updated in place) and the message may hold any plain value there, but not an
  array, which would be silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..util.copier import STREAM_BYTES, byte_view, copy_bytes, wrote

__all__ = ["copy_into"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "copy_") and hasattr(x, "dtype")


def _is_numpy(x: Any) -> bool:
    return type(x).__module__.startswith("numpy") and hasattr(x, "dtype") and hasattr(x, "shape")


def _describe(x: Any) -> str:
    """``a tensor torch.float32[3, 4]``, ``an array int64[5]``, ``a dict``: for messages."""
    if _is_torch(x):
        return f"a tensor {x.dtype}{list(x.shape)}"
    if _is_numpy(x):
        return f"an array {x.dtype}{list(x.shape)}"
    name = type(x).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _contains_array(x: Any, depth: int = 0) -> bool:
    if depth > 100:
        return False
    if _is_torch(x) or _is_numpy(x):
        return True
    if isinstance(x, dict):
        return any(_contains_array(v, depth + 1) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_contains_array(v, depth + 1) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return any(_contains_array(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x))
    return False


def _check(target: Any, source: Any, path: str, pairs: list) -> None:
    """Validate ``source`` against ``target``; collect the (target, source) leaves."""
    if _is_torch(target):
        if not _is_torch(source):
            raise TypeError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        if tuple(target.shape) != tuple(source.shape) or target.dtype != source.dtype:
            raise ValueError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        pairs.append((target, source))
    elif _is_numpy(target):
        import numpy as np   # numpy is a core dependency; imported here to keep import light

        if not isinstance(target, np.ndarray):
            raise TypeError(f"{path}: a numpy scalar cannot be written in place; use a 0-d array as target")
        if not _is_numpy(source):
            raise TypeError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        if not target.flags.writeable:
            raise ValueError(f"{path}: the target array is read-only")
        pairs.append((target, source))
    elif isinstance(target, dict):
        if not isinstance(source, dict):
            raise TypeError(f"{path}: target is a dict, the message has {_describe(source)}")
        if target.keys() != source.keys():
            missing = [k for k in target if k not in source]
            extra = [k for k in source if k not in target]
            raise ValueError(f"{path}: dict keys differ: missing from the message {missing}, "
                             f"not in the target {extra}")
        for key in target:
            _check(target[key], source[key], f"{path}[{key!r}]", pairs)
    elif isinstance(target, (list, tuple)):
        if not isinstance(source, (list, tuple)):
            raise TypeError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        if len(target) != len(source):
            raise ValueError(f"{path}: target has {len(target)} items, the message has {len(source)}")
        for i, (t, s) in enumerate(zip(target, source)):
            _check(t, s, f"{path}[{i}]", pairs)
    elif dataclasses.is_dataclass(target) and not isinstance(target, type):
        if type(source) is not type(target):
            raise TypeError(f"{path}: target is {_describe(target)}, the message has {_describe(source)}")
        for f in dataclasses.fields(target):
            _check(getattr(target, f.name), getattr(source, f.name), f"{path}.{f.name}", pairs)
    elif _contains_array(source):
        raise TypeError(f"{path}: the message has arrays here but the target has {_describe(target)}, "
                        "which cannot receive them")


def copy_into(target: Any, source: Any, path: str = "$") -> None:
    """Copy every array/tensor of ``source`` into the matching one of ``target``.

    The structure is checked first (see the module docstring for the rules); nothing is
    written unless all of it matches.

    Args:
        target: the object to write into (arrays/tensors inside containers).
        source: the received object.
        path: the name of ``target`` in error messages.

    Raises:
        TypeError: a node of another kind (a tensor where the target has an array, a
            list where it has a dict, arrays where it has a plain value).
        ValueError: a shape, dtype, length or key set differs, or a target array is
            read-only. Messages name the path, e.g. ``$['weights'][2]``.
    """
    pairs: list = []
    _check(target, source, path, pairs)
    if not pairs:
        return
    numpy_pairs = [(t, s) for t, s in pairs if not _is_torch(t)]
    torch_pairs = [(t, s) for t, s in pairs if _is_torch(t)]
    for t, s in numpy_pairs:       # the same dtype and shape (checked): a large one streams
        copy_bytes(t, s)
    if torch_pairs:
        import torch

        with torch.no_grad():
            for t, s in torch_pairs:
                # (the size first: small tensors, most of them, skip building views)
                big = t.numel() * t.element_size() >= STREAM_BYTES
                raw = byte_view(t, write=True) if big else None
                src = byte_view(s) if raw is not None else None
                if src is not None:
                    copy_bytes(raw, src)
                    wrote(t)
                else:
                    t.copy_(s)
