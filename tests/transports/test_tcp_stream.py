"""TCP stream specifics beyond the conformance suite: authentication, sealing and
hostile input (what the stream and bulk links are checked for, over TCP)."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

import rlinf
from rlinf.transports import _aead, _records, stream
from rlinf.transports.descriptors import MAX_HEADER
from rlinf.transports.tcp_stream import TcpStreamTransport

from ..integration.wait import until
from ._keyed import (check_a_client_without_the_key_is_refused, check_it_still_serves,
                     check_more_than_65536_buffers_arrive, closed_by_peer, sizes_past_memory, watched)

KEY = b"k" * 32
LOGGER = "rlinf.transports.stream"      # the listener's connections are stream.py's


@pytest.fixture(params=[True, False], ids=["sealed", "plain"])
async def listener(request):
    lst = await TcpStreamTransport(KEY, encrypt=request.param).listen()
    yield lst
    lst.close()


def _endpoint(listener) -> str:
    return listener.endpoints["tcp_stream"]


async def _raw(listener) -> socket.socket:
    host, port = _endpoint(listener)[len("tcp://"):].rsplit(":", 1)
    return await asyncio.get_running_loop().run_in_executor(None, socket.create_connection, (host, int(port)))


def _plain(key: bytes) -> TcpStreamTransport:
    """A client that does not ask for encryption (the listener may)."""
    return TcpStreamTransport(key, encrypt=False)


async def test_a_client_without_the_key_is_refused(listener):
    await check_a_client_without_the_key_is_refused(_plain, KEY, listener, "tcp_stream")


async def test_a_client_that_fails_the_proof_gets_nothing_delivered(listener):
    """A client that knows the protocol but not the key: the listener closes the
    connection at the proof, and never reads a frame set from it."""
    async with asyncio.timeout(20):
        sock = await _raw(listener)
        try:
            sock.sendall(b"RLINFTS1" + b"n" * 32 + b"\0\7" + struct.pack("<H", 3) + b"x|1")
            await asyncio.get_running_loop().run_in_executor(None, sock.recv, 32 + 2 + 32, socket.MSG_WAITALL)
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
        await check_it_still_serves(_plain, KEY, listener, "tcp_stream")


def _table(sizes: list[int]) -> bytes:
    return struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)


_ANNOUNCEMENTS = {
    "no-frames": struct.pack("<I", 0),
    "too-many": struct.pack("<I", 1 << 23),
    "header-too-long": _table([MAX_HEADER + 1]),
    "frame-too-large": _table([16, (4 << 30) + 1]),
    "100GiB": _table([16, *sizes_past_memory(4 << 30)]),      # each frame within its limit
}


@pytest.mark.parametrize("announce", _ANNOUNCEMENTS.values(), ids=_ANNOUNCEMENTS.keys())
async def test_oversized_announcements_close_that_connection_only(listener, announce, caplog):
    """Sizes are checked before anything is allocated, sealed or not: the connection
    that announces too much is closed (logged once), the listener serves the next."""
    with watched(caplog, LOGGER) as logged:
        async with asyncio.timeout(20):
            bad = await _plain(KEY).connect(_endpoint(listener), identity=b"bad|1")
            if bad._sealer is not None:     # the listener asked for encryption: announce it sealed
                announce = _records.seal(bad._sealer, [announce])
            bad._transport.write(announce)
            await until(lambda: listener.dropped == 1, what="the dropped connection")
            await until(lambda: bad._closed is not None, what="the sender to see it")
            with pytest.raises(rlinf.PeerLostError):
                bad.try_send([b"h"])
            await check_it_still_serves(_plain, KEY, listener, "tcp_stream")
        assert len(logged()) == 1 and "closed a stream connection from b'bad|1'" in logged()[0]


@pytest.mark.parametrize("record", [struct.pack("<I", _records.RECORD + 1), struct.pack("<I", 0)],
                         ids=["too-large", "empty"])
async def test_an_oversized_or_empty_record_closes_that_connection_only(record, caplog):
    lst = await TcpStreamTransport(KEY, encrypt=True).listen()
    try:
        with watched(caplog, LOGGER) as logged:
            async with asyncio.timeout(20):
                bad = await _plain(KEY).connect(_endpoint(lst), identity=b"bad|1")
                bad._transport.write(record + bytes(64))
                await until(lambda: lst.dropped == 1, what="the dropped connection")
                await check_it_still_serves(_plain, KEY, lst, "tcp_stream")
            assert len(logged()) == 1 and "sealed record" in logged()[0]
    finally:
        lst.close()


async def test_a_forged_record_is_dropped_with_its_connection(caplog):
    """A sealed record that fails its tag: nothing is delivered, the connection ends
    (the sender sees PeerLostError), other connections go on."""
    lst = await TcpStreamTransport(KEY, encrypt=True).listen()
    try:
        with watched(caplog, LOGGER) as logged:
            async with asyncio.timeout(20):
                bad = await _plain(KEY).connect(_endpoint(lst), identity=b"bad|1")
                forged = _records.seal(bad._sealer, [_table([1, 4]), b"h", b"evil"])
                forged[-1] ^= 1                      # the tag's last byte
                bad._transport.write(bytes(forged))
                await until(lambda: bad._closed is not None, what="the sender to see the drop")
                with pytest.raises(rlinf.PeerLostError):
                    bad.try_send([b"h"])
                await check_it_still_serves(_plain, KEY, lst, "tcp_stream")
            assert lst.dropped == 1 and "failed authentication" in logged()[0]
    finally:
        lst.close()


@pytest.mark.parametrize("client_seals", [True, False])
async def test_either_end_asking_for_encryption_seals_the_stream(listener, client_seals):
    """Sealed when either end asks: then no payload byte goes on the wire in clear."""
    async with asyncio.timeout(20):
        link = await TcpStreamTransport(KEY, encrypt=client_seals).connect(_endpoint(listener), identity=b"a|1")
        sealed = client_seals or listener._terms[0] == 1
        assert (link._sealer is not None) == sealed
        wire: list[bytes] = []
        write = link._write

        def spy(data):
            wire.append(bytes(data))
            write(data)

        link._write = spy
        secret = b"the-secret-payload" * 3
        data = np.arange(600 << 10, dtype=np.uint8)          # more than two records
        await link.send(b"header", [secret, data])
        received = await listener.recv()
        assert received.header == b"header" and bytes(received.frames[0]) == secret
        assert np.array_equal(np.frombuffer(received.frames[1], np.uint8), data)
        if sealed:      # (unsealed, large frames go to the socket by writev, not through _write)
            assert wire and secret not in b"".join(wire)
        link.close()


@pytest.mark.parametrize("cipher", _aead.CIPHERS)
async def test_each_cipher_both_ends_offer_carries_a_stream(monkeypatch, cipher):
    if cipher not in _aead._lib().ciphers:
        pytest.skip(f"{cipher} is not available on this machine")
    monkeypatch.setattr(_aead, "offered", lambda: 1 << _aead.CIPHERS.index(cipher))
    async with asyncio.timeout(20):
        lst = await TcpStreamTransport(KEY, encrypt=True).listen()
        try:
            link = await TcpStreamTransport(KEY, encrypt=True).connect(_endpoint(lst), identity=b"a|1")
            assert link._sealer._cipher.name == cipher
            data = np.arange(5 << 17, dtype=np.uint8)
            await link.send(b"h", [data])
            assert np.array_equal(np.frombuffer((await lst.recv()).frames[0], np.uint8), data)
            link.close()
        finally:
            lst.close()


@pytest.mark.parametrize("short", ["client", "listener"])
async def test_ends_that_share_no_cipher_never_send_in_clear(monkeypatch, short):
    """An end that asks for encryption and shares no cipher with the other: the dial
    fails with TransportUnavailableError (the communicator then uses ZeroMQ with CURVE);
    nothing is delivered."""
    async with asyncio.timeout(20):
        if short == "listener":
            monkeypatch.setattr(_aead, "offered", lambda: 0)      # the listener has no libsodium
            lst = await TcpStreamTransport(KEY, encrypt=False).listen()
            monkeypatch.undo()
            client = TcpStreamTransport(KEY, encrypt=True)
        else:
            lst = await TcpStreamTransport(KEY, encrypt=True).listen()
            monkeypatch.setattr(_aead, "offered", lambda: 0)      # the client has none
            client = _plain(KEY)
        try:
            with pytest.raises(rlinf.TransportUnavailableError, match="share no cipher"):
                await client.connect(_endpoint(lst), identity=b"a|1")
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.2):
                    await lst.recv()
        finally:
            lst.close()


async def test_a_message_of_more_than_65536_buffers_arrives(listener):
    await check_more_than_65536_buffers_arrive(_plain, KEY, listener, "tcp_stream")


async def test_too_many_handshakes_at_once_are_closed_as_they_come(listener, monkeypatch):
    """Anyone on the network can connect: past the most connections in their handshake
    (1024; 16 here), more are closed at once; a proper client still gets through once
    those end."""
    monkeypatch.setattr(stream, "_MAX_HANDSHAKES", 16)
    async with asyncio.timeout(30):
        socks = [await _raw(listener) for _ in range(16)]
        extra = await _raw(listener)
        assert await closed_by_peer(extra)
        extra.close()
        for sock in socks:
            sock.close()
        await until(lambda: not listener._conns, what="the idle connections to end")
        await check_it_still_serves(_plain, KEY, listener, "tcp_stream")


def test_frames_survive_the_uvloop_write_path():
    """Under uvloop (the communicator's loop) a sealed frame set's buffers may be reused
    as soon as try_send returns."""
    import uvloop

    async def main():
        lst = await TcpStreamTransport(KEY).listen()
        link = await TcpStreamTransport(KEY).connect(_endpoint(lst), identity=b"a|1")
        buf = bytearray(b"a" * (1 << 20))
        for i in range(8):
            link.try_send([b"h", buf])
            buf[:] = bytes([98 + i]) * len(buf)
        got = [bytes((await lst.recv()).frames[0][:1]) for _ in range(8)]
        link.close()
        lst.close()
        return got

    assert uvloop.run(asyncio.wait_for(main(), 20)) == [b"a"] + [bytes([98 + i]) for i in range(7)]

