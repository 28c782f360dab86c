"""The same-node floor at small sizes: a minimal hand-written shared-memory loop.

It does what any shared-memory design must do for one message and nothing else: the
sender copies the tensors into a slot of a ring mapped once in both processes and
writes a small msgpack header (slot, offsets, shapes, the scalars) to a Unix stream
socket; the receiver's event loop (uvloop, as rlinf's) builds tensors over the slot,
touches every page, drops them and writes one byte back to return the slot. There is
no routing, ordering across peers, backpressure beyond the ring, release tracking by
garbage collection, authentication, codec generality or error handling.

So it is to the 400 KiB rows what memcpy is to the 40 MiB ones: not a baseline to beat
but the limit, showing how much of a round trip any design in Python must spend on this
machine (the copies, the tensors, the page touch, two wake-ups) and how much rlinf adds.

Buffer lifetime: the receiver's tensors are views of the ring; it returns a slot (one
byte) only after dropping them, and the sender never writes a slot it has not got back.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import statistics
import struct
import tempfile
import time

import msgpack
import numpy as np

from _common import nested_object, touch

SLOTS = 8            # the ring: as many messages in flight at most
_LEN = struct.Struct("<I")


def _layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // 64) * 64
    return offsets, max(end, 64)


class _Bytes(asyncio.Protocol):
    """Collects what arrives; ``wait()`` returns once there is something."""

    def __init__(self, made: asyncio.Future | None = None) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future | None = None
        self._made = made

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self._made is not None and not self._made.done():
            self._made.set_result(self)   # the factory runs before this: only now can it write

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def connection_lost(self, exc) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("peer closed"))

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


async def _sink(path: str, ring: str, slot_size: int, n: int, stream: int, torch_tensors: bool) -> None:
    if torch_tensors:
        import torch

        def tensor(mm, count, offset):
            return torch.frombuffer(mm, dtype=torch.float32, count=count, offset=offset)
    else:
        def tensor(mm, count, offset):
            return np.frombuffer(mm, np.float32, count, offset)
    with open(ring, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_unix_connection(_Bytes, path)
    buf = proto.buf

    async def one() -> None:
        while len(buf) < 4 or len(buf) < 4 + _LEN.unpack_from(buf)[0]:
            await proto.wait()
        size = _LEN.unpack_from(buf)[0]
        meta = msgpack.unpackb(bytes(buf[4:4 + size]))
        del buf[:4 + size]
        base = meta.pop("slot") * slot_size
        obj = meta.pop("scalars")
        obj["tensors"] = {name: tensor(mm, count, base + off) for name, off, count in meta["t"]}
        touch(obj)

    for _ in range(n):
        await one()
        proto.transport.write(b"rk")      # the slot back, and the ack
    for _ in range(2 if stream else 0):
        for _ in range(stream - 1):
            await one()
            proto.transport.write(b"r")
        await one()
        proto.transport.write(b"rk")
    proto.transport.close()


def sink(path: str, ring: str, slot_size: int, n: int, stream: int, torch_tensors: bool) -> None:
    import uvloop

    uvloop.run(_sink(path, ring, slot_size, n, stream, torch_tensors))


async def _source(ctx, total: int, reps: int, stream: int, torch_tensors: bool) -> tuple[float, float | None]:
    obj = nested_object(total, torch_tensors=torch_tensors)
    names = list(obj["tensors"])
    arrays = [np.asarray(t) for t in obj["tensors"].values()]
    offsets, slot_size = _layout(arrays)
    scalars = {k: v for k, v in obj.items() if k != "tensors"}
    d = tempfile.mkdtemp(prefix="rlinf-bench-")
    path, ring = f"{d}/s", f"/dev/shm/rlinf-bench-floor-{os.getpid()}"
    mm = dst = None
    try:
        with open(ring, "w+b") as f:
            f.truncate(SLOTS * slot_size)
            mm = mmap.mmap(f.fileno(), 0)
        dst = np.frombuffer(mm, np.uint8)
        dst[:] = 0                        # paged in, as a pool's segments are
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()

        server = await loop.create_unix_server(lambda: _Bytes(accepted), path)
        p = ctx.Process(target=sink, args=(path, ring, slot_size, reps + 1, stream, torch_tensors))
        p.start()
        proto = await asyncio.wait_for(accepted, 60)
        buf, state = proto.buf, {"free": SLOTS, "acks": 0, "next": 0}

        async def take(what: bytes) -> None:    # consume releases and acks until one `what`
            while True:
                for b in bytes(buf):
                    state["free" if b == ord("r") else "acks"] += 1
                buf.clear()
                if what == b"r" and state["free"] or what == b"k" and state["acks"]:
                    state["free" if what == b"r" else "acks"] -= 1
                    return
                await proto.wait()

        async def send() -> None:
            await take(b"r")
            slot = state["next"]
            state["next"] = (slot + 1) % SLOTS
            base = slot * slot_size
            entries = []
            for name, a, off in zip(names, arrays, offsets):
                dst[base + off:base + off + a.nbytes] = a.view(np.uint8).reshape(-1)
                entries.append((name, off, a.size))
            header = msgpack.packb({"slot": slot, "scalars": scalars, "t": entries})
            proto.transport.write(_LEN.pack(len(header)) + header)

        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await send()
            await take(b"k")
            times.append(time.perf_counter() - t0)
        streamed = None
        for _ in range(2 if stream else 0):
            t0 = time.perf_counter()
            for _ in range(stream):
                await send()
            await take(b"k")
            streamed = (time.perf_counter() - t0) / stream
        await loop.run_in_executor(None, p.join)
        server.close()
        return statistics.median(times[1:]), streamed
    finally:
        dst = None                        # the ring's last exported view, then the ring
        if mm is not None:
            mm.close()
        if os.path.exists(ring):
            os.unlink(ring)
        shutil.rmtree(d, ignore_errors=True)


def run(ctx, total: int, reps: int, stream: int, torch_tensors: bool) -> tuple[float, float | None]:
    """``(one at a time, streamed per message)`` in seconds, as transfer.py's rows time
    them (streamed is None without ``stream``). ``ctx`` starts the receiver process."""
    import uvloop

    return uvloop.run(_source(ctx, total, reps, stream, torch_tensors))
