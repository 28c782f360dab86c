"""copy_into: writing a received object into existing arrays/tensors (pure, no processes)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

from rlinf.codec import Codec
from rlinf.codec.into import copy_into


@dataclasses.dataclass
class Params:
    w: torch.Tensor
    b: np.ndarray
    step: int = 0


class Pair(NamedTuple):
    left: np.ndarray
    right: torch.Tensor


def _target():
    return {
        "policy": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "layers": [np.zeros(5, dtype=np.int64), np.zeros((2, 2), dtype=np.float32)],
        "dc": Params(torch.zeros(2), np.zeros(3)),
        "pair": Pair(np.zeros(1, dtype=np.uint8), torch.zeros(2, dtype=torch.int32)),
        "scalar": np.zeros((), dtype=np.float64),
        "name": "placeholder",
    }


def _source():
    return {
        "policy": {"w": torch.arange(12.0).reshape(4, 3).t(), "b": torch.full((4,), 2.5, dtype=torch.bfloat16)},
        "layers": [np.arange(5, dtype=np.int64), np.full((2, 2), 7, dtype=np.float32)],
        "dc": Params(torch.tensor([1.0, -1.0]), np.array([0.5, 1.5, 2.5]), step=9),
        "pair": Pair(np.array([255], dtype=np.uint8), torch.tensor([3, 4], dtype=torch.int32)),
        "scalar": np.array(3.25),
        "name": "anything",
    }


def _storages(obj):
    t = obj
    return [t["policy"]["w"].data_ptr(), t["policy"]["b"].data_ptr(), t["layers"][0].ctypes.data,
            t["layers"][1].ctypes.data, t["dc"].w.data_ptr(), t["dc"].b.ctypes.data,
            t["pair"].left.ctypes.data, t["pair"].right.data_ptr(), t["scalar"].ctypes.data]


def test_nested_copy_in_place():
    target, source = _target(), _source()
    before = _storages(target)
    copy_into(target, source)
    assert _storages(target) == before                       # written in place, nothing replaced
    assert torch.equal(target["policy"]["w"], source["policy"]["w"])
    assert torch.equal(target["policy"]["b"], source["policy"]["b"])
    assert np.array_equal(target["layers"][0], np.arange(5))
    assert np.array_equal(target["layers"][1], np.full((2, 2), 7, dtype=np.float32))
    assert torch.equal(target["dc"].w, torch.tensor([1.0, -1.0]))
    assert np.array_equal(target["dc"].b, [0.5, 1.5, 2.5])
    assert target["dc"].step == 0                             # plain values are placeholders
    assert target["pair"].left[0] == 255 and target["pair"].right.tolist() == [3, 4]
    assert float(target["scalar"]) == 3.25
    assert target["name"] == "placeholder"


def test_through_the_codec():
    """What recv_into sees: the decoded message, arrays as views over receive buffers."""
    codec = Codec()
    header, buffers = codec.encode(_source())
    received = codec.decode(header, [bytearray(memoryview(b).cast("B")) for b in buffers])
    target = _target()
    copy_into(target, received)
    assert torch.equal(target["policy"]["w"], _source()["policy"]["w"])
    assert target["policy"]["w"].is_contiguous()             # target layout kept


def test_parameters_that_require_grad():
    model = torch.nn.Linear(3, 2)
    state = dict(model.named_parameters())
    new = {k: torch.full_like(v, 0.5).detach() for k, v in state.items()}
    copy_into(state, new)
    assert torch.equal(model.weight, torch.full((2, 3), 0.5)) and model.weight.requires_grad


def test_noncontiguous_target():
    base = torch.zeros(4, 4)
    view = base[:, 1]
    copy_into(view, torch.arange(4.0))
    assert base[:, 1].tolist() == [0.0, 1.0, 2.0, 3.0] and base[:, 0].abs().sum() == 0


@pytest.mark.parametrize("target, source, error, words", [
    (torch.zeros(3), torch.zeros(4), ValueError, ["$", "float32[3]", "float32[4]"]),
    (torch.zeros(3), torch.zeros(3, dtype=torch.float64), ValueError, ["torch.float32", "torch.float64"]),
    (np.zeros(3), np.zeros(3, dtype=np.float32), ValueError, ["float64", "float32"]),
    (np.zeros(3, dtype="<i4"), np.zeros(3, dtype=">i4"), ValueError, ["int32", ">i4"]),
    (np.zeros(2), np.zeros((1, 2)), ValueError, ["[2]", "[1, 2]"]),
    (torch.zeros(3), np.zeros(3, dtype=np.float32), TypeError, ["a tensor", "an array"]),
    (np.zeros(3), torch.zeros(3), TypeError, ["an array", "a tensor"]),
    (np.float64(0.0), np.float64(1.0), TypeError, ["0-d array"]),
    ({"a": torch.zeros(1)}, [torch.zeros(1)], TypeError, ["dict", "list"]),
    ([torch.zeros(1)], {"a": torch.zeros(1)}, TypeError, ["list", "dict"]),
    ([torch.zeros(1)], [torch.zeros(1)] * 2, ValueError, ["1 items", "2"]),
    ({"a": torch.zeros(1), "b": 0}, {"a": torch.zeros(1), "c": 0}, ValueError, ["['b']", "['c']"]),
    (None, {"w": torch.zeros(2)}, TypeError, ["NoneType", "arrays"]),
    (Params(torch.zeros(2), np.zeros(3)), {"w": 1}, TypeError, ["Params", "dict"]),
])
def test_mismatches_raise_clear_errors(target, source, error, words):
    with pytest.raises(error) as info:
        copy_into(target, source)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_error_names_the_path_and_writes_nothing():
    target, source = _target(), _source()
    source["layers"][1] = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"\$\['layers'\]\[1\]"):
        copy_into(target, source)
    # checked before any copy: the earlier, matching leaves are untouched
    assert target["policy"]["w"].abs().sum() == 0 and target["layers"][0].sum() == 0
    source = _source()
    source["dc"] = Params(torch.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match=r"\$\['dc'\]\.w"):
        copy_into(_target(), source)


def test_read_only_target():
    target = np.zeros(3)
    target.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_into(target, np.ones(3))
