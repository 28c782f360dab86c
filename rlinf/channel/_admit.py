"""The client side of pacing: ``async with ch.admit(version, n=1):`` (see :mod:`._pacing`).

An :class:`Admission` asks the channel for ``n`` places when its block is entered and
holds them while the block runs. Each ``put`` on the same handle inside the block (in
the same task: the admission lives in a context variable) takes one of them: it carries
the admission's id and its version, and the server counts the item; a put beyond ``n``
raises. Leaving the block tells the server, which frees the places not put (nothing,
once all ``n`` were put). A put still waiting for space (``maxsize``) when the block
exits goes first: the exit is told after it is sent (or withdrawn), so the server never
frees a place that a put is about to take. The server also ends the admissions of a
handle that detaches or dies.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..core import wire

__all__ = ["Admission", "check_count", "check_version", "current_admission"]

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


def check_count(n: Any, span: int | None) -> int:
    """``n``, the places of one admission, as an int.

    Raises:
        TypeError: not an int. ValueError: < 1, or more than ``span`` (the places one
            version's window holds, ``(max_staleness + 1) * batch_size``: it could
            never be granted).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 1 or (span is not None and n > span):
        raise ValueError(f"n must be an int in [1, (max_staleness + 1) * batch_size = {span}], got {n}")
    return n


def current_admission(handle: Any) -> Admission | None:
    """The admission of ``handle`` whose block the calling task is in, or None."""
    admission = _current.get()
    if admission is None or admission.handle is not handle:
        return None
    return admission


class Admission:
    """``async with ch.admit(version, n=1):`` — made by :meth:`rlinf.channel.Channel.admit`.

    Attributes:
        version: the policy version the producer asked with.
        current: the channel's current version when it was admitted (what the trainer
            is at). A producer whose ``version`` is older should refresh its weights to
            it before generating: pacing bounds the staleness of rollouts made with a
            version ``>= current``, and the rollout counts as made with it.
        made_with: ``max(version, current)``, the default ``version`` of the puts
            inside the block.
        n: the places it holds (items its block may put).
        puts: puts inside the block so far (each took a place; a put withdrawn after a
            timeout or cancellation gives it back).
        used: every place was put (the admission ended with its last put).
        rid: the admission's id on the server (0: the channel does not pace).
    """

    def __init__(self, handle: Any, version: int, n: int, timeout: float | None) -> None:
        self.handle = handle
        self.version = version
        self.n = n
        self.timeout = timeout
        self.current = version
        self.rid = 0
        self.puts = 0
        self._queued = 0              # puts waiting for space: the exit is told after them
        self._exited = False
        self._token: contextvars.Token | None = None

    @property
    def made_with(self) -> int:
        return max(self.version, self.current)

    @property
    def used(self) -> bool:
        return self.puts >= self.n

    def __repr__(self) -> str:
        return (f"<Admission version={self.version} current={self.current} n={self.n} puts={self.puts} "
                f"rid={self.rid}>")

    def take(self, version: int | None) -> tuple[int, int]:
        """A put inside the block takes a place: its version (``version``, else
        :attr:`made_with`) and the admission's id.

        Raises:
            ValueError: all ``n`` places were put already.
        """
        if self.puts >= self.n:
            raise ValueError(f"admission for n={self.n} item(s): a put beyond them inside its block "
                             "(ask admit(version, n=...) for a group)")
        self.puts += 1
        return (self.made_with if version is None else version), self.rid

    def queued(self) -> None:
        """Its last put waits for space (the handle calls :meth:`settled` once it is
        sent or withdrawn)."""
        self._queued += 1

    def settled(self, withdrawn: bool) -> None:
        """A put that waited for space was sent, or ``withdrawn`` (its place is free
        again); once none waits and the block has exited, the server is told."""
        self._queued -= 1
        if withdrawn:
            self.puts -= 1
        if self._exited and not self._queued and self.rid:
            self.handle._admit_release(self.rid)

    async def __aenter__(self) -> Admission:
        self.rid, self.current = await self.handle._admit_wait(self.version, self.n, self.timeout)
        self._token = _current.set(self)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        self._exited = True
        if self.rid and not self._queued:
            self.handle._admit_release(self.rid)
