"""The link contract as the session layer drives it, over every production link.

:class:`rlinf.core._outbox.Outbox` never calls ``Link.send``: it hands frame sets over
with ``try_send`` until the link raises ``WouldBlock``, then waits with
``wait_writable``; it tracks large frame sets and reuses their buffers only after
``released``; it closes with ``close_gracefully`` and expects what it handed over to
arrive. These tests drive each link (``pair`` in ``conftest.py``) the same way, and
check that whatever goes wrong surfaces as an rlinf error, never a native one.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest

import rlinf
from rlinf.transports.base import Link

pytestmark = pytest.mark.timeout(60)

#: Bound on frame sets handed over before a link must have pushed back (ZeroMQ: its
#: high-water marks and socket buffers take ~16k small frame sets).
_PUSH_BACK_WITHIN = 200_000


def _bytes(frame) -> bytes:
    return bytes(memoryview(frame).cast("B"))


async def _hand_over(link: Link, frames: list, *, track: bool = False):
    """``try_send`` until the link takes ``frames``, waiting for room in between (what
    the outbox does); the tracker."""
    while True:
        try:
            return link.try_send(frames, track=track)
        except rlinf.WouldBlock:
            await link.wait_writable()


def _fill(link: Link, big: np.ndarray) -> tuple[int, object]:
    """Without yielding to the loop (so the receiver reads nothing), hand over a tracked
    frame set of ``big`` and then small frame sets ``"0"``, ``"1"``, ... until the link
    pushes back: ``(small frame sets taken, tracker of big)``."""
    tracker = link.try_send([b"big", big], track=True)
    for i in range(_PUSH_BACK_WITHIN):
        try:
            link.try_send([str(i).encode(), bytes([i % 256]) * 1024])
        except rlinf.WouldBlock:
            return i, tracker
    pytest.fail(f"{link!r} took {_PUSH_BACK_WITHIN} frame sets without pushing back")


async def _expect(pair, headers: list[bytes], timeout: float = 20) -> list:
    got = []
    async with asyncio.timeout(timeout):
        for _ in headers:
            got.append(await pair.listener.recv())
    assert [g.header for g in got] == headers
    return got


async def test_every_production_link_implements_the_contract(pair):
    assert isinstance(pair.link, Link)
    for name in ("try_send", "close", "close_gracefully"):
        assert not inspect.iscoroutinefunction(getattr(pair.link, name)), name
    for name in ("wait_writable", "released", "send"):
        assert inspect.iscoroutinefunction(getattr(pair.link, name)), name


async def test_try_send_until_would_block_then_wait_writable_loses_nothing(pair):
    """The outbox's loop: hand over until WouldBlock, wait, go on. Every frame set
    arrives whole and in order, the one that met WouldBlock was not half sent, and the
    tracked buffer is intact once released."""
    big = np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8)
    original = big.copy()
    taken, tracker = _fill(pair.link, big)
    async with asyncio.timeout(20):
        await pair.link.wait_writable()
        await _hand_over(pair.link, [b"after", b"a" * 100])
        await pair.link.released(tracker)
    big[:] = 0                                   # released: the buffer is ours again
    got = await _expect(pair, [b"big", *(str(i).encode() for i in range(taken)), b"after"])
    assert np.array_equal(np.frombuffer(got[0].frames[0], np.uint8), original)
    for i, frame_set in enumerate(got[1:-1]):
        assert len(frame_set.frames) == 1 and _bytes(frame_set.frames[0]) == bytes([i % 256]) * 1024
    assert _bytes(got[-1].frames[0]) == b"a" * 100


@pytest.mark.parametrize("size", [100, 256 << 10, 8 << 20], ids=["small", "256K", "8M"])
async def test_buffers_are_reusable_when_the_contract_says(pair, size):
    """Untracked: the buffers are the caller's again when ``try_send`` returns. Tracked:
    when ``released`` returns for its tracker (at once for None)."""
    rng = np.random.default_rng(size)
    untracked, tracked = rng.integers(0, 256, size, np.uint8), rng.integers(0, 256, size, np.uint8)
    expected = [untracked.copy(), tracked.copy()]
    async with asyncio.timeout(20):
        assert await _hand_over(pair.link, [b"untracked", untracked]) is None
        untracked[:] = 0
        tracker = await _hand_over(pair.link, [b"tracked", tracked], track=True)
        await pair.link.released(tracker)
        tracked[:] = 0
    got = await _expect(pair, [b"untracked", b"tracked"])
    for frame_set, want in zip(got, expected):
        assert np.array_equal(np.frombuffer(frame_set.frames[0], np.uint8), want)


async def test_cancelled_released_does_not_cancel_the_send(pair):
    big = np.full(4 << 20, 7, np.uint8)
    async with asyncio.timeout(20):
        tracker = await _hand_over(pair.link, [b"big", big], track=True)
        waiter = asyncio.ensure_future(pair.link.released(tracker))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await pair.link.released(tracker)        # still completes
    got = await _expect(pair, [b"big"])
    assert np.all(np.frombuffer(got[0].frames[0], np.uint8) == 7)


async def test_close_gracefully_delivers_what_was_handed_over(pair):
    big = np.random.default_rng(2).integers(0, 256, 2 << 20, dtype=np.uint8)
    original = big.copy()
    taken, _ = _fill(pair.link, big)
    flushed = pair.link.close_gracefully(10_000)
    with pytest.raises(rlinf.ClosedError):       # refused at once, even while it drains
        pair.link.try_send([b"late", b"x"])
    if flushed is not None:                      # this loop writes what is left: let it
        async with asyncio.timeout(20):
            await flushed
    got = await _expect(pair, [b"big", *(str(i).encode() for i in range(taken))])
    assert np.array_equal(np.frombuffer(got[0].frames[0], np.uint8), original)
    pair.link.close_gracefully(0)                # idempotent
    pair.link.close()


async def test_close_fails_a_waiter_and_every_later_call(pair):
    """A task waiting for room when the link closes gets ClosedError (unless room came
    first); then every call raises the error the link was closed with."""
    taken, tracker = _fill(pair.link, np.zeros(2 << 20, np.uint8))
    waiter = asyncio.ensure_future(pair.link.wait_writable())
    await asyncio.sleep(0)                       # parked (or already answered)
    pair.link.close()
    async with asyncio.timeout(10):
        outcome = (await asyncio.gather(waiter, return_exceptions=True))[0]
        assert outcome is None or isinstance(outcome, rlinf.ClosedError), repr(outcome)
        outcome = (await asyncio.gather(pair.link.released(tracker), return_exceptions=True))[0]   # never hangs
        assert outcome is None or isinstance(outcome, (rlinf.ClosedError, rlinf.PeerLostError)), repr(outcome)
        with pytest.raises(rlinf.ClosedError):
            await pair.link.wait_writable()
        with pytest.raises(rlinf.ClosedError):
            await pair.link.send(b"late", [b"x"])
    with pytest.raises(rlinf.ClosedError):
        pair.link.try_send([b"late", b"x"])


async def test_closed_with_an_error_raises_that_error(pair):
    """The outbox closes a link with the PeerLostError that ended the peer: later calls
    raise it (not a ClosedError that would hide why)."""
    lost = rlinf.PeerLostError("peer:0 was lost", peer="peer:0")
    pair.link.close(lost)
    with pytest.raises(rlinf.PeerLostError) as info:
        pair.link.try_send([b"late", b"x"])
    assert info.value is lost
    with pytest.raises(rlinf.PeerLostError):
        async with asyncio.timeout(10):
            await pair.link.wait_writable()


async def test_a_vanished_listener_surfaces_only_as_rlinf_errors(pair):
    """The receiving side goes away mid-stream. Whatever the link then does (keep
    queueing, push back, or break), a call that fails raises an rlinf error."""
    pair.listener.close()
    payload = np.ones(1 << 20, np.uint8)
    try:
        async with asyncio.timeout(5):
            for i in range(64):
                await pair.link.send(str(i).encode(), [payload])
    except TimeoutError:
        pass                                     # still queueing (ZeroMQ reconnects): no error to see
    except rlinf.RlinfError as exc:
        assert isinstance(exc, (rlinf.PeerLostError, rlinf.ClosedError)), repr(exc)
    except Exception as exc:                     # a native error escaped the transport
        pytest.fail(f"{type(exc).__name__} escaped {pair.link!r}: {exc}")
