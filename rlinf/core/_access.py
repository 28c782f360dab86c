"""``comm.internal``: the Communicator's side of :class:`rlinf.core.interface.Core`."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from ..codec import Codec
from ..info import WorkerInfo, check_timeout
from . import wire
from ._mailbox import Mailbox
from ._membership import Departure
from ._receive import ReceivePath
from ._send import SendPath
from ._trace import Recorder

__all__ = ["CoreAccess"]


class CoreAccess:
    """The core's interface for rlinf's subsystems (see :mod:`rlinf.core.interface`),
    over one communicator: its public members, its send and receive paths, and the few
    checks of its own it is given.

    Args:
        comm: the communicator. token, codec: its cluster token and codec.
        send, receive: its send and receive paths. mailbox: its mailbox.
        roster: its peers by address.
        check_open: raises unless it is started and open.
        guard: that, and that this is its loop thread.
        lookup: ``lookup(address, wait=, timeout=)``: asks its manager.
        departed: ``departed(address, incarnation)``: how a peer went (its membership's).
        timeout: its default timeout (``Settings.timeout``, ``RLINF_TIMEOUT``; None: forever).
    """

    __slots__ = ("_comm", "_send", "_receive", "_mailbox", "_roster", "_guard", "_lookup", "_timeout", "departed",
                 "check_open", "address", "incarnation", "manager_address", "token", "codec", "trace", "__weakref__")

    def __init__(self, comm: Any, token: str, codec: Codec, send: SendPath, receive: ReceivePath, mailbox: Mailbox,
                 roster: dict[str, WorkerInfo], *, check_open: Callable[[], None], guard: Callable[[], None],
                 lookup: Callable[..., Awaitable[WorkerInfo | None]],
                 departed: Callable[[str, str], Departure | None], timeout: float | None = None) -> None:
        self._comm = comm
        self._timeout = timeout
        self._send, self._receive, self._mailbox, self._roster = send, receive, mailbox, roster
        self._guard, self._lookup = guard, lookup
        self.check_open = check_open
        self.departed = departed
        self.address = comm.address
        self.incarnation = comm.incarnation
        self.manager_address = comm.manager_address
        self.token = token
        self.codec = codec
        self.trace: Recorder | None = receive.trace     # (an attribute: checked on every channel put)

    def __repr__(self) -> str:
        return f"<CoreAccess {self.address}>"

    @property
    def info(self) -> WorkerInfo | None:
        return self._comm.info

    def timeout_of(self, timeout: Any) -> float | None:
        return check_timeout(timeout, self._timeout)

    def start_send(self, obj: Any, dst: str, tag: str) -> asyncio.Future:
        self._guard()
        return self._send.enqueue(obj, dst, tag, wire.USER, need_future=True)

    async def multicast(self, obj: Any, dsts: list[str], tag: str) -> None:
        self._guard()
        await self._send.multicast(obj, dsts, tag)

    async def recv(self, src: str, tag: str, timeout: float | None = None) -> Any:
        receive = self._receive
        return await receive.finish(await receive.get(src, tag, timeout))

    async def recv_any(self, tag: str, timeout: float | None = None) -> tuple[Any, str]:
        receive = self._receive
        msg = await receive.get(None, tag, timeout)
        return await receive.finish(msg), msg.src

    def take_queued(self, tag: str, visit: Callable[[Any, str], None]) -> None:
        self._receive.take_queued(tag, visit)

    def retire(self, tag: str) -> None:
        self._mailbox.retire(tag)

    def is_lost(self, address: str) -> bool:
        return self._mailbox.is_lost(address) is not None

    def roster(self) -> list[WorkerInfo]:
        return list(self._roster.values())

    async def lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        self.check_open()
        return await self._lookup(address, wait=wait, timeout=timeout)

    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        self._receive.on_system(tag, handler)

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        self._comm.on_peer_gone(hook)

    def add_closer(self, closer: Callable[[], Any]) -> None:
        self._comm.add_closer(closer)

    def add_drainer(self, drainer: Callable[[float], Awaitable[None]]) -> None:
        self._comm.add_drainer(drainer)

    def add_stats_provider(self, name: str, provider: Callable[[], dict]) -> None:
        self._comm.add_stats_provider(name, provider)
