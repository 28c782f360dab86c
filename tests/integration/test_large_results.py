"""Results, call arguments and replies larger than the driver<->child pipe's socket
buffer arrive whole, over both launchers (the pipe is written part by part then).

Worker targets are defined in this module (module level: the spawn context imports it).
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

import rlinf

pytestmark = pytest.mark.multiproc

#: Far beyond a socketpair's buffer (about 200 KiB on Linux).
BIG = 5 * 1024 * 1024


def _pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ at every offset of a 256-byte cycle, so a lost or
    reordered chunk changes the digest."""
    return bytes((i + seed) % 251 for i in range(256)) * (n // 256) + b"\x01" * (n % 256)


async def returns_big(comm, n: int) -> bytes:
    return _pattern(n, 7)


class Echo(rlinf.Worker):
    def digest_and_reply(self, data: bytes, n: int) -> tuple[str, bytes]:
        """The digest of what arrived and a reply of ``n`` bytes."""
        return hashlib.sha256(data).hexdigest(), _pattern(n, 3)


async def test_a_spawned_function_returns_a_large_result(launcher, cluster):
    async with asyncio.timeout(120):
        group = await cluster.spawn(returns_big, "big", 2, args=(BIG,), launcher=launcher)
        results = await group.join(60)
    assert [len(r) for r in results] == [BIG, BIG]
    assert all(r == _pattern(BIG, 7) for r in results)


async def test_a_worker_takes_a_large_argument_and_returns_a_large_reply(launcher, cluster):
    data = _pattern(BIG, 11)
    async with asyncio.timeout(120):
        group = await cluster.spawn(Echo, "echo", 2, launcher=launcher)
        replies = await group.call("digest_and_reply", data, BIG, timeout=60)
        # twice in flight at once on the same pipes: order and framing hold
        again = await asyncio.gather(group.call("digest_and_reply", data, 10, timeout=60),
                                     group.call("digest_and_reply", b"small", BIG, timeout=60))
        assert await group.join(60) == [None, None]
    expected = hashlib.sha256(data).hexdigest()
    assert [d for d, _ in replies] == [expected, expected]
    assert all(reply == _pattern(BIG, 3) for _, reply in replies)
    assert [d for d, _ in again[0]] == [expected, expected] and [len(r) for _, r in again[0]] == [10, 10]
    assert [d for d, _ in again[1]] == [hashlib.sha256(b"small").hexdigest()] * 2
    assert all(reply == _pattern(BIG, 3) for _, reply in again[1])
