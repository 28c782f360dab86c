"""Cluster authentication: keys derived from the token, and the ZAP handler.

Every cluster has one secret token. From it we derive (deterministically, so every
process that knows the token derives the same values):

* a CURVE server key pair, shared by every server socket of the cluster (manager and
  workers' TCP data endpoints), and a CURVE client key pair shared by every client;
* a PLAIN password for same-node ``ipc://`` data sockets, whose socket files already
  live in a ``0700`` directory;
* an HMAC key for the handshakes of unencrypted bulk TCP links
  (:mod:`rlinf.transports.tcp_bulk`).

A process without the token cannot complete a CURVE handshake (it does not know the
server's public key, and the ZAP handler rejects any client key but the cluster's), and
cannot pass the PLAIN check. TCP data traffic is encrypted by CURVE unless the user opts
out with ``RLINF_TCP_ENCRYPTION=0`` (then it is authenticated with PLAIN only, which is
faster but readable on the wire: use it on trusted networks).

The ZAP handler is bound per :class:`zmq.Context`; rlinf gives every communicator and
manager its own context, so handlers never collide.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

import zmq
from zmq.utils import z85

__all__ = ["ClusterKeys", "generate_token", "ZapHandler"]

log = logging.getLogger("rlinf.control.security")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_DOMAIN = b"rlinf"


def generate_token() -> str:
    """A fresh random cluster token (256 bits as hex text).

    Hex, not URL-safe base64: a token that starts with ``-`` would be read as an
    option when pasted after ``--token`` on a command line.
    """
    return secrets.token_hex(32)


def _derive(token: str, label: str) -> bytes:
    return hmac.new(token.encode(), label.encode(), hashlib.sha256).digest()


class ClusterKeys:
    """Key material derived from a token. Immutable; cheap to build once per process."""

    __slots__ = ("server_public", "server_secret", "client_public", "client_secret", "password", "bulk_key")

    def __init__(self, token: str) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("a cluster token must be a non-empty str")
        self.server_secret = z85.encode(_derive(token, "rlinf-curve-server"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(_derive(token, "rlinf-curve-client"))
        self.client_public = zmq.curve_public(self.client_secret)
        self.password = z85.encode(_derive(token, "rlinf-plain"))
        self.bulk_key = _derive(token, "rlinf-bulk")   # HMAC key of bulk TCP handshakes

    def secure_server(self, sock: zmq.Socket, *, encrypt: bool = True) -> None:
        """Make ``sock`` (before bind) accept only cluster members."""
        sock.zap_domain = _DOMAIN
        if encrypt:
            sock.curve_server = True
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
        else:
            sock.plain_server = True

    def secure_client(self, sock: zmq.Socket, *, encrypt: bool = True) -> None:
        """Give ``sock`` (before connect) the cluster's client credentials."""
        if encrypt:
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret
        else:
            sock.plain_username = b"rlinf"
            sock.plain_password = self.password


class ZapHandler:
    """Answers ZeroMQ authentication (ZAP) requests for one context, on the event loop.

    It accepts CURVE clients holding the cluster's client key and PLAIN clients holding
    the cluster's password, in the ``rlinf`` domain, and rejects everything else.
    """

    def __init__(self, context: zmq.Context, keys: ClusterKeys) -> None:
        self._keys = keys
        self._sock = context.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)
        self._loop = None
        self.rejected = 0

    def attach(self, loop) -> None:
        """Start serving requests from ``loop`` (an asyncio loop)."""
        self._loop = loop
        loop.add_reader(self._sock.FD, self._serve)
        loop.call_soon(self._serve)

    def _serve(self) -> None:
        sock = self._sock
        if sock.closed:   # closed before this first call ran (the manager failed to bind)
            return
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            sock.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id = request[0], request[1]
        ok = False
        if len(request) >= 6 and request[2] == _DOMAIN:
            mechanism = request[5]
            creds = request[6:]
            if mechanism == b"CURVE" and len(creds) == 1:
                ok = hmac.compare_digest(z85.encode(creds[0]), self._keys.client_public)
            elif mechanism == b"PLAIN" and len(creds) == 2:
                ok = hmac.compare_digest(creds[1], self._keys.password)
        if ok:
            return [version, request_id, b"200", b"OK", b"rlinf", b""]
        self.rejected += 1
        log.warning("rlinf: rejected a connection that did not present the cluster token")
        return [version, request_id, b"400", b"not a cluster member", b"", b""]

    def close(self) -> None:
        if self._loop is not None and not self._sock.closed:
            try:
                self._loop.remove_reader(self._sock.FD)
            except (ValueError, OSError):
                pass
        self._sock.close(0)
