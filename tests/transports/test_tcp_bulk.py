"""Bulk TCP specifics beyond the conformance suite: authentication and hostile input."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import numpy as np
import pytest

import rlinf
from rlinf.transports import _aead
from rlinf.transports.descriptors import MAX_HEADER
from rlinf.transports.tcp_bulk import BulkTransport

from ..integration.wait import until
from ._keyed import (check_a_client_without_the_key_is_refused, check_it_still_serves,
                     check_more_than_65536_buffers_arrive, ShortOfMemory, closed_by_peer, sizes_past_memory,
                     watched)

KEY = b"k" * 32


@pytest.fixture(params=[True, False], ids=["sealed", "plain"])
async def listener(request):
    lst = await BulkTransport(KEY, encrypt=request.param).listen()
    yield lst
    lst.close()


def _host_port(listener) -> tuple[str, int]:
    host, port = listener.endpoints["bulk"][len("tcp://"):].rsplit(":", 1)
    return host, int(port)


async def test_a_client_without_the_key_is_refused(listener):
    await check_a_client_without_the_key_is_refused(BulkTransport, KEY, listener, "bulk")


async def test_a_client_that_fails_the_proof_gets_nothing_delivered(listener):
    """A client that knows the protocol but not the key: the listener closes the
    connection after the proof, and never reads a frame set from it."""
    async with asyncio.timeout(20):
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, socket.create_connection, _host_port(listener))
        try:
            sock.sendall(b"RLINFBK2" + b"n" * 32 + b"\0\7" + struct.pack("!H", 3) + b"x|1")
            await loop.run_in_executor(None, sock.recv, 32 + 2 + 32, socket.MSG_WAITALL)   # nonce, terms, MAC
            sock.sendall(b"p" * 32 + struct.pack("!IQQ", 2, 1, 3) + b"hxyz")
            assert await closed_by_peer(sock)     # closed, no ack
        finally:
            sock.close()
        await until(lambda: listener.rejected == 1, what="the rejection")


@pytest.mark.parametrize("junk", [b"", b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 64])
async def test_junk_does_not_break_the_listener(listener, junk):
    async with asyncio.timeout(20):
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, socket.create_connection, _host_port(listener))
        sock.sendall(junk)
        sock.close()
        await check_it_still_serves(BulkTransport, KEY, listener, "bulk")


def _claim(link, sizes: list[int]) -> bytes:
    """A frame table claiming a 16-byte header and frames of ``sizes``, then that header:
    sealed when the link is (a peer holding the key may claim anything)."""
    head = struct.pack(f"!I{len(sizes) + 1}Q", len(sizes) + 1, 16, *sizes) + b"h" * 16
    if not link.encrypted:
        return head
    record = memoryview(bytearray(head))
    tag = link._stream.out.seal(record, record)
    return struct.pack("!I", len(head)) + bytes(record) + tag


_CLAIMS = [[(1 << 40) + 1], [1 << 40, 1 << 40], sizes_past_memory(4 << 30)]


async def test_oversized_announcements_close_the_connection(listener, caplog):
    """Sizes are checked before anything is allocated: a frame count or a size past the
    limits, or frames adding up to more than this machine holds, end that connection
    only, each logged once, none as an unhandled error in the reader thread."""
    with watched(caplog, "rlinf.transports.tcp_bulk") as logged:
        async with asyncio.timeout(20):
            if listener._encrypt:     # a sealed table: its length, then a record that fails its tag
                bad = [struct.pack("!I", 0), struct.pack("!I", 1 << 30), struct.pack("!I", 40) + bytes(40 + 32)]
            else:
                bad = [struct.pack("!I", 0), struct.pack("!I", 1 << 23), struct.pack("!IQ", 1, 1 << 50),
                       struct.pack("!IQ", 1, MAX_HEADER + 1)]
            for announce in [*bad, *_CLAIMS]:
                link = await BulkTransport(KEY, encrypt=False).connect(listener.endpoints["bulk"], identity=b"a|1")
                link._sock.sendall(announce if isinstance(announce, bytes) else _claim(link, announce))
                assert await closed_by_peer(link._sock)
                link.close()
            ok = await BulkTransport(KEY).connect(listener.endpoints["bulk"], identity=b"a|2")
            await ok.send(b"still", [])
            assert (await listener.recv()).header == b"still"
            ok.close()
            await until(lambda: len(logged()) == len(bad) + len(_CLAIMS), what="a log line per connection")
        assert all("bulk connection dropped" in line for line in logged())


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
async def test_a_frame_there_is_no_memory_for_closes_that_connection_only(caplog, encrypt):
    listener = await BulkTransport(KEY, encrypt=encrypt, recycler=ShortOfMemory()).listen()
    try:
        with watched(caplog, "rlinf.transports.tcp_bulk") as logged:
            async with asyncio.timeout(20):
                bad = await BulkTransport(KEY, encrypt=False).connect(listener.endpoints["bulk"], identity=b"a|1")
                bad._sock.sendall(_claim(bad, [8 << 20]))
                assert await closed_by_peer(bad._sock)
                bad.close()
                ok = await BulkTransport(KEY).connect(listener.endpoints["bulk"], identity=b"a|2")
                await ok.send(b"still", [b"x" * 1000])
                assert bytes((await listener.recv()).frames[0]) == b"x" * 1000
                ok.close()
                await until(lambda: logged(), what="the log line")
            assert len(logged()) == 1 and "no memory for a bulk frame" in logged()[0]
    finally:
        listener.close()


async def test_a_send_to_a_closed_listener_is_peer_lost(listener):
    async with asyncio.timeout(20):
        link = await BulkTransport(KEY).connect(listener.endpoints["bulk"], identity=b"a|1")
        listener.close()
        with pytest.raises(rlinf.PeerLostError):
            await link.send(b"h", [np.zeros(8 << 20, np.uint8)])
        with pytest.raises(rlinf.ClosedError):
            await link.send(b"h", [])


@pytest.mark.parametrize("client_seals", [True, False])
async def test_either_end_asking_for_encryption_seals_the_stream(listener, client_seals):
    async with asyncio.timeout(20):
        link = await BulkTransport(KEY, encrypt=client_seals).connect(listener.endpoints["bulk"], identity=b"a|1")
        assert link.encrypted == (client_seals or listener._encrypt)
        data = np.arange(3 << 20, dtype=np.uint8)          # three records and a bit
        await link.send(b"header", [data[:-5], b"x", data])
        received = await listener.recv()
        assert received.header == b"header"
        assert [bytes(f[:3]) for f in received.frames] == [b"\0\1\2", b"x", b"\0\1\2"]
        assert np.array_equal(np.frombuffer(received.frames[2], np.uint8), data)
        link.close()


async def test_a_forged_record_is_dropped_with_its_connection(listener):
    """A sealed record that fails its tag: nothing is delivered, the connection ends
    (the sender sees PeerLostError), other connections go on."""
    async with asyncio.timeout(20):
        link = await BulkTransport(KEY, encrypt=True).connect(listener.endpoints["bulk"], identity=b"a|1")
        class Forger:      # seals the table honestly, then forges the payload's tag
            def __init__(self, real):
                self.real = real

            def seal(self, src, dst):
                tag = self.real.seal(src, dst)
                return bytes(len(tag)) if src.nbytes == 1000 else tag

        link._stream.out = Forger(link._stream.out)
        with pytest.raises(rlinf.PeerLostError):
            await link.send(b"h", [np.ones(1000, np.uint8)])
        other = await BulkTransport(KEY).connect(listener.endpoints["bulk"], identity=b"b|1")
        await other.send(b"fine", [])
        assert (await listener.recv()).header == b"fine"
        other.close()


@pytest.mark.parametrize("cipher", _aead.CIPHERS)
async def test_each_cipher_both_ends_offer_carries_a_stream(monkeypatch, cipher):
    """Ends that share only ``cipher`` use it; a payload crosses it intact."""
    if cipher not in _aead._lib().ciphers:
        pytest.skip(f"{cipher} is not available on this machine")
    monkeypatch.setattr(_aead, "offered", lambda: 1 << _aead.CIPHERS.index(cipher))
    async with asyncio.timeout(20):
        lst = await BulkTransport(KEY, encrypt=True).listen()
        try:
            link = await BulkTransport(KEY, encrypt=True).connect(lst.endpoints["bulk"], identity=b"a|1")
            assert link._stream.out._cipher.name == cipher
            data = np.arange(5 << 19, dtype=np.uint8)
            await link.send(b"h", [data])
            assert np.array_equal(np.frombuffer((await lst.recv()).frames[0], np.uint8), data)
            link.close()
        finally:
            lst.close()


async def test_ends_that_share_no_cipher_never_send_in_clear(monkeypatch):
    """An end that asks for encryption and shares no cipher with the other is refused
    with TransportUnavailableError (its sender then uses ZeroMQ), never sent in clear."""
    async with asyncio.timeout(20):
        lst = await BulkTransport(KEY, encrypt=True).listen()
        try:
            monkeypatch.setattr(_aead, "offered", lambda: 0)     # the client has no libsodium
            with pytest.raises(rlinf.TransportUnavailableError, match="share no cipher"):
                await BulkTransport(KEY, encrypt=False).connect(lst.endpoints["bulk"], identity=b"a|1")
            await until(lambda: lst.rejected == 1, what="the listener's rejection")
        finally:
            lst.close()


async def test_a_message_of_more_than_65536_buffers_arrives(listener):
    """The listener refused frame sets of more than 65 536 frames, which the wire format
    allows (one per buffer of a large message): the message was lost."""
    async with asyncio.timeout(60):
        await check_more_than_65536_buffers_arrive(BulkTransport, KEY, listener, "bulk")


_EMFILE_SCRIPT = r"""
import asyncio, logging, os, resource, socket
from rlinf.transports.descriptors import MAX_HEADER
from rlinf.transports.tcp_bulk import BulkTransport

class Seen(logging.Handler):
    def __init__(self, loop, event):
        super().__init__()
        self.loop, self.event = loop, event
    def emit(self, record):
        if "cannot accept now" in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)

async def main():
    key = b"k" * 32
    lst = await BulkTransport(key, encrypt=False).listen()
    host, port = lst.endpoints["bulk"][len("tcp://"):].rsplit(":", 1)
    short = asyncio.Event()
    logging.getLogger("rlinf.transports.tcp_bulk").addHandler(Seen(asyncio.get_running_loop(), short))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    spare = socket.socket()    # its descriptor is taken now: it can connect when none is left
    outsiders = [spare]
    try:                       # connections from someone without the token use up the descriptors
        while True:
            outsiders.append(socket.create_connection((host, int(port))))
    except OSError:
        pass
    spare.setblocking(False)   # (the listener may have accepted all the others before we ran out)
    spare.connect_ex((host, int(port)))
    async with asyncio.timeout(30):
        await short.wait()     # the listener ran out of descriptors to accept with
    for s in outsiders:
        s.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    async with asyncio.timeout(30):
        link = await BulkTransport(key, encrypt=False).connect(lst.endpoints["bulk"], identity=b"member|1")
        await link.send(b"served", [])
        print((await lst.recv()).header.decode())
    link.close()
    lst.close()

asyncio.run(main())
"""


def test_running_out_of_descriptors_pauses_accepting_and_never_ends_it():
    """Anyone who can connect could stop the listener for good: an accept that failed
    for want of descriptors ended its accept thread."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EMFILE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "served", out.stderr[-2000:]


async def test_a_client_trickling_its_handshake_is_cut_off(listener, monkeypatch):
    """The handshake timeout applied to each read only: a client sending a byte now and
    then held its handshake place for ever."""
    from rlinf.transports import tcp_bulk

    monkeypatch.setattr(tcp_bulk, "_HANDSHAKE_TIMEOUT", 1.0)
    host, port = _host_port(listener)
    sock = socket.create_connection((host, port))
    stop = threading.Event()

    def trickle() -> None:        # a well-formed hello and proof, a byte every 0.2 s
        for byte in b"RLINFBK2" + bytes(36 + 32):
            if stop.wait(0.2):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        async with asyncio.timeout(5):   # its last byte would come after 15 s
            assert await closed_by_peer(sock)
    finally:
        stop.set()
        feeder.join(5)
        sock.close()
