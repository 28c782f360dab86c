"""Copying a received object into existing arrays/tensors (``comm.recv_into``).

The received object's arrays are views over the receive buffers; this walks it beside
the caller's target and copies each array into the target's, in place, checking that
the structure, shapes and dtypes match. No new array is allocated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["copy_into"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "copy_")


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "shape") and hasattr(x, "dtype") and x.ndim >= 0


def copy_into(target: Any, source: Any, path: str = "$") -> None:
    """Copy every array/tensor of ``source`` into the matching one of ``target``.

    Raises:
        TypeError: the structures differ (a container of another kind, a missing array).
        ValueError: a shape, dtype or length differs; the message names the path.
    """
    if _is_torch(target):
        if not _is_torch(source):
            raise TypeError(f"{path}: target is a tensor, message has {type(source).__name__}")
        if tuple(target.shape) != tuple(source.shape) or target.dtype != source.dtype:
            raise ValueError(f"{path}: target is {target.dtype}{tuple(target.shape)}, "
                             f"message has {source.dtype}{tuple(source.shape)}")
        target.copy_(source)
        return
    if type(target).__module__ == "numpy" and hasattr(target, "dtype") and hasattr(target, "shape"):
        import numpy as np

        if not isinstance(source, np.ndarray) and not isinstance(source, np.generic):
            raise TypeError(f"{path}: target is an array, message has {type(source).__name__}")
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"{path}: target is {target.dtype}{target.shape}, message has {source.dtype}{source.shape}")
        if target.ndim == 0 and not isinstance(target, np.ndarray):
            raise TypeError(f"{path}: numpy scalars are immutable; use a 0-d array as target")
        np.copyto(target, source)
        return
    if isinstance(target, dict):
        if not isinstance(source, dict) or target.keys() != source.keys():
            raise ValueError(f"{path}: dict keys differ from the message's")
        for key in target:
            copy_into(target[key], source[key], f"{path}[{key!r}]")
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(source, (list, tuple)) or len(target) != len(source):
            raise ValueError(f"{path}: expected a sequence of {len(target)} items")
        for i, (t, s) in enumerate(zip(target, source)):
            copy_into(t, s, f"{path}[{i}]")
        return
    if dataclasses.is_dataclass(target) and not isinstance(target, type):
        if type(source) is not type(target):
            raise TypeError(f"{path}: expected {type(target).__name__}, message has {type(source).__name__}")
        for f in dataclasses.fields(target):
            copy_into(getattr(target, f.name), getattr(source, f.name), f"{path}.{f.name}")
        return
    # Plain values (numbers, strings, None) cannot be written in place; they must agree.
