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


async def hold_and_check(comm, peer: str, n: int):
    """Keep the first tensor received while ``n - 1`` more arrive (the sender rewrites
    its own tensor each time); report whether the kept one still holds its value."""
    first = await comm.recv(peer, timeout=120)
    kept = float(first[0])
    for _ in range(n - 1):
        await comm.recv(peer, timeout=120)
    await comm.send({"kept": kept, "now": float(first[0]), "all_equal": bool((first == kept).all())}, peer)
    await comm.recv(peer, tag=9, timeout=120)     # still holding `first` until told
    return 0


async def slow_reader(comm, peer: str, n: int):
    """Queue a long kernel over each received view, drop the view at once, and check
    later that the kernel read the message's values (a slot rewritten too early fails)."""
    import torch

    sums = []
    for _ in range(n):
        t = await comm.recv(peer, timeout=120)
        torch.cuda._sleep(20_000_000)           # ~10 ms of GPU time queued before the read
        sums.append((t * 1).sum())
        del t                                    # the slot goes back now; the read is still queued
    torch.cuda.synchronize()
    await comm.send([float(s) for s in sums], peer)
    return 0


async def drain_and_report(comm, peer: str, n: int, every: int):
    """Receive ``n`` tensors (dropping each), ack every ``every``; then report this
    process's device memory."""
    import torch

    for i in range(n):
        await comm.recv(peer, timeout=120)
        if (i + 1) % every == 0:
            await comm.send(i + 1, peer, tag=1)
    torch.cuda.synchronize()
    await comm.send({"allocated": torch.cuda.memory_allocated(), "free": torch.cuda.mem_get_info()[0]}, peer,
                    tag=2)
    await comm.recv(peer, tag=3, timeout=120)
    return 0


async def gpu_types(comm, peer: str):
    """Echo the types and devices of what arrives (cupy arrays stay cupy arrays)."""
    obj = await comm.recv(peer, timeout=120)
    await comm.send({k: (type(v).__module__.split(".")[0], str(getattr(v, "device", ""))) for k, v in obj.items()},
                    peer)
    await comm.send(obj, peer)
    return 0


async def send_then_wait(comm, peer: str):
    """Send one GPU tensor, then wait (to be killed)."""
    import torch

    await comm.send(torch.full((1 << 20,), 3.0, device="cuda"), peer)
    await comm.recv(peer, timeout=600)
    return 0


async def channel_consumer(comm, peer: str, name: str, n: int):
    """Get ``n`` items from channel ``name`` (prefetched and decoded ahead), report them."""
    ch = await comm.channel(name, prefetch=2, decode_ahead=True, timeout=60)
    items = [await ch.get(timeout=60) for _ in range(n)]
    await comm.send([(str(t.device), float(t.sum())) for t in items], peer)
    return 0
