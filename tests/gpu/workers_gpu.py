"""Module-level targets for the GPU tests (the spawn context imports them)."""

from __future__ import annotations


async def gpu_echo(comm, peer: str, n: int):
    """Receive ``n`` objects (tensors land on this process's current CUDA device) and echo
    back a report of where each tensor arrived plus the object itself."""
    import torch

    for _ in range(n):
        obj = await comm.recv(peer, timeout=120)
        devices = sorted({str(t.device) for t in _tensors(obj)})
        await comm.send({"devices": devices, "obj": obj}, peer, timeout=120)
    return torch.cuda.current_device()


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
