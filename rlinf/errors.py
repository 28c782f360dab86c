"""The whole rlinf exception tree.

Every error rlinf raises on purpose derives from :class:`RlinfError`. Native errors
(zmq, OSError, NCCL) are translated once, at a transport's edge, with ``raise ... from
exc`` so ``__cause__`` keeps the original. Bad arguments raise plain ``ValueError`` /
``TypeError`` instead.
"""

from __future__ import annotations

__all__ = [
    "RlinfError",
    "ClosedError",
    "PeerLostError",
    "CommTimeoutError",
    "TransportUnavailableError",
    "EncodeError",
    "DecodeError",
    "ProtocolError",
    "AuthenticationError",
    "WorkerFailedError",
    "WouldBlock",
    "EndOfChannel",
]


class RlinfError(Exception):
    """Base class of every error rlinf raises on purpose."""


class ClosedError(RlinfError):
    """The object was closed by us (communicator, channel, link); the call cannot run."""


class PeerLostError(RlinfError):
    """A peer died or the link to it broke. ``__cause__`` keeps the native error, if any.

    Attributes:
        peer: the address of the lost peer (``"group:rank"``), or None when unknown.
    """

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class AddressInUseError(RlinfError, ValueError):
    """A worker joining with ``exclusive=True`` found its address held by another live
    worker (without it, a second registration replaces the first, as a restart does)."""


class CommTimeoutError(RlinfError, TimeoutError):
    """An operation did not complete within its ``timeout``."""


class TransportUnavailableError(RlinfError):
    """A transport was asked for explicitly but cannot run here (missing package/device)."""


class EncodeError(RlinfError, TypeError):
    """An object cannot be encoded. ``path`` names where inside it, e.g. ``$["obs"][3]``."""

    def __init__(self, message: str, *, path: str = "$") -> None:
        super().__init__(f"{message} (at {path})")
        self.path = path


class DecodeError(RlinfError, ValueError):
    """A received message is malformed, truncated, too large or of the wrong version."""


class ProtocolError(RlinfError):
    """A peer broke the wire protocol (bad frame, bad version, unauthenticated data)."""


class AuthenticationError(RlinfError):
    """The cluster token was missing or wrong, so the manager or a peer refused us."""


class WorkerFailedError(RlinfError):
    """A remote worker raised or died. Carries its address and remote traceback.

    Attributes:
        address: the failed worker's address.
        remote_traceback: the formatted traceback from the worker process, or ``""``.
    """

    def __init__(self, message: str, *, address: str = "", remote_traceback: str = "") -> None:
        text = message
        if remote_traceback:
            text = f"{message}\n\nRemote traceback ({address}):\n{remote_traceback}"
        super().__init__(text)
        self.address = address
        self.remote_traceback = remote_traceback


class WouldBlock(RlinfError):
    """A ``*_nowait`` call could not complete at once (queue full or empty).

    Inside rlinf the same class says that a transport link cannot take a frame set now
    (``Link.try_send``); the communicator waits for room then, so that one never reaches
    its callers.
    """


class EndOfChannel(RlinfError):
    """The channel was closed and has been drained: no more items will come."""
