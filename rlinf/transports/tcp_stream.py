"""TCP stream transport: frame sets to other nodes over TCP, written and read by the
event loop (the stream link of :mod:`.stream`, across machines).

Why: a ZeroMQ message crosses two I/O threads, each woken through its own mailbox,
and on a TCP link CURVE's encryption in them, before the receiving loop sees it. Across
emulated nodes a 64 B round trip costs ~224 µs through rlinf's ZeroMQ links while a
plain socket between the same namespaces answers in 24-66 µs (``docs/benchmarks.md``).
Between workers of different nodes rlinf therefore sends its frame sets over a TCP
connection that uvloop writes and reads directly, as it does over a Unix socket on one
node; ZeroMQ stays the control plane and the fallback.

Security: the listener is on the node's data host, reachable by anyone on the network.
Every connection opens with the HMAC challenge of :mod:`.stream` under this protocol's
magic, extended with each end's *terms* (:mod:`._agree`): when either end asks for
encryption (``RLINF_TCP_ENCRYPTION``, on by default) everything after the handshake is
sealed (:mod:`._records`: AEGIS-256, or AES-256-GCM, or ChaCha20-Poly1305, the first
both ends offer, under per-connection, per-direction keys, as for the bulk links).
Ends that share no cipher refuse the connection (:class:`TransportUnavailableError`
at the dialler, which then uses ZeroMQ with CURVE): nothing meant to be sealed goes in
clear. Handshake failures, junk, records that fail their tag and oversized frame sets
close that connection only; at most 1024 connections may be in their handshake at once.

Protocol: as :mod:`.stream`, with ``terms`` (2 bytes) after each end's nonce, covered by
both MACs. Frame sets are ``u32 count | u64 size * count | frames``, in sealed records
when encrypted. Buffer lifetimes and backpressure are those of
:class:`~.stream.StreamLink`; received frames are read-only views of recycled blocks.
"""

from __future__ import annotations

import asyncio

from ..errors import TransportUnavailableError
from . import _aead, _agree
from .shm import Recycler
from .stream import StreamListener, StreamTransport, _Client, _Server
from .tcp_bulk import _parse

__all__ = ["TcpStreamTransport", "SCHEME"]

#: The endpoint key a worker advertises this listener under.
SCHEME = "tcp_stream"
_MAGIC = b"RLINFTS1"


class TcpStreamTransport(StreamTransport):
    """Stream listeners and links over TCP (see the module docstring).

    Args:
        key: the cluster's 32-byte key of these links (``ClusterKeys.bulk_key``).
        host: interface to listen on.
        advertise_host: address peers dial (default ``host``).
        recycler: where receive blocks come from (a new one by default).
        encrypt: seal this end's connections (either end asking is enough).

    Raises:
        TransportUnavailableError: encryption is asked for and no libsodium loads.
    """

    name = "tcp_stream"
    _magic = _MAGIC

    def __init__(self, key: bytes, *, host: str = "127.0.0.1", advertise_host: str | None = None,
                 recycler: Recycler | None = None, encrypt: bool = True) -> None:
        if encrypt and not _aead.available():
            raise TransportUnavailableError("TCP stream encryption needs libsodium (bundled with pyzmq's wheels)")
        super().__init__(key, recycler=recycler)
        self._encrypt = encrypt
        self._host = host
        self._advertise = advertise_host or host

    def _terms(self) -> bytes:
        return _agree.terms(self._encrypt)

    async def listen(self) -> StreamListener:
        """Listen on the host, on a port the kernel picks.

        Raises:
            TransportUnavailableError: no socket can be bound on the host.
        """
        loop = asyncio.get_running_loop()
        listener = StreamListener(loop, self._key, None, self._recycler, magic=_MAGIC, terms=self._terms())
        try:
            listener._server = await loop.create_server(lambda: _Server(listener), self._host, 0,
                                                        reuse_address=True, backlog=128)
        except OSError as exc:
            raise TransportUnavailableError(f"cannot listen for TCP streams on {self._host}: {exc}") from exc
        port = listener._server.sockets[0].getsockname()[1]
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        listener.endpoints = {SCHEME: f"tcp://{host}:{port}"}
        return listener

    async def _open(self, loop: asyncio.AbstractEventLoop, endpoint: str) -> tuple[asyncio.Transport, _Client]:
        host, port = _parse(endpoint)
        return await loop.create_connection(lambda: _Client(loop), host, port)
