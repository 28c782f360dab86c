"""Fixtures of the transport conformance suite: one sender/receiver pair per transport.

Every transport in ``rlinf/transports/`` joins the ``pair`` fixture's parameters and so
runs the whole suite in ``test_conformance.py`` and ``test_link_contract.py``: the
links the communicator uses (ZeroMQ ``ipc://`` and ``tcp://``, stream, TCP stream, bulk TCP, set up
with the cluster's keys as it does) and the shared-memory link. GPU transports join with the ``cuda``
marker (see ``_TRANSPORTS``); they are skipped where no GPU exists.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pytest
import zmq

from rlinf.control.security import ClusterKeys, ZapHandler
from rlinf.transports.base import Link, Listener
from rlinf.transports.shm import ShmTransport, available as shm_available
from rlinf.transports.stream import StreamTransport
from rlinf.transports.tcp_bulk import BulkTransport
from rlinf.transports.tcp_stream import TcpStreamTransport
from rlinf.transports.zeromq import ZmqTransport


@dataclass
class Pair:
    """A listener and a link to it, plus a way to open more links.

    ``connect(identity)`` opens another link to the same listener. ``sender`` and
    ``receiver`` are the transport objects (for transport-specific checks).
    """

    name: str
    listener: Listener
    link: Link
    connect: Callable[[bytes], Awaitable[Link]]
    sender: Any
    receiver: Any
    closers: list[Callable[[], Any]] = field(default_factory=list)


class _Zmq:
    """One ZeroMQ context with its authentication handler (one per simulated process)."""

    def __init__(self, keys: ClusterKeys, scheme: str) -> None:
        self.context = zmq.Context()
        self.zap = ZapHandler(self.context, keys)
        self.zap.attach(asyncio.get_running_loop())
        tcp = "127.0.0.1" if scheme == "tcp" else None
        self.transport = ZmqTransport(self.context, keys, tcp_host=tcp, ipc=scheme == "ipc", encrypt_tcp=True)

    def close(self) -> None:
        self.transport.close()
        self.zap.close()
        self.context.term()


async def _zmq_pair(name: str, scheme: str) -> Pair:
    keys = ClusterKeys(secrets.token_hex(16))
    rx, tx = _Zmq(keys, scheme), _Zmq(keys, scheme)
    listener = await rx.transport.listen()
    endpoint = listener.endpoints[scheme]

    async def connect(identity: bytes) -> Link:
        return await tx.transport.connect(endpoint, identity=identity)

    link = await connect(b"sender|1")
    pair = Pair(name, listener, link, connect, tx.transport, rx.transport)
    pair.closers += [listener.close, tx.close, rx.close]
    return pair


async def _shm_pair(name: str, cap: int | None) -> Pair:
    if not shm_available():
        pytest.skip("shared memory needs Linux and a writable /dev/shm")
    keys = ClusterKeys(secrets.token_hex(16))
    rx, tx = _Zmq(keys, "ipc"), _Zmq(keys, "ipc")
    # copies of 1 MiB or more run in an executor thread: the suite's large frame sets
    # take that path too
    receiver, sender = ShmTransport(rx.transport), ShmTransport(tx.transport, cap=cap, offload=1 << 20)
    listener = await receiver.listen()
    endpoint = listener.endpoints["ipc"]

    async def connect(identity: bytes) -> Link:
        return await sender.connect(endpoint, identity=identity)

    link = await connect(b"sender|1")
    pair = Pair(name, listener, link, connect, sender, receiver)
    pair.closers += [listener.close, sender.close, receiver.close, tx.close, rx.close]
    return pair


async def _keyed_pair(name: str, receiver: Any, sender: Any, scheme: str) -> Pair:
    """A pair of transports that authenticate with a shared key (bulk TCP, stream)."""
    listener = await receiver.listen()
    endpoint = listener.endpoints[scheme]

    async def connect(identity: bytes) -> Link:
        return await sender.connect(endpoint, identity=identity)

    link = await connect(b"sender|1")
    pair = Pair(name, listener, link, connect, sender, receiver)
    pair.closers += [listener.close]
    return pair


async def _bulk_pair(name: str, encrypt: bool) -> Pair:
    key = ClusterKeys(secrets.token_hex(16)).bulk_key
    return await _keyed_pair(name, BulkTransport(key, encrypt=encrypt), BulkTransport(key, encrypt=encrypt), "bulk")


async def _stream_pair(name: str) -> Pair:
    key = ClusterKeys(secrets.token_hex(16)).bulk_key
    return await _keyed_pair(name, StreamTransport(key), StreamTransport(key), "stream")


async def _tcp_stream_pair(name: str, encrypt: bool) -> Pair:
    key = ClusterKeys(secrets.token_hex(16)).bulk_key
    return await _keyed_pair(name, TcpStreamTransport(key, encrypt=encrypt), TcpStreamTransport(key, encrypt=encrypt),
                             "tcp_stream")


async def _cuda_pair(name: str) -> Pair:
    # GPU transports (CUDA IPC, NCCL) join the suite here once they exist.
    pytest.skip(f"the {name} transport is not implemented yet")


_TRANSPORTS = [
    pytest.param("zmq-ipc", id="zmq-ipc"),
    pytest.param("zmq-tcp", id="zmq-tcp"),
    pytest.param("shm", id="shm"),
    pytest.param("shm-capped", id="shm-capped"),     # cap 0: every send falls back inline
    pytest.param("bulk-tcp", id="bulk-tcp"),               # sealed (AEGIS-256, else AES-GCM / ChaCha20-Poly1305)
    pytest.param("bulk-tcp-plain", id="bulk-tcp-plain"),
    pytest.param("stream", id="stream"),
    pytest.param("tcp-stream", id="tcp-stream"),            # sealed, as bulk-tcp
    pytest.param("tcp-stream-plain", id="tcp-stream-plain"),
    pytest.param("cuda_ipc", id="cuda_ipc", marks=pytest.mark.cuda),
]


@pytest.fixture(params=_TRANSPORTS)
async def pair(request) -> Pair:
    name = request.param
    async with asyncio.timeout(20):
        if name.startswith("zmq-"):
            p = await _zmq_pair(name, name.split("-")[1])
        elif name == "shm":
            p = await _shm_pair(name, None)
        elif name == "shm-capped":
            p = await _shm_pair(name, 0)
        elif name.startswith("bulk-tcp"):
            p = await _bulk_pair(name, encrypt=name == "bulk-tcp")
        elif name == "stream":
            p = await _stream_pair(name)
        elif name.startswith("tcp-stream"):
            p = await _tcp_stream_pair(name, encrypt=name == "tcp-stream")
        else:
            p = await _cuda_pair(name)
    try:
        yield p
    finally:
        p.link.close()
        for close in p.closers:
            close()
