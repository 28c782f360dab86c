"""The HMAC challenge that opens rlinf's own stream connections (bulk TCP, streams).

Both ends send a fresh nonce; each proves it holds the cluster key with an HMAC-SHA256
over both nonces, a role byte and everything else the handshake must bind (the
sender's identity, the protocol's magic, negotiated options). A connection that fails
is closed before any frame is read.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE", "MAC", "mac", "nonce", "same"]

NONCE = 32
MAC = 32


def mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``role`` and ``parts`` (concatenated) under ``key``."""
    return hmac.new(key, role + b"".join(parts), hashlib.sha256).digest()


def nonce() -> bytes:
    """A fresh handshake nonce."""
    return secrets.token_bytes(NONCE)


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(a, b)
