"""A communicator's CUDA IPC session, and what it keeps about one peer.

:class:`CudaIpcSession` joins the sender's slots and the reader's mappings of
:mod:`.ipc` to the notices the two sides exchange (slots given back, slots retired,
slots refused). What it keeps about one peer, the notices it owes it and the event a
send waiting for one of our slots back waits on, is one :class:`CudaPeer` (a
:class:`~rlinf.transports.base.PeerState`), handed out by :meth:`CudaIpcSession.peer`
and closed once, when the peer left or its process is gone: that also forgets our slots
for it and its slots here. (A peer only taken for lost keeps them, and goes on with
them if it comes back.)

Buffer lifetime: see :mod:`.ipc`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from .ipc import OPEN_STALL, STALL, CudaIpcReader, CudaIpcSender

log = logging.getLogger("rlinf.transports.cuda.ipc")

__all__ = ["CudaIpcSession", "CudaPeer"]


class CudaPeer:
    """What a :class:`CudaIpcSession` keeps about one peer (by address), beyond the
    slots the sender's pool and the reader keep for its address.

    Attributes:
        address: the peer's.
        owed: notices owed to it (releases of its slots, news of our retired slots,
            refusals), not sent yet.
        room: set on each notice from it (a send waiting for one of our slots back
            waits on it); None until a send waited.
        closed: it is gone.
    """

    __slots__ = ("address", "owed", "room", "closed", "_session")

    def __init__(self, session: CudaIpcSession, address: str) -> None:
        self.address = address
        self.owed: list = []
        self.room: asyncio.Event | None = None
        self.closed = False
        self._session = session

    def __repr__(self) -> str:
        return f"<CudaPeer {self.address} owed={len(self.owed)}{' closed' if self.closed else ''}>"

    def close(self, *, process_gone: bool = False, incarnation: str | None = None) -> None:
        """It left or its process is gone: forget our slots for it (freed at once when
        ``process_gone``; else once it unmapped them) and its slots here (those of
        ``incarnation``, or all). Idempotent."""
        if not self.closed:
            self.closed = True
            self._session._forget(self, process_gone=process_gone, incarnation=incarnation)


class CudaIpcSession:
    """A communicator's CUDA IPC state: its slots, the slots it opened, and what it owes
    each peer (releases of its slots, news of our retired slots): that goes out with our
    next message to the peer if one is sent in the same loop turn (:meth:`take`), else
    together in one notice per peer.

    Created on the first GPU message sent or received, so a process that never touches
    a GPU never initialises CUDA.

    Args:
        loop: the communicator's loop.
        send_notice: ``send_notice(dst, items)`` sends a SYSTEM ``"cuda"`` message; it may
            raise an :class:`~rlinf.errors.RlinfError` when ``dst`` is gone.
        incarnation: ours (releases name the incarnation whose slot they return).
        views: receivers keep zero-copy views (else owned copies).
        cap: bytes of slots per receiver (``RLINF_CUDA_IPC_CAP``; default :data:`.ipc.DEFAULT_CAP`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, send_notice: Callable[[str, Any], None],
                 incarnation: str, *, views: bool = True, cap: int | None = None, torch: Any = None) -> None:
        self.sender = CudaIpcSender(cap, torch=torch)
        self.reader = CudaIpcReader(loop, self._owe, views=views, torch=torch)
        self.incarnation = incarnation
        self.peers: dict[str, CudaPeer] = {}     # what we keep about each peer, by address
        self._owing: dict[str, CudaPeer] = {}    # those we owe notices, in the order they became owed
        self._loop = loop
        self._send_notice = send_notice
        self._flush_scheduled = False

    def __repr__(self) -> str:
        return f"<CudaIpcSession {self.sender!r} {self.reader!r}>"

    def peer(self, address: str) -> CudaPeer:
        """What we keep about ``address`` (made on first use; a closed one is replaced:
        a restarted peer starts afresh)."""
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = CudaPeer(self, address)
        return peer

    # -- sending side
    def export(self, buffers: Sequence[Any], places: Sequence[int], reader: str, peer_device: int) -> list | None:
        """:meth:`CudaIpcSender.export`; the slots it retired to make room are news owed
        to ``reader``."""
        gpu = self.sender.export(buffers, places, reader, peer_device)
        retired = self.sender.retired.pop(reader, None)
        if retired:
            for slot in retired:
                self._owe(reader, ["retire", slot, self.incarnation])
            self.sender.collect()       # slots retired earlier, unmapped there by now
        return gpu

    def behind(self, reader: str) -> bool:
        """``reader`` holds many of our slots: the next send waits a little for one back."""
        return self.sender.behind(reader)

    async def room(self, reader: str) -> None:
        """Wait for ``reader`` to give back a slot: at most :data:`.ipc.STALL` seconds, or
        :data:`.ipc.OPEN_STALL` while it may still be opening new ones."""
        peer = self.peer(reader)
        if peer.room is None:
            peer.room = asyncio.Event()
        event = peer.room
        event.clear()
        try:
            await asyncio.wait_for(event.wait(), self.stall(reader))
        except asyncio.TimeoutError:
            pass

    def stall(self, reader: str) -> float:
        """How long :meth:`room` waits for ``reader``."""
        return OPEN_STALL if self.sender.opening(reader) else STALL

    def on_notice(self, src: str, items: Any) -> None:
        """A SYSTEM ``"cuda"`` notice from ``src``: slots of ours it gave back, slots of
        its own it retired."""
        if not isinstance(items, list):
            log.warning("rlinf: malformed CUDA IPC notice from %s", src)
            return
        for item in items:
            if _is_release(item):
                if item[4] != self.incarnation:
                    continue            # a slot of our previous incarnation's: nothing to do
                if not self.sender.release(src, *item[:4]):
                    log.warning("rlinf: CUDA IPC release of a slot %s does not hold: %r", src, item[:2])
            elif _is_retire(item):
                self.reader.retire(src, item[2], item[1])
            elif _is_reject(item):
                if item[3] == self.incarnation:
                    self.sender.reject(src, item[1], item[2])
            else:
                log.warning("rlinf: malformed CUDA IPC notice item from %s", src)
        peer = self.peers.get(src)
        if peer is not None and peer.room is not None:
            peer.room.set()

    # -- what we owe peers
    @property
    def owed(self) -> int:
        """How many peers we owe notices."""
        return len(self._owing)

    def take(self, dst: str) -> list | None:
        """The notices owed to ``dst``, to send ahead of our next message to it."""
        peer = self._owing.pop(dst, None)
        if peer is None:
            return None
        items, peer.owed = peer.owed, []
        return items

    def _owe(self, dst: str, item: list) -> None:
        peer = self.peer(dst)
        peer.owed.append(item)
        self._owing[dst] = peer
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send what is owed to each peer, one notice per peer."""
        self._flush_scheduled = False
        owing, self._owing = self._owing, {}
        for dst, peer in owing.items():
            items, peer.owed = peer.owed, []
            if not items or peer.closed:
                continue
            try:
                self._send_notice(dst, items)
            except Exception as exc:
                # Taken for lost (or closing): kept for its return, sent with the next
                # message to it; dropped when it is gone (CudaPeer.close).
                log.debug("rlinf: CUDA IPC notices to %s held back: %r", dst, exc)
                peer.owed[:0] = items
                self._owing[dst] = peer

    def peer_gone(self, address: str, incarnation: str | None, *, process_gone: bool) -> None:
        """``address`` (``incarnation``) left or its process is gone: close what we keep
        about it (:meth:`CudaPeer.close`)."""
        self.peer(address).close(process_gone=process_gone, incarnation=incarnation)

    def _forget(self, peer: CudaPeer, *, process_gone: bool, incarnation: str | None) -> None:
        """``peer`` closed: our slots for its address and its slots here go, and so do
        the notices owed to it; a send waiting for room there goes on."""
        address = peer.address
        if self.peers.get(address) is peer:
            del self.peers[address]
        if self._owing.get(address) is peer:
            del self._owing[address]
        peer.owed = []
        self.sender.reader_gone(address, process_gone=process_gone)
        self.reader.peer_gone(address, incarnation)
        if peer.room is not None:
            peer.room.set()

    def close(self) -> None:
        self.flush()
        self.sender.close()
        self.reader.close()


def _is_release(item: Any) -> bool:
    return (isinstance(item, list) and len(item) == 5 and type(item[0]) is int and type(item[1]) is int
            and (item[2] is None or type(item[2]) is bytes) and type(item[3]) is bool and type(item[4]) is str)


def _is_reject(item: Any) -> bool:
    return (isinstance(item, list) and len(item) == 4 and item[0] == "reject" and type(item[1]) is int
            and type(item[2]) is int and type(item[3]) is str)


def _is_retire(item: Any) -> bool:
    return (isinstance(item, list) and len(item) == 3 and item[0] == "retire" and type(item[1]) is int
            and type(item[2]) is str)
