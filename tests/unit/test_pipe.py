"""rlinf.util.pipe.MessagePipe over real socketpairs: large messages both ways at once, order,
EOF, the blocking send for after the loop, and multiprocessing's framing at the other end.

Tests run on asyncio's own loop (whose add_reader leaves the fd blocking, so the pipe
must make it non-blocking itself) and, where it matters, on uvloop (which makes it
non-blocking behind the pipe's back)."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import random
import socket
import threading

import pytest

from rlinf.util.pipe import MessagePipe

#: Far beyond a socketpair's buffer (about 200 KiB on Linux).
BIG = 8 * 1024 * 1024


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class _Inbox:
    """Collects what a started pipe delivers; ``wait(n)`` returns once ``n`` arrived."""

    def __init__(self) -> None:
        self.messages: list = []
        self.eofs = 0
        self.eof = asyncio.Event()
        self._changed = asyncio.Event()

    def on_message(self, message) -> None:
        self.messages.append(message)
        self._changed.set()

    def on_eof(self) -> None:
        self.eofs += 1
        self.eof.set()

    async def wait(self, n: int) -> list:
        while len(self.messages) < n:
            self._changed.clear()
            await self._changed.wait()
        return self.messages


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    assert a.getblocking() and b.getblocking()
    return a, b


def _started(sock, loop) -> tuple[MessagePipe, _Inbox]:
    inbox = _Inbox()
    pipe = MessagePipe(sock)
    pipe.start(loop, inbox.on_message, inbox.on_eof)
    return pipe, inbox


def _one_way(loop) -> tuple[MessagePipe, MessagePipe, _Inbox]:
    """A sender whose incoming messages nobody checks, and a receiver with an inbox."""
    a_sock, b_sock = _pair()
    a = MessagePipe(a_sock)
    a.start(loop, lambda m: None)
    b, b_in = _started(b_sock, loop)
    return a, b, b_in


async def _both_ways_at_once() -> None:
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    a, a_in = _started(a_sock, loop)
    b, b_in = _started(b_sock, loop)
    try:
        to_b = [_blob(BIG, 1), _blob(BIG // 3, 2), b"tail"]
        to_a = [_blob(BIG, 3), {"k": _blob(BIG // 2, 4)}, b"end"]
        for x, y in zip(to_b, to_a):   # interleaved: each side's output backs up meanwhile
            a.send(x)
            b.send(y)
        assert a.pending > 0 and b.pending > 0   # neither could write it all at once
        async with asyncio.timeout(20):
            got_b, got_a = await asyncio.gather(b_in.wait(3), a_in.wait(3))
        assert got_b == to_b and got_a == to_a
        assert a.pending == 0 and b.pending == 0
    finally:
        a.close()
        b.close()


async def test_large_messages_both_ways_at_once_arrive_whole_and_in_order():
    await _both_ways_at_once()


def test_large_messages_both_ways_at_once_on_uvloop():
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_both_ways_at_once())


async def test_many_small_and_mixed_messages_keep_their_order():
    seed = random.randrange(1 << 32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    a, b, b_in = _one_way(loop)
    try:
        sent = [("small", i) for i in range(5000)]
        # sizes that put frame boundaries anywhere in the reads
        sent += [rng.randbytes(rng.choice([0, 1, 3, 4, 5, 100, 65536, 300_000])) for _ in range(200)]
        rng.shuffle(sent)
        for m in sent:
            a.send(m)
        async with asyncio.timeout(20):
            assert await b_in.wait(len(sent)) == sent
    finally:
        a.close()
        b.close()


async def test_messages_sent_before_the_end_arrive_then_eof_once_then_sends_fail():
    loop = asyncio.get_running_loop()
    a, b, b_in = _one_way(loop)
    try:
        a.send(("result", True, _blob(BIG, 5)))   # more than the socket takes: queued
        a.send(("after",))
        async with asyncio.timeout(20):
            await b_in.wait(2)
            assert a.pending == 0   # b has the last byte: a wrote everything
            a.close()
            await b_in.eof.wait()
        assert b_in.messages == [("result", True, _blob(BIG, 5)), ("after",)]
        assert b_in.eofs == 1 and "gone" in repr(b)
        with pytest.raises(BrokenPipeError):
            b.send("to nobody")
        with pytest.raises(ValueError, match="closed"):
            a.send("from a closed pipe")
    finally:
        b.close()


async def test_a_peer_that_closes_with_our_message_unread_still_delivers_what_it_sent():
    """Linux resets the reader (ECONNRESET) when the other end closes with data unread
    in its own buffer, after the data sent before: a worker's result, then the driver's
    "finish" it never read."""
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    b, b_in = _started(b_sock, loop)
    try:
        b.send(("finish",))                       # never read by a
        a = MessagePipe(a_sock)
        a.send_blocking(("result", True, 42))
        a.close()
        async with asyncio.timeout(10):
            await b_in.eof.wait()
        assert b_in.messages == [("result", True, 42)] and b_in.eofs == 1
    finally:
        b.close()


async def test_an_unfinished_message_at_eof_is_dropped():
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    b, b_in = _started(b_sock, loop)
    try:
        whole = pickle.dumps("whole")
        a_sock.sendall(len(whole).to_bytes(4, "big") + whole + (1000).to_bytes(4, "big") + b"cut short")
        a_sock.close()
        async with asyncio.timeout(10):
            await b_in.eof.wait()
        assert b_in.messages == ["whole"] and b_in.eofs == 1
    finally:
        b.close()


async def test_drain_delivers_what_an_exited_peer_left_without_waiting_for_the_loop():
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    b, b_in = _started(b_sock, loop)
    try:
        a = MessagePipe(a_sock)
        a.send_blocking(("started", {}))
        a.send_blocking(("result", True, 42))
        a.close()
        b.drain()   # what the driver does when the exit sentinel fires first
        assert b_in.messages == [("started", {}), ("result", True, 42)] and b_in.eofs == 1
    finally:
        b.close()


async def test_send_blocking_writes_what_was_queued_and_its_message_while_the_peer_reads():
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    b, b_in = _started(b_sock, loop)
    a = MessagePipe(a_sock)
    try:
        a.start(loop, lambda m: None)
        a.send(("reply", 1, _blob(BIG // 2, 6)))
        a.stop()                   # the worker's loop ends with a reply still queued
        assert a.pending > 0
        with pytest.raises(TypeError):
            a.send(threading.Lock())   # cannot be pickled: nothing queued
        result = ("result", True, _blob(BIG, 7))
        async with asyncio.timeout(20):
            # no loop on that side any more: the final send blocks its thread until written
            await asyncio.to_thread(a.send_blocking, result)
            assert a.pending == 0
            a.close()
            await b_in.eof.wait()
        assert b_in.messages == [("reply", 1, _blob(BIG // 2, 6)), result]
    finally:
        a.close()
        b.close()


async def test_send_blocking_refuses_a_started_pipe_and_fails_once_the_peer_is_gone():
    loop = asyncio.get_running_loop()
    a_sock, b_sock = _pair()
    a = MessagePipe(a_sock)
    try:
        a.start(loop, lambda m: None)
        with pytest.raises(RuntimeError, match="stop"):
            a.send_blocking("x")
        a.stop()
        b_sock.close()
        with pytest.raises(OSError):
            a.send_blocking(_blob(BIG, 8))
    finally:
        a.close()


async def test_a_failing_callback_does_not_hold_up_the_messages_behind_it():
    loop = asyncio.get_running_loop()
    reported = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    a_sock, b_sock = _pair()
    a = MessagePipe(a_sock)
    inbox = _Inbox()

    def on_message(m):
        if m == "bad":
            raise RuntimeError("handler broke")
        inbox.on_message(m)

    b = MessagePipe(b_sock)
    b.start(loop, on_message)
    try:
        a.send_blocking("one")
        a.send_blocking("bad")
        a.send_blocking("two")
        async with asyncio.timeout(10):
            assert await inbox.wait(2) == ["one", "two"]
        assert [str(e) for e in reported] == ["handler broke"]
    finally:
        loop.set_exception_handler(previous)
        a.close()
        b.close()


async def test_a_multiprocessing_connection_at_the_other_end_speaks_the_same_framing():
    """The Ray actor relays the worker's pipe with Connection.recv_bytes / send_bytes."""
    loop = asyncio.get_running_loop()
    conn, worker_end = multiprocessing.Pipe()
    pipe, inbox = _started(worker_end, loop)
    try:
        down = pickle.dumps(("call", 1, "m", (_blob(BIG, 9),), {}), protocol=pickle.HIGHEST_PROTOCOL)
        up = ("reply", 1, True, _blob(BIG, 10))
        received = []
        reader = threading.Thread(target=lambda: received.append(conn.recv_bytes()), daemon=True)
        async with asyncio.timeout(20):
            reader.start()
            sending = asyncio.to_thread(conn.send_bytes, down)   # both directions at once
            pipe.send(up)
            await sending
            await inbox.wait(1)
            await asyncio.to_thread(reader.join, 15)
        assert inbox.messages == [pickle.loads(down)]
        assert [pickle.loads(r) for r in received] == [up]
    finally:
        pipe.close()
        conn.close()
