"""The transport conformance suite: every transport must pass every test here.

The contract (``rlinf/transports/base.py``): the listener delivers each frame set
whole, in order per link; received frames stay valid while referenced; closing fails
what waits with ``ClosedError``; native errors surface as rlinf errors. These tests
send through ``Link.send(header, buffers)`` (returns when the buffers may be reused);
``test_link_contract.py`` drives the primitives it composes as the outbox does
(``try_send`` / ``WouldBlock`` / ``wait_writable`` / ``released`` / ``close_gracefully``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import rlinf
from rlinf.codec import Codec

pytestmark = pytest.mark.timeout(60)


def _payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _bytes(frame) -> bytes:
    return bytes(memoryview(frame).cast("B"))


async def _recv(pair, timeout: float = 10):
    async with asyncio.timeout(timeout):
        return await pair.listener.recv()


async def test_frame_sets_arrive_whole_and_in_order(pair):
    n = 300
    async with asyncio.timeout(30):
        for i in range(n):
            await pair.link.send(f"h{i}".encode(), [np.full(i % 7 + 1, i % 251, np.uint8)])
        for i in range(n):
            got = await _recv(pair)
            assert got.header == f"h{i}".encode()
            assert len(got.frames) == 1 and _bytes(got.frames[0]) == bytes([i % 251]) * (i % 7 + 1)


async def test_backlog_from_several_links_is_drained_in_order(pair):
    # More frame sets than one read callback takes (and than one edge of ZeroMQ's FD
    # announces) wait at once: every one must still arrive, in order per link.
    n = 1500
    others = [await pair.connect(b"sender|2"), await pair.connect(b"sender|3")]
    links = [pair.link, *others]
    try:
        async with asyncio.timeout(40):
            for i in range(n):
                for k, link in enumerate(links):
                    await link.send(f"{k}:{i}".encode(), [bytes([k, i % 256])])
            seen = {k: 0 for k in range(len(links))}
            for _ in range(n * len(links)):
                got = await _recv(pair)
                k, i = map(int, got.header.decode().split(":"))
                assert i == seen[k] and _bytes(got.frames[0]) == bytes([k, i % 256])
                seen[k] += 1
        assert seen == {k: n for k in range(len(links))}
    finally:
        for link in others:
            link.close()


async def test_empty_header_only_and_empty_buffers(pair):
    await pair.link.send(b"none", [])
    await pair.link.send(b"empties", [b"", bytearray(), np.empty(0, np.float32)])
    got = await _recv(pair)
    assert got.header == b"none" and list(got.frames) == []
    got = await _recv(pair)
    assert got.header == b"empties" and [memoryview(f).nbytes for f in got.frames] == [0, 0, 0]


async def test_large_buffer(pair):
    big = _payload(40 << 20, 1)
    await pair.link.send(b"big", [big])
    got = await _recv(pair, 30)
    assert np.array_equal(np.frombuffer(got.frames[0], np.uint8), big)


async def test_many_buffers(pair):
    bufs = [_payload(i * 13 % 2000, i) for i in range(1000)]
    await pair.link.send(b"many", bufs)
    got = await _recv(pair)
    assert len(got.frames) == len(bufs)
    for frame, buf in zip(got.frames, bufs):
        assert _bytes(frame) == buf.tobytes()


async def test_mixed_sizes_in_one_frame_set(pair):
    sizes = [0, 1, 63, 64, 65, 4096, 64 << 10, (1 << 20) + 3, 300 << 10, 7]
    bufs = [_payload(n, n) for n in sizes]
    await pair.link.send(b"mixed", bufs)
    got = await _recv(pair)
    assert [memoryview(f).nbytes for f in got.frames] == sizes
    for frame, buf in zip(got.frames, bufs):
        assert _bytes(frame) == buf.tobytes()


async def test_buffers_may_be_reused_once_send_returns(pair):
    buf = _payload(8 << 20, 2)
    original = buf.copy()
    await pair.link.send(b"reuse", [buf])
    buf[:] = 0                       # the sender reuses its buffer at once
    got = await _recv(pair, 20)
    assert np.array_equal(np.frombuffer(got.frames[0], np.uint8), original)


async def test_received_frames_stay_valid_while_referenced(pair):
    """No use-after-free: frames kept by the receiver are unchanged by later traffic."""
    kept = []
    for i in range(4):
        await pair.link.send(b"k", [np.full(1 << 20, i, np.uint8)])
        kept.append(await _recv(pair))
    for i in range(40):              # enough to recycle any pooled memory many times
        await pair.link.send(b"x", [np.full(1 << 20, 100 + i % 50, np.uint8)])
        got = await _recv(pair)
        assert _bytes(got.frames[0])[:1] == bytes([100 + i % 50])
        del got                      # freed at once (refcount): pooled memory is recycled
    for i, frame_set in enumerate(kept):
        assert np.all(np.frombuffer(frame_set.frames[0], np.uint8) == i)


async def test_decoded_objects_are_writable_views(pair):
    codec = Codec()
    obj = {"t": torch.arange(100_000, dtype=torch.float32), "a": np.arange(70_000), "s": "x"}
    header, buffers = codec.encode(obj)
    await pair.link.send(header, buffers)
    got = await _recv(pair)
    back = codec.decode(got.header, got.frames)
    assert torch.equal(back["t"], obj["t"]) and np.array_equal(back["a"], obj["a"])
    back["t"][0] = -1.0              # writable
    back["a"][-1] = -1
    assert back["t"][0] == -1.0 and back["a"][-1] == -1


async def test_links_are_independent_and_identified(pair):
    other = await pair.connect(b"other|2")
    try:
        for i in range(50):
            await pair.link.send(b"a", [np.full(10, i, np.uint8)])
            await other.send(b"b", [np.full(10, i, np.uint8)])
        seen = {b"a": [], b"b": []}
        for _ in range(100):
            got = await _recv(pair)
            seen[got.header].append(_bytes(got.frames[0])[0])
            assert got.peer == (b"sender|1" if got.header == b"a" else b"other|2")
        assert seen[b"a"] == list(range(50)) and seen[b"b"] == list(range(50))
    finally:
        other.close()


async def test_send_after_close_raises_closed_error(pair):
    pair.link.close()
    pair.link.close()                # idempotent
    with pytest.raises(rlinf.ClosedError):
        await pair.link.send(b"late", [b"x"])


async def test_listener_close_fails_pending_and_later_receives(pair):
    pending = asyncio.ensure_future(pair.listener.recv())
    await asyncio.sleep(0)           # let it park
    pair.listener.close()
    pair.listener.close()            # idempotent
    with pytest.raises(rlinf.ClosedError):
        async with asyncio.timeout(5):
            await pending
    with pytest.raises(rlinf.ClosedError):
        await pair.listener.recv()


async def test_cancelled_receive_loses_nothing(pair):
    """Receives cancelled while frame sets arrive: each one is received exactly once."""
    got = []
    for i in range(40):
        waiter = asyncio.ensure_future(pair.listener.recv())
        if i % 2:
            await asyncio.sleep(0)       # parked on odd rounds, not yet started on even ones
        await pair.link.send(f"{i}".encode(), [b"y" * 100])
        waiter.cancel()
        try:
            got.append((await waiter).header)
        except asyncio.CancelledError:
            pass
    async with asyncio.timeout(10):
        while len(got) < 40:
            got.append((await pair.listener.recv()).header)
    assert got == [f"{i}".encode() for i in range(40)]


async def test_cancelled_send_never_delivers_a_partial_frame_set(pair):
    big = _payload(16 << 20, 3)
    for _ in range(3):
        task = asyncio.ensure_future(pair.link.send(b"big", [big, big[:1000]]))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    await pair.link.send(b"marker", [b"m"])
    async with asyncio.timeout(30):
        while True:
            got = await pair.listener.recv()
            if got.header == b"marker":
                break
            assert got.header == b"big" and len(got.frames) == 2
            assert np.array_equal(np.frombuffer(got.frames[0], np.uint8), big)
    await pair.link.send(b"after", [b"z"])       # the link still works
    assert (await _recv(pair)).header == b"after"


async def test_bad_endpoint_maps_to_rlinf_error(pair):
    with pytest.raises(rlinf.RlinfError) as info:
        await pair.sender.connect("not-a-scheme://nowhere", identity=b"x|1")
    assert isinstance(info.value, (rlinf.PeerLostError, rlinf.TransportUnavailableError))
