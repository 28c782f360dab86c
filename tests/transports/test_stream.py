"""Stream transport specifics beyond the conformance suite: authentication, hostile
input and backpressure."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

import rlinf
from rlinf.transports.descriptors import MAX_HEADER
from rlinf.transports.stream import StreamTransport

from ..integration.wait import until
from ._keyed import (check_a_client_without_the_key_is_refused, check_it_still_serves,
                     check_more_than_65536_buffers_arrive, ShortOfMemory, closed_by_peer, sizes_past_memory,
                     watched)

KEY = b"k" * 32


@pytest.fixture
async def listener():
    lst = await StreamTransport(KEY).listen()
    yield lst
    lst.close()


def _path(listener) -> str:
    return listener.endpoints["stream"][len("unix://"):]


async def _raw(listener) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await asyncio.get_running_loop().run_in_executor(None, sock.connect, _path(listener))
    return sock


async def test_the_socket_lives_in_a_private_directory(listener):
    import os
    import stat

    mode = os.stat(os.path.dirname(_path(listener))).st_mode
    assert stat.S_IMODE(mode) == 0o700


async def test_a_client_without_the_key_is_refused(listener):
    await check_a_client_without_the_key_is_refused(StreamTransport, KEY, listener, "stream")


async def test_a_client_that_fails_the_proof_gets_nothing_delivered(listener):
    """A client that knows the protocol but not the key: the listener closes the
    connection at the proof, and never reads a frame set from it."""
    async with asyncio.timeout(20):
        sock = await _raw(listener)
        try:
            sock.sendall(b"RLINFST1" + b"n" * 32 + struct.pack("<H", 3) + b"x|1")
            await asyncio.get_running_loop().run_in_executor(None, sock.recv, 64, socket.MSG_WAITALL)
            sock.sendall(b"p" * 32 + struct.pack("<IQQ", 2, 1, 3) + b"hxyz")
            assert await closed_by_peer(sock)
        finally:
            sock.close()
        await until(lambda: listener.rejected == 1, what="the rejection")
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(0.2):      # nothing was delivered
                await listener.recv()


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\n\r\n" + bytes(100), bytes(range(256)) * 64])
async def test_junk_does_not_break_the_listener(listener, junk):
    async with asyncio.timeout(20):
        sock = await _raw(listener)
        sock.sendall(junk)
        assert await closed_by_peer(sock)
        sock.close()
        await check_it_still_serves(StreamTransport, KEY, listener, "stream")


def _table(sizes: list[int]) -> bytes:
    return struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)


_ANNOUNCEMENTS = {
    "no-frames": struct.pack("<I", 0),
    "too-many": struct.pack("<I", 1 << 23),
    "too-large": struct.pack("<IQ", 1, 1 << 40),
    "header-too-long": _table([MAX_HEADER + 1]),
    "frame-too-large": _table([16, (4 << 30) + 1]),
    "100GiB": _table([16, *sizes_past_memory(4 << 30)]),      # each frame within its limit
    "256TiB": _table([16] + [4 << 30] * (1 << 16)),
}


@pytest.mark.parametrize("announce", _ANNOUNCEMENTS.values(), ids=_ANNOUNCEMENTS.keys())
async def test_oversized_announcements_close_that_connection_only(listener, announce, caplog):
    """Sizes are checked before anything is allocated; a frame set this machine cannot
    hold is refused like any malformed one: that connection is closed, the refusal is
    logged once, nothing reaches asyncio's handler of unhandled errors."""
    with watched(caplog, "rlinf.transports.stream") as logged:
        async with asyncio.timeout(20):
            bad = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"bad|1")
            bad._transport.write(announce)
            await until(lambda: listener.dropped == 1, what="the dropped connection")
            await until(lambda: bad._closed is not None, what="the sender to see it")
            with pytest.raises(rlinf.PeerLostError):
                bad.try_send([b"h"])
            ok = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"ok|1")
            await ok.send(b"still", [])
            assert (await listener.recv()).header == b"still"
            ok.close()
        assert len(logged()) == 1 and "closed a stream connection from b'bad|1'" in logged()[0]


async def test_a_frame_set_there_is_no_memory_for_closes_that_connection_only(caplog):
    listener = await StreamTransport(KEY, recycler=ShortOfMemory()).listen()
    try:
        with watched(caplog, "rlinf.transports.stream") as logged:
            async with asyncio.timeout(20):
                bad = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"bad|1")
                bad._transport.write(_table([16, 8 << 20]) + b"h" * 16 + bytes(1000))
                await until(lambda: listener.dropped == 1, what="the dropped connection")
                ok = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"ok|1")
                await ok.send(b"still", [b"x" * 1000])
                assert bytes((await listener.recv()).frames[0]) == b"x" * 1000
                ok.close()
                bad.close()
            assert len(logged()) == 1 and "no memory for a frame set" in logged()[0]
    finally:
        listener.close()


async def test_a_full_buffer_pushes_back_and_nothing_is_lost(listener):
    """With the receiver not reading, try_send raises WouldBlock once the buffer is
    full; once it reads again, every frame set arrives, in order."""
    async with asyncio.timeout(30):
        link = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"a|1")
        await link.send(b"first", [])
        await listener.recv()                       # connected and delivering
        for conn in listener._conns:
            conn._transport.pause_reading()
        chunk = np.ones(1 << 20, np.uint8)
        sent = 0
        with pytest.raises(rlinf.WouldBlock):
            for sent in range(1000):
                link.try_send([str(sent).encode(), chunk])
        for conn in listener._conns:
            conn._transport.resume_reading()
        await link.wait_writable()
        link.try_send([b"last", chunk])
        for i in range(sent):
            assert (await listener.recv()).header == str(i).encode()
        assert (await listener.recv()).header == b"last"
        link.close()


async def test_a_send_to_a_closed_listener_is_peer_lost(listener):
    async with asyncio.timeout(20):
        link = await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"a|1")
        listener.close()
        await until(lambda: link._closed is not None, what="the sender to see the close")
        with pytest.raises(rlinf.PeerLostError):
            await link.send(b"h", [np.zeros(1 << 20, np.uint8)])
        with pytest.raises(rlinf.PeerLostError):
            await StreamTransport(KEY).connect(listener.endpoints["stream"], identity=b"a|2")


async def test_a_message_of_more_than_65536_buffers_arrives(listener):
    """The listener refused frame sets of more than 65 536 frames, which the wire format
    allows (one per buffer of a large message): the message was lost, and the link with it."""
    async with asyncio.timeout(60):
        await check_more_than_65536_buffers_arrive(StreamTransport, KEY, listener, "stream")


def test_buffers_may_be_reused_once_send_returns_under_uvloop():
    """uvloop's ``writelines`` keeps a reference to what the kernel did not take (the
    standard loop copies it): a sender reusing its buffer after ``send`` returned
    changed what the peer received. The conformance suite runs on the standard loop."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        lst = await StreamTransport(KEY).listen()
        try:
            link = await StreamTransport(KEY).connect(lst.endpoints["stream"], identity=b"a|1")
            sent = np.full(32 << 20, 7, np.uint8)     # far more than the kernel takes at once
            async with asyncio.timeout(30):
                await link.send(b"h", [sent])
                sent[:] = 0
                got = await lst.recv()
            assert (np.frombuffer(got.frames[0], np.uint8) == 7).all()
            link.close()
        finally:
            lst.close()

    uvloop.run(main())
