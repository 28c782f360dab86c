"""``comm.internal``: the Communicator's side of :class:`rlinf.core.interface.Core`."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from . import wire
from ..codec import Codec
from ..info import WorkerInfo

__all__ = ["CoreAccess"]


class CoreAccess:
    """The core's interface for rlinf's subsystems (see :mod:`rlinf.core.interface`),
    over one communicator."""

    __slots__ = ("_comm", "address", "incarnation", "manager_address", "token", "codec", "__weakref__")

    def __init__(self, comm: Any, token: str, codec: Codec) -> None:
        self._comm = comm
        self.address = comm.address
        self.incarnation = comm.incarnation
        self.manager_address = comm.manager_address
        self.token = token
        self.codec = codec

    def __repr__(self) -> str:
        return f"<CoreAccess {self.address}>"

    @property
    def info(self) -> WorkerInfo | None:
        return self._comm.info

    def check_open(self) -> None:
        self._comm._check_open()

    def start_send(self, obj: Any, dst: str, tag: str) -> asyncio.Future:
        return self._comm._enqueue(obj, dst, tag, wire.USER, need_future=True)

    async def multicast(self, obj: Any, dsts: list[str], tag: str) -> None:
        await self._comm._multicast(obj, dsts, tag)

    async def recv(self, src: str, tag: str, timeout: float | None = None) -> Any:
        return await self._comm._recv_tagged(src, tag, timeout)

    async def recv_any(self, tag: str, timeout: float | None = None) -> tuple[Any, str]:
        return await self._comm._recv_any_tagged(tag, timeout)

    def take_queued(self, tag: str, visit: Callable[[Any, str], None]) -> None:
        comm = self._comm
        mailbox = comm._mailbox
        pulled = []    # still being read from its sender's memory: left queued
        try:
            while (msg := mailbox.get_nowait(None, tag)) is not None:
                if msg.pulling is not None:
                    pulled.append(msg)
                    continue
                visit(comm._decode(msg), msg.src)
        finally:
            for msg in reversed(pulled):
                mailbox.put_back(msg)

    def retire(self, tag: str) -> None:
        self._comm._mailbox.retire(tag)

    def is_lost(self, address: str) -> bool:
        return self._comm._mailbox.is_lost(address) is not None

    def roster(self) -> list[WorkerInfo]:
        return list(self._comm._roster.values())

    async def lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        self.check_open()
        return await self._comm._control.lookup(address, wait=wait, timeout=timeout)

    def on_system(self, tag: str, handler: Callable[[str, Any], None]) -> None:
        self._comm.on_system(tag, handler)

    def on_peer_gone(self, hook: Callable[[str, str], None]) -> None:
        self._comm.on_peer_gone(hook)

    def add_closer(self, closer: Callable[[], Any]) -> None:
        self._comm.add_closer(closer)

    def add_stats_provider(self, name: str, provider: Callable[[], dict]) -> None:
        self._comm.add_stats_provider(name, provider)
