"""The client side of pacing: ``async with ch.admit(version):`` (see :mod:`._pacing`).

An :class:`Admission` asks the channel for a place when its block is entered and holds
it while the block runs. The first ``put`` on the same handle inside the block (in the
same task: the admission lives in a context variable) carries the admission's id, which
ends it on the server: the item counts for good. Leaving the block always tells the
server too; an admission that already ended with its put is then left alone, one
without a put frees its place. The server also ends the admissions of a handle that
detaches or dies.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..core import wire

__all__ = ["Admission", "check_version", "current_admission"]

_current: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("rlinf_channel_admission", default=None)


def check_version(version: Any) -> int:
    """``version`` as an int.

    Raises:
        TypeError: not an int. ValueError: negative, or too large for the wire.
    """
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"a version must be an int, got {type(version).__name__}")
    if not 0 <= version <= wire.INT_MAX >> 1:
        raise ValueError(f"a version must be an int >= 0, got {version}")
    return version


def current_admission(handle: Any) -> Admission | None:
    """The admission of ``handle`` whose block the calling task is in and that has not
    put yet, or None."""
    admission = _current.get()
    if admission is None or admission.handle is not handle or admission.used:
        return None
    return admission


class Admission:
    """``async with ch.admit(version):`` — made by :meth:`rlinf.channel.Channel.admit`.

    Attributes:
        version: the policy version the rollout is made with (the default ``version``
            of the put inside the block).
        current: the channel's current version when it was admitted (what the trainer
            is at). A producer whose ``version`` is older should refresh its weights to
            it before generating: pacing bounds the staleness of rollouts made with a
            version ``>= current``.
        rid: the admission's id on the server (0: the channel does not pace).
        used: a put inside the block carried it (it ended with that put).
    """

    def __init__(self, handle: Any, version: int, timeout: float | None) -> None:
        self.handle = handle
        self.version = version
        self.timeout = timeout
        self.current = version
        self.rid = 0
        self.used = False
        self._token: contextvars.Token | None = None

    def __repr__(self) -> str:
        return f"<Admission version={self.version} current={self.current} rid={self.rid} used={self.used}>"

    async def __aenter__(self) -> Admission:
        self.rid, self.current = await self.handle._admit_wait(self.version, self.timeout)
        self._token = _current.set(self)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self.rid:
            self.handle._admit_release(self.rid)
