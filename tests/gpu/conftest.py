"""GPU tests: skipped cleanly where torch has no CUDA device (CI never has one)."""

from __future__ import annotations

import pytest


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.cuda)
        if count == 0:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda unavailable)"))
        elif "two_gpus" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))
