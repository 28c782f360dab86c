"""What the two ends of an rlinf TCP connection agree on in their handshake: whether
the stream is sealed, with which AEAD, under which keys (bulk TCP and TCP stream links).

Each end sends two bytes of *terms* (:func:`terms`): whether it asks for encryption and
the bit mask of the ciphers it offers (:func:`._aead.offered`). Both ends' MACs cover
both ends' terms (:mod:`._proof`), so neither can be changed on the way. Either end
asking is enough; the stream then uses the first cipher both offer, under one key per
direction derived from the cluster key, both fresh nonces, the sender's identity and the
cipher's name (:func:`agree`). Ends that share no cipher refuse the connection rather
than send in clear.
"""

from __future__ import annotations

from . import _aead
from ._proof import mac

__all__ = ["TERMS", "terms", "agree"]

#: Size of one end's terms.
TERMS = 2


def terms(encrypt: bool) -> bytes:
    """This end's two handshake bytes: whether it asks for encryption, the ciphers it offers."""
    return bytes((int(encrypt), _aead.offered()))


def agree(key: bytes, client: tuple[bytes, bytes], server: tuple[bytes, bytes], identity: bytes, *,
          outgoing: str) -> tuple[_aead.Sealer, _aead.Sealer] | None:
    """The sealers of a connection, ``(outgoing, incoming)``, or None when it is not sealed.

    Args:
        key: the cluster's 32-byte key of these links.
        client, server: each end's ``(nonce, terms)``.
        identity: the client's identity, as sent in its hello.
        outgoing: this end's direction, ``"c2s"`` (the client) or ``"s2c"``.

    Raises:
        PermissionError: a malformed terms byte, or encryption is asked for and the two
            ends share no cipher.
    """
    if client[1][0] > 1 or server[1][0] > 1:
        raise PermissionError("malformed handshake terms")
    if not (client[1][0] or server[1][0]):
        return None
    cipher = _aead.choose(client[1][1], server[1][1])
    if cipher is None:
        raise PermissionError("encryption was asked for and the two ends share no cipher")
    keys = [mac(key, b"k-" + way, client[0], server[0], identity, cipher.encode()) for way in (b"c2s", b"s2c")]
    out, into = keys if outgoing == "c2s" else keys[::-1]
    return _aead.Sealer(out, cipher), _aead.Sealer(into, cipher)
