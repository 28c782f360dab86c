"""Authenticated encryption for bulk TCP streams, from libsodium through ctypes.

The library is the libsodium that pyzmq's wheels bundle for CURVE (``pyzmq.libs/``),
else the system's. Three AEADs, in order of preference (single-core rates on this
project's 2-vCPU machines, 16 MiB records):

==========================  ==========  =======================================
cipher                      ~GB/s       needs
==========================  ==========  =======================================
``aegis256``                4.4         libsodium >= 1.0.19 (software fallback
                                        without AES instructions)
``aes256gcm``               1.4-2.4     AES and CLMUL instructions
``chacha20poly1305_ietf``   0.8         any libsodium
==========================  ==========  =======================================

Each end offers the set it can run (:func:`offered`, a bit mask); a connection uses the
first of the list both ends offer (:func:`choose`). ctypes releases the GIL during each
call, so the bulk sender's and reader's threads encrypt without stopping the loop.

Each :class:`Sealer` is one direction of one connection: a 32-byte key used with a
counter nonce that never repeats (a key is made per connection, from both ends' fresh
nonces; see :mod:`.tcp_bulk`). Records are sealed into a separate buffer and opened in
place; a record that fails its tag raises and the connection is dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from typing import Any

import numpy as np

__all__ = ["available", "offered", "choose", "Sealer", "AuthenticationFailed", "CIPHERS"]

#: Every cipher this module knows, in order of preference; bit ``i`` of an offer is
#: ``CIPHERS[i]``.
CIPHERS = ("aegis256", "aes256gcm", "chacha20poly1305_ietf")
_U8 = np.uint8


class AuthenticationFailed(ValueError):
    """A record did not authenticate (tampered, truncated or out of order)."""


def _load() -> Any:
    candidates = []
    try:
        import zmq

        libs = os.path.join(os.path.dirname(os.path.dirname(zmq.__file__)), "pyzmq.libs")
        candidates += sorted(glob.glob(os.path.join(libs, "libsodium*.so*")))
    except ImportError:
        pass
    found = ctypes.util.find_library("sodium")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            if lib.sodium_init() < 0:
                continue
            return lib
        except OSError:
            continue
    return None


class _Cipher:
    """One AEAD's two functions and sizes."""

    def __init__(self, lib: Any, name: str) -> None:
        prefix = f"crypto_aead_{name}"
        self.name = name
        self.encrypt = getattr(lib, f"{prefix}_encrypt_detached")
        self.decrypt = getattr(lib, f"{prefix}_decrypt_detached")
        for fn in (self.encrypt, self.decrypt):
            fn.restype = ctypes.c_int
        # the same two functions typed for raw addresses (a call ~1 µs instead of ~10:
        # the small records of stream links); their own objects, so typing them does not
        # change how the ones above convert their arguments
        p, n, key = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_char_p
        self.encrypt_at = lib[f"{prefix}_encrypt_detached"]
        self.encrypt_at.argtypes = [p, p, p, p, n, p, n, p, key, key]
        self.decrypt_at = lib[f"{prefix}_decrypt_detached"]
        self.decrypt_at.argtypes = [p, p, p, n, p, p, n, key, key]
        for fn in (self.encrypt_at, self.decrypt_at):
            fn.restype = ctypes.c_int
        self.key_bytes = getattr(lib, f"{prefix}_keybytes")()
        self.nonce_bytes = getattr(lib, f"{prefix}_npubbytes")()
        self.tag_bytes = getattr(lib, f"{prefix}_abytes")()


class _Lib:
    """The loaded library and the ciphers it can run here (loaded on first use)."""

    def __init__(self) -> None:
        self.ciphers: dict[str, _Cipher] = {}
        lib = _load()
        if lib is None:
            return
        for name in CIPHERS:
            if name == "aes256gcm" and not lib.crypto_aead_aes256gcm_is_available():
                continue
            try:
                self.ciphers[name] = _Cipher(lib, name)
            except AttributeError:        # an older libsodium (AEGIS came in 1.0.19)
                continue


@functools.cache
def _lib() -> _Lib:
    """The library, loaded once per process (dlopen's own cache makes it one object)."""
    return _Lib()


def offered() -> int:
    """The bit mask of :data:`CIPHERS` this process can run (0 without libsodium)."""
    have = _lib().ciphers
    return sum(1 << i for i, name in enumerate(CIPHERS) if name in have)


def choose(mine: int, theirs: int) -> str | None:
    """The preferred cipher both offers hold, or None when they share none."""
    both = mine & theirs
    return next((name for i, name in enumerate(CIPHERS) if both >> i & 1), None)


def available() -> str | None:
    """The cipher this process prefers, or None when no libsodium can be loaded."""
    return choose(offered(), offered())


def _address(view: memoryview) -> int:
    return np.frombuffer(view, _U8, 0).ctypes.data if view.nbytes else 0


class Sealer:
    """One direction of one connection: seals or opens records in order.

    Args:
        key: 32 bytes, used by this direction only.
        cipher: one of :data:`CIPHERS` that this process offers.
    """

    __slots__ = ("_key", "_counter", "_cipher", "tag_bytes")

    def __init__(self, key: bytes, cipher: str) -> None:
        found = _lib().ciphers.get(cipher)
        if found is None:
            raise RuntimeError(f"cipher {cipher!r} is not available here")
        if len(key) != found.key_bytes:
            raise ValueError(f"a {cipher} key is {found.key_bytes} bytes")
        self._cipher = found
        self._key = key
        self._counter = 0
        #: The size of each record's tag.
        self.tag_bytes: int = found.tag_bytes

    def _nonce(self) -> bytes:
        self._counter += 1
        return self._counter.to_bytes(self._cipher.nonce_bytes, "little")

    def seal(self, src: memoryview, dst: memoryview) -> bytes:
        """Encrypt ``src`` into ``dst`` (at least as large); returns the record's tag."""
        n = src.nbytes
        tag = ctypes.create_string_buffer(self.tag_bytes)
        rc = self._cipher.encrypt(ctypes.c_void_p(_address(dst)), tag, None, ctypes.c_void_p(_address(src)),
                                  ctypes.c_ulonglong(n), None, ctypes.c_ulonglong(0), None,
                                  self._nonce(), self._key)
        if rc != 0:
            raise RuntimeError("encryption failed")
        return tag.raw

    def seal_at(self, address: int, n: int) -> None:
        """Encrypt the ``n`` bytes at ``address`` in place and write the tag right after
        them (the caller keeps that memory alive and writable)."""
        if self._cipher.encrypt_at(address, address + n, None, address, n, None, 0, None, self._nonce(), self._key):
            raise RuntimeError("encryption failed")

    def open_at(self, address: int, n: int, into: int) -> None:
        """Decrypt the ``n`` bytes at ``address``, whose tag follows them, into the
        memory at ``into`` (may be ``address``; the caller keeps both alive).

        Raises:
            AuthenticationFailed: the record is not the next one this key sealed.
        """
        if self._cipher.decrypt_at(into, None, address, n, address + n, None, 0, self._nonce(), self._key):
            raise AuthenticationFailed("a sealed record failed authentication")

    def open(self, buf: memoryview, tag: bytes) -> None:
        """Decrypt ``buf`` in place, checking ``tag``.

        Raises:
            AuthenticationFailed: the record is not the next one this key sealed.
        """
        address = ctypes.c_void_p(_address(buf))
        rc = self._cipher.decrypt(address, None, address, ctypes.c_ulonglong(buf.nbytes), tag,
                                  None, ctypes.c_ulonglong(0), self._nonce(), self._key)
        if rc != 0:
            raise AuthenticationFailed("a sealed record failed authentication")
