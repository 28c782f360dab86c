"""Point-to-point messaging between real processes over real sockets (loopback only)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

import rlinf
from rlinf.core import wire
from rlinf.core._outbox import IN_FLIGHT, OutMessage, Outbox
from rlinf.core.wire import bulk_frames
from rlinf.core.stats import Counters

from ..recording_link import RecordingLink
from .same import assert_same
from . import workers

pytestmark = pytest.mark.multiproc


@dataclasses.dataclass
class Batch:
    obs: torch.Tensor
    meta: dict


def _nested():
    return {
        "obs": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),      # non-contiguous
        "bf": torch.ones(5, dtype=torch.bfloat16),
        "arr": np.arange(10, dtype=">i4"),
        "batch": Batch(torch.zeros(2, 2), {"ep": [1, 2, (3, "x")], 4: None}),
        "big": np.random.default_rng(0).random(300_000),                       # ~2.3 MiB: large path
        "s": "text", "b": b"\x00\x01", "f": 1.5, "i": 2**70,
    }


async def test_nested_round_trip(cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.echo, "echo", 1, args=("driver:0", 2))
        obj = _nested()
        for _ in range(2):
            await driver.send(obj, "echo:0")
            back = await driver.recv("echo:0")
            assert_same(obj, back)
        back["obs"] += 1          # received arrays are writable
        back["big"][0] = -1.0
        assert await group.join() == [2]


async def test_users_get_the_public_communicator(cluster, driver):
    """The core class knows no groups or channels; what users are given does."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.public_communicator, "pub", 1)
        assert await group.join() == [True]
    assert isinstance(driver, rlinf.Communicator)
    assert isinstance(rlinf.connect("a:0", manager=cluster.manager_address, token="t"), rlinf.Communicator)


async def test_ordered_messages_per_source_and_tag(cluster, driver):
    n = 10_000
    async with asyncio.timeout(90):
        group = await cluster.spawn(workers.send_range, "src", 1, args=("driver:0", n, 3))
        got = [await driver.recv("src:0", tag=3) for _ in range(n)]
        assert got == list(range(n))
        await driver.send("ack", "src:0", tag=999)
        assert await group.join() == ["ack"]


async def test_a_clean_exit_delivers_everything_then_ends_receives_at_once(cluster, driver, caplog):
    """A peer that sends and returns: every message arrives, in order, and the next
    receive from it fails with 'left' as soon as its in-order goodbye arrives, not after
    the 2 s the manager's 'left' event is given to be overtaken by it."""
    n = 200
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.send_range_and_leave, "leaver", 1, args=("driver:0", n, 4))
        got = [await driver.recv("leaver:0", tag=4) for _ in range(n)]
        assert got == list(range(n))
        t0 = time.perf_counter()
        with pytest.raises(rlinf.PeerLostError, match="left"):
            await driver.recv("leaver:0", tag=4, timeout=30)
        assert time.perf_counter() - t0 < 1.5, "the goodbye on the data link was not acted on"
        assert await group.join() == [n]
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, f"a clean exit logged errors at its receiver: {[r.getMessage() for r in errors]}"


async def test_many_senders_one_receiver_and_recv_any(cluster, driver):
    n, senders = 300, 4
    async with asyncio.timeout(90):
        group = await cluster.spawn(workers.send_range, "s", senders, args=("driver:0", n, 5))
        seen: dict[str, list[int]] = {a: [] for a in group.addresses}
        for _ in range(n * senders):
            value, src = await driver.recv_any(tag=5)
            seen[src].append(value)
        for src, values in seen.items():
            assert values == list(range(n)), src
        for address in group.addresses:
            await driver.send("ack", address, tag=999)
        assert await group.join() == ["ack"] * senders


async def test_tags_are_separate_queues(driver):
    async with asyncio.timeout(10):
        await driver.send("a", "driver:0", tag=1)
        await driver.send("b", "driver:0", tag=2)
        assert await driver.recv("driver:0", tag=2) == "b"
        assert await driver.recv("driver:0", tag=1) == "a"


async def test_work_semantics(cluster, driver):
    async with asyncio.timeout(30):
        group = await cluster.spawn(workers.echo, "w", 1, args=("driver:0", 3))
        recv_work = driver.async_recv("w:0")
        assert not recv_work.done()
        send_works = [driver.async_send(i, "w:0") for i in range(3)]
        for w in send_works:
            assert await w is None
        assert await recv_work == 0
        assert recv_work.done() and recv_work.result() == 0 and recv_work.exception() is None
        assert [await driver.recv("w:0"), await driver.recv("w:0")] == [1, 2]
        await group.join()
        # wait()/result() from another thread while the loop runs
        w = driver.async_recv("driver:0", tag=4)
        fut = asyncio.get_running_loop().run_in_executor(None, w.result, 10.0)
        await driver.send("threaded", "driver:0", tag=4)
        assert await fut == "threaded"
        pending = driver.async_recv("driver:0", tag=5)
        with pytest.raises(RuntimeError):
            pending.wait()             # on the loop thread: refuse to block it
        for method in (pending.result, pending.exception):   # exception() raised RuntimeError
            with pytest.raises(asyncio.InvalidStateError):
                method()
        assert pending.cancel()
        for tag in (2 ** 64, -2 ** 63 - 1):   # out of msgpack's range: wedged the link to the peer
            with pytest.raises(ValueError, match="tag must lie in"):
                await driver.send("never", "w:0", tag=tag)
            with pytest.raises(ValueError, match="tag must lie in"):
                await driver.recv("w:0", tag=tag)
            with pytest.raises(ValueError, match="tag must lie in"):
                driver.async_send("never", "w:0", tag=tag)
        async with cluster.connect("tags:0") as other:     # the extremes do travel
            await driver.send("top", "tags:0", tag=2 ** 64 - 1)
            await driver.send("bottom", "tags:0", tag=-2 ** 63)
            assert await other.recv("driver:0", tag=-2 ** 63) == "bottom"
            assert await other.recv("driver:0", tag=2 ** 64 - 1) == "top"


async def test_bad_timeouts_and_addresses_are_refused_at_the_call(driver):
    """A NaN timeout made a receive hang (a NaN deadline never comes); a str one raised a
    raw TypeError deep inside; 'a:01' passed for 'a:1' and then waited for ever."""
    async with asyncio.timeout(20):
        await driver.send("queued", "driver:0", tag=3)
        for bad, error in ((float("nan"), ValueError), (-1, ValueError), ("0.1", TypeError), (True, TypeError)):
            with pytest.raises(error, match="timeout"):
                await driver.recv("driver:0", tag=3, timeout=bad)     # even with a message queued
            with pytest.raises(error, match="timeout"):
                await driver.recv_any(tag=3, timeout=bad)
            with pytest.raises(error, match="timeout"):
                await driver.send("x", "driver:0", timeout=bad)
        assert await driver.recv("driver:0", tag=3, timeout=np.float32(5)) == "queued"
        for alias in ("driver:00", "driver:01", "driver:\u0661", "driver:\u00b2"):
            with pytest.raises(ValueError, match="group:rank"):
                await driver.send("x", alias)


@contextlib.contextmanager
def _comm_on_a_loop_thread():
    """``(comm, loop, thread)``: a communicator (with its manager) on an event loop run by
    another thread, as a program with a background loop has it; closed afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        manager = await rlinf.Manager("tcp://127.0.0.1:0").start()
        comm = await rlinf.connect("t:0", manager=manager.address, token=manager.token).start()
        return manager, comm

    manager, comm = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield comm, loop, thread
    finally:
        async def stop():
            await comm.aclose()
            await manager.close()

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
        else:
            loop.run_until_complete(stop())
        thread.join(10)
        loop.close()


def test_an_interrupted_blocking_recv_does_not_swallow_the_next_message():
    """KeyboardInterrupt in a thread blocked in blocking_recv left the receive running on
    the loop: it took the next message, and the next blocking_recv timed out."""
    with _comm_on_a_loop_thread() as (comm, _loop, _thread):
        interrupt = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))     # Ctrl-C
        interrupt.start()
        try:
            comm.blocking_recv("t:0", tag=1, timeout=20)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("blocking_recv was not interrupted")
        finally:
            interrupt.join()
        comm.blocking_send("precious", "t:0", tag=1, timeout=10)
        assert comm.blocking_recv("t:0", tag=1, timeout=10) == "precious"


def test_blocking_calls_keep_their_timeout_and_fail_once_the_loop_is_gone():
    """A loop busy for seconds made blocking_recv(timeout=0.3) wait until it was free; a
    loop that ended without aclose gave a raw RuntimeError (or 'would deadlock', when
    the caller's thread got the old loop thread's id)."""
    with _comm_on_a_loop_thread() as (comm, loop, thread):
        loop.call_soon_threadsafe(time.sleep, 3)            # the loop runs 3 s of blocking work
        started = time.monotonic()
        with pytest.raises(rlinf.CommTimeoutError, match="busy"):
            comm.blocking_recv("t:0", tag=1, timeout=0.3)
        assert time.monotonic() - started < 2.5
        loop.call_soon_threadsafe(loop.stop)                # ends without aclose
        thread.join(10)
        for call in (lambda: comm.blocking_recv("t:0", timeout=1), lambda: comm.blocking_send(1, "t:0", timeout=1)):
            with pytest.raises(rlinf.ClosedError, match="not running"):
                call()


def test_polling_a_work_from_a_thread_takes_no_memory_per_poll():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        future = asyncio.run_coroutine_threadsafe(_pending_future(), loop).result(10)
        work = rlinf.Work(future, "never")
        for _ in range(1000):
            assert not work.wait(0)
        callbacks = asyncio.run_coroutine_threadsafe(_callbacks(future), loop).result(10)
        assert callbacks == 1                        # was one callback (and Event) per poll
        loop.call_soon_threadsafe(future.set_result, 7)
        assert work.wait(10) and work.result() == 7
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _pending_future():
    return asyncio.get_running_loop().create_future()


async def _callbacks(future) -> int:
    await asyncio.sleep(0)          # the polls' call_soon_threadsafe requests ran
    return len(future._callbacks)


async def test_async_recv_takes_its_place_in_line_when_called(driver):
    """The order of receives is fixed when async_recv is called: a recv made after it
    took the earlier message (the async_recv's task only started on the next turn)."""
    async with asyncio.timeout(20):
        for text in ("first", "second"):
            await driver.send(text, "driver:0", tag=12)
        work = driver.async_recv("driver:0", tag=12)           # a message is queued: taken now
        assert await driver.recv("driver:0", tag=12) == "second"
        assert await work == "first"
        work = driver.async_recv("driver:0", tag=13)           # nothing queued: first in line
        later = asyncio.ensure_future(driver.recv("driver:0", tag=13))
        for text in ("third", "fourth"):
            await driver.send(text, "driver:0", tag=13)
        assert (await work, await later) == ("third", "fourth")
        await driver.send("kept", "driver:0", tag=14)          # cancelled before its task ran:
        driver.async_recv("driver:0", tag=14).cancel()          # the message it took goes back,
        driver.async_recv("driver:0", tag=15).cancel()          # and its place in line is given up
        await driver.send("also kept", "driver:0", tag=15)
        assert await driver.recv("driver:0", tag=14, timeout=5) == "kept"
        assert await driver.recv("driver:0", tag=15, timeout=5) == "also kept"


async def test_cancelled_recv_loses_nothing(driver):
    """Cancel receives racing deliveries: every message still arrives exactly once."""
    got = []
    async with asyncio.timeout(20):
        for i in range(200):
            work = driver.async_recv("driver:0", tag=11)
            if i % 2:
                await asyncio.sleep(0)     # let the recv park first on odd rounds
            driver.async_send(i, "driver:0", tag=11)
            work.cancel()
            for _ in range(3):
                await asyncio.sleep(0)
            assert work.done()
            if not work.cancelled():
                got.append(work.result())
        while True:
            try:
                got.append(await driver.recv("driver:0", tag=11, timeout=0.2))
            except rlinf.CommTimeoutError:
                break
    assert sorted(got) == list(range(200))
    assert got == sorted(got)              # and in order


async def test_recv_timeout(driver):
    async with asyncio.timeout(10):
        t0 = time.monotonic()
        with pytest.raises(rlinf.CommTimeoutError) as info:
            await driver.recv("nobody:0", timeout=0.3)
        assert isinstance(info.value, TimeoutError)
        assert 0.25 < time.monotonic() - t0 < 3


@pytest.mark.parametrize(("env", "expected"), [({}, "StreamLink"),
                                               ({"RLINF_DISABLE_TRANSPORTS": "stream"}, "ZmqLink")],
                         ids=["stream", "disabled"])
async def test_same_node_messages_take_the_stream_unless_disabled(cluster, driver, env, expected):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.link_kind, "sender", 1, args=("driver:0",), env=env)
        assert await driver.recv("sender:0") == "hi"
        assert await group.join() == [expected]


async def test_late_joiner_is_reachable(cluster, driver):
    async with asyncio.timeout(60):
        send = driver.async_send({"hello": 1}, "late:0")     # not registered yet: waits
        assert not send.done()
        group = await cluster.spawn(workers.late_joiner, "late", 1)
        await send
        assert await driver.recv("late:0") == ("late", {"hello": 1})
        assert await group.join() == ["ok"]


async def test_wrong_token_is_rejected(cluster):
    async with asyncio.timeout(30):
        intruder = rlinf.connect("intruder:0", manager=cluster.manager_address, token="not-the-token",
                                 connect_timeout=10)
        with pytest.raises(rlinf.AuthenticationError):
            await intruder.start()
        assert "intruder:0" not in {w.address for w in cluster.manager.roster()}


async def test_a_close_while_starting_tears_down_once_and_it_does_not_start_again():
    """aclose() while start() waits for a manager that does not answer: start raises
    ClosedError, the subsystems' closers ran once, and a later start() raises ClosedError
    instead of starting parts again."""
    import socket

    from .wait import until

    with socket.socket() as silent:          # a port nobody answers on (bound, not listening)
        silent.bind(("127.0.0.1", 0))
        async with asyncio.timeout(30):
            comm = rlinf.Communicator("early:0", manager=f"tcp://127.0.0.1:{silent.getsockname()[1]}",
                                      token="t" * 32, connect_timeout=20)
            ran = []
            comm.add_closer(lambda: ran.append("closer"))
            starting = asyncio.ensure_future(comm.start())
            await until(lambda: comm._lifecycle.control is not None, what="start waiting to register")
            await comm.aclose()
            with pytest.raises(rlinf.ClosedError):
                await starting
            assert ran == ["closer"] and comm.closed
            with pytest.raises(rlinf.ClosedError):
                await comm.start()
            assert ran == ["closer"]


async def test_worker_failure_carries_traceback(cluster):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.raise_error, "bad", 1, args=("kaboom",))
        with pytest.raises(rlinf.WorkerFailedError) as info:
            await group.join()
        assert "kaboom" in str(info.value) and info.value.address == "bad:0"


async def test_worker_class_calls(cluster):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.Counter, "ctr", 3, kwargs={"start": 10})
        assert await group.call("add", 1) == [11, 12, 13]
        assert await group.call("where", ranks=[2]) == [("ctr:2", 2, 3)]
        with pytest.raises(rlinf.WorkerFailedError, match="boom from a method"):
            await group.call("fail")
        assert await group.join() == [None, None, None]


async def test_return_value_with_tensor_reaches_driver(cluster):
    async with asyncio.timeout(60):
        group = await cluster.spawn(workers.return_tensor, "rt", 2)
        results = await group.join()
        assert [r["ok"] for r in results] == [True, True]
        assert all(torch.equal(r["t"], torch.arange(5)) for r in results)


# -- sending policy of one peer's queue (an injected recording link, no sockets) ------------


def _small(i: int) -> OutMessage:
    return OutMessage([wire.USER, 7, b"codec-header", None], [bytes([i, i])], 2, None, False)


def _payloads(frame_set: list[bytes]) -> tuple[list, bytes]:
    src, incarnation, entries, packed = wire.unpack_header(frame_set[0], frame_set[1:])
    assert (src, incarnation, packed) == ("me:0", "inc0", True)
    return [(e.kind, e.tag, e.codec_header, e.frame_counts) for e in entries], b"".join(frame_set[1:])


class _Clock:
    """A fake clock for the outbox's in-flight window: time moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def idle(self) -> None:
        """Let the last send to the link stop counting as in flight."""
        self.now += 2 * IN_FLIGHT


async def test_lone_message_is_sent_at_once_and_a_burst_is_coalesced():
    loop = asyncio.get_running_loop()
    link = RecordingLink()
    clock = _Clock()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"), clock=clock)
    box.attach(link, None)
    clock.idle()
    box.put(_small(0), loop)
    assert len(link.sent) == 1 and not box.queue          # no loop turn needed
    for i in range(1, 100):                               # right behind it: queued
        box.put(_small(i), loop)
    assert len(link.sent) == 1 and len(box.queue) == 99
    await asyncio.sleep(0)     # one loop turn: the flush scheduled for it has run
    assert not box.queue and len(link.sent) == 2
    entries, blob = _payloads(link.sent[0])
    assert entries == [(wire.USER, 7, b"codec-header", [2])] and blob == b"\x00\x00"
    entries, blob = _payloads(link.sent[1])                # one frame set, in call order
    assert entries == [(wire.USER, 7, b"codec-header", [2])] * 99
    assert blob == b"".join(bytes([i, i]) for i in range(1, 100))
    clock.idle()
    box.put(_small(100), loop)                             # idle again: at once
    assert len(link.sent) == 3 and not box.queue


async def test_message_behind_a_pushed_back_link_waits_in_order():
    loop = asyncio.get_running_loop()

    class _FullLink(RecordingLink):
        full = True
        writable: asyncio.Future

        def try_send(self, frames: list, *, track: bool = False) -> None:
            if self.full:
                raise rlinf.WouldBlock()
            super().try_send(frames, track=track)

        async def wait_writable(self) -> None:
            await self.writable

    link = _FullLink()
    link.writable = loop.create_future()
    clock = _Clock()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"), clock=clock)
    box.attach(link, None)
    clock.idle()
    box.put(_small(1), loop)             # the link pushes back: kept, nothing dropped
    clock.idle()
    box.put(_small(2), loop)
    assert [len(m.frames) for m in box.queue] == [1, 1] and not box.ready
    link.full = False
    link.writable.set_result(None)
    async with asyncio.timeout(10):
        while box.queue:
            await asyncio.sleep(0)       # loop turns until the writer task flushed
    assert [_payloads(s)[1] for s in link.sent] == [b"\x01\x01\x02\x02"]


def test_header_packer_matches_pack_header():
    packer = wire.HeaderPacker("rollout:3", "0123456789abcdef")
    entries = [[wire.USER, 5, b"h", [3, 4]], [wire.SYSTEM, "shm", b"", []]]
    for packed in (True, False):
        assert packer.pack(entries, packed) == wire.pack_header("rollout:3", "0123456789abcdef", entries, packed)
        assert packer.pack([], packed) == wire.pack_header("rollout:3", "0123456789abcdef", [], packed)


async def test_a_bulk_stream_that_cannot_open_hands_the_message_to_zeromq():
    """The bulk connector fails: the message goes through ZeroMQ, chunked, and the outbox
    stops trying the bulk stream. (A small message with another tag went ahead of it
    while the stream was dialled.)"""
    loop = asyncio.get_running_loop()
    link = RecordingLink()
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"), clock=_Clock())
    tried = []

    async def unreachable():
        tried.append(1)
        raise rlinf.PeerLostError("connection refused")

    box.bulk = unreachable
    box.attach(link, None)
    big = np.arange(20 << 20, dtype=np.uint8)                     # two ZeroMQ chunks
    frames, counts, n = bulk_frames([big])
    future = loop.create_future()
    box.put(OutMessage([wire.USER, 0, b"h", counts], frames, n, future, True, transport="bulk"), loop)
    box.put(_small(1), loop)
    async with asyncio.timeout(10):
        while len(link.sent) < 2:       # the bulk attempt fails in a task of the outbox
            await asyncio.sleep(0)
    assert not future.done()            # a large send completes once acknowledged
    box.acked(box.log.epoch, 2)
    async with asyncio.timeout(10):
        await future
    assert tried == [1] and box.bulk is None
    assert _payloads(link.sent[0])[1] == b"\x01\x01"
    header, *chunks = link.sent[1]
    assert wire.unpack_header(header, chunks)[2][0].frame_counts == [2]
    assert b"".join(chunks) == big.tobytes()


async def test_messages_queued_behind_a_broken_bulk_stream_go_through_zeromq(cluster, driver, monkeypatch):
    """Once a bulk send broke, the large messages already queued for the bulk stream never
    completed (the outbox had dropped its way to dial one): they now go through ZeroMQ.
    The message whose bulk send broke is sent again through ZeroMQ (it used to fail
    with PeerLostError though its peer was alive): both arrive, once each, in order."""
    from rlinf.transports import tcp_bulk

    real, calls = tcp_bulk.BulkLink.send, []

    async def breaks_once(self, header, frames):
        calls.append(len(frames))
        if len(calls) == 1:
            raise rlinf.PeerLostError("bulk stream broke (test)")
        return await real(self, header, frames)

    monkeypatch.setattr(tcp_bulk.BulkLink, "send", breaks_once)
    async with asyncio.timeout(90):
        group = await cluster.spawn(workers.echo, "far", 1, args=("driver:0", 2), env={"RLINF_NODE_ID": "far-node"})
        first = driver.async_send(np.zeros(2 << 20, np.uint8), "far:0")
        second = driver.async_send(np.ones(2 << 20, np.uint8), "far:0")
        await first
        await second
        back = [await driver.recv("far:0", timeout=30) for _ in range(2)]
        assert [b.shape for b in back] == [(2 << 20,)] * 2
        assert (back[0] == 0).all() and (back[1] == 1).all() and len(calls) == 1   # the rest: ZeroMQ
        assert await group.join() == [2]


@pytest.mark.parametrize("disabled", ["", "shm,stream"], ids=["default", "zeromq"])
async def test_large_sends_pending_when_their_peer_dies_fail(cluster, monkeypatch, disabled):
    """The peer stops reading (SIGSTOP), then is killed: the sends still pending must
    raise PeerLostError. They returned None (success) and the data was silently lost:
    ZeroMQ released the dropped frames, and a stream dial that failed because the peer
    died fell back to ZeroMQ, which took the messages."""
    monkeypatch.setenv("RLINF_DISABLE_TRANSPORTS", disabled)
    async with asyncio.timeout(60), cluster.connect("s:0") as sender:
        victim = await cluster.spawn(workers.idle, "v", 1)
        os.kill(victim.pids[0], signal.SIGSTOP)
        payload = np.ones(64 << 20, np.uint8)
        sends = [asyncio.ensure_future(sender.send(payload, "v:0", tag=i)) for i in range(6)]
        done, _ = await asyncio.wait(sends, timeout=0.5)
        assert not done                                    # stuck behind the stopped peer
        os.kill(victim.pids[0], signal.SIGKILL)
        for send in sends:
            with pytest.raises(rlinf.PeerLostError):
                await send


async def test_a_second_aclose_returns_once_the_first_is_done(cluster):
    """It returned at once while the first was still tearing down (sockets open)."""
    async with asyncio.timeout(30):
        a = await cluster.connect("a:0").start()
        b = await cluster.connect("b:0").start()
        try:
            await a.send(np.ones(4 << 20, np.uint8), "b:0")    # b holds a's slot: a's close drains
            first = asyncio.ensure_future(a.aclose())
            await asyncio.sleep(0)                              # (a yield) the first close has begun
            await a.aclose()
            assert first.done() and a._lifecycle.context is None
        finally:
            await b.aclose()


@pytest.mark.parametrize("yields", [1, 3, 10])
async def test_a_cancelled_aclose_still_closes_everything(cluster, yields):
    """Cancelling aclose (Ctrl-C, a timeout around the 'async with') at any of its
    awaits still fails pending receives, closes the sockets and cancels the core's
    tasks; the cancel is re-raised, and a later aclose returns."""
    async with asyncio.timeout(30):
        a = await cluster.connect("a:0").start()
        b = await cluster.connect("b:0").start()
        try:
            await a.send(np.ones(4 << 20, np.uint8), "b:0")    # b holds a's slot: a's close drains
            await a.send("small", "b:0")                        # and a stream link to flush
            pending = asyncio.ensure_future(a.recv("b:0", tag=5))
            closing = asyncio.ensure_future(a.aclose())
            for _ in range(yields):
                await asyncio.sleep(0)
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            with pytest.raises(rlinf.ClosedError):
                await pending
            assert a.closed and a._lifecycle.context is None
            assert not any(not t.done() for t in a._sessions.tasks()), "core tasks left running"
            await a.aclose()
        finally:
            await b.aclose()


async def test_another_threads_loop_is_refused(driver):
    """recv/send awaited on another thread's event loop parked a future of that loop,
    completed from the wrong thread (the receive came back seconds late, or never)."""
    def elsewhere(coro_fn):
        try:
            asyncio.run(coro_fn())
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for coro_fn in (lambda: driver.recv("driver:0", tag=20, timeout=5),
                    lambda: driver.send("x", "driver:0", tag=20)):
        said = await asyncio.get_running_loop().run_in_executor(None, elsewhere, coro_fn)
        assert "blocking_" in said
