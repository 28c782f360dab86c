"""Request/answer calls between the parts of a weight store, over internal messages.

Every request is a tuple ``(op, req, *args)`` sent on the store's tag; the answer comes
back on the same tag as ``("value", req, result)`` or ``("error", req, kind, message)``.
:class:`Calls` numbers the requests of one communicator, keeps their futures, settles
them from the answers its reader passes in, and fails those addressed to a peer that is
gone. Loop thread only.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..core.interface import Core
from ..errors import ClosedError, PeerLostError, RlinfError
from ..util.futures import retrieve

__all__ = ["Calls", "error_message", "tag_of"]

_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                       "PeerLostError": PeerLostError, "ClosedError": ClosedError}


def tag_of(name: str) -> str:
    """The internal tag of store ``name``'s messages (str tags never meet a user's)."""
    return f"rlinf.weights.{name}"


def error_message(req: int, exc: BaseException) -> tuple:
    """The answer that carries ``exc`` to the caller of request ``req``."""
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "RlinfError"
    return ("error", req, kind, str(exc))


class Calls:
    """The requests one communicator has in flight to the store's other parts."""

    def __init__(self, core: Core, tag: str) -> None:
        self._core, self._tag = core, tag
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def next_id(self) -> int:
        """A request number for a request answered otherwise than by one message."""
        return next(self._ids)

    def start(self, dst: str, op: str, *args: Any) -> tuple[int, asyncio.Future]:
        """Send ``(op, req, *args)`` to ``dst``; the future gets its answer.

        Raises:
            PeerLostError: ``dst`` is known to be gone. ClosedError.
        """
        req = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        sent = self._core.start_send((op, req, *args), dst, self._tag)
        self._pending[req] = (dst, future)
        sent.add_done_callback(lambda f: self._sent(req, f))
        return req, future

    def _sent(self, req: int, sent: asyncio.Future) -> None:
        if sent.cancelled() or sent.exception() is None:
            return
        entry = self._pending.pop(req, None)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(sent.exception())

    def abandon(self, req: int) -> bool:
        """Forget ``req`` (its caller gave up); False if it was already answered."""
        entry = self._pending.pop(req, None)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def settle(self, message: tuple) -> bool:
        """Settle the call ``message`` answers; False if no call waits for it."""
        entry = self._pending.pop(message[1], None)
        if entry is None:
            return False
        future = entry[1]
        if future.done():
            return True
        if message[0] == "error":
            kind, text = message[2], message[3]
            future.set_exception(_ERRORS.get(kind, RlinfError)(text))
        else:
            future.set_result(message[2:] if len(message) > 3 else message[2])
        return True

    def fail(self, dst: str | None, exc: BaseException) -> None:
        """Fail the calls to ``dst`` (None: all of them) with ``exc``."""
        for req, (to, future) in list(self._pending.items()):
            if dst is None or to == dst:
                del self._pending[req]
                if not future.done():
                    future.set_exception(exc)
                    future.add_done_callback(retrieve)
