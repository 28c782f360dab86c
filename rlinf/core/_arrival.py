"""Keeping call order across two transports: ZeroMQ and the bulk TCP stream.

A sender's messages to one peer leave in call order, but a large one may travel the
bulk stream (``rlinf/transports/tcp_bulk.py``) while the others go through ZeroMQ, and
the two reach the receiver's event loop independently. Two rules restore the order:

* **Large, then anything:** the sender sends nothing more to that peer until the
  receiver acknowledged the bulk frame set, which it does only once the frame set is
  delivered (or parked, below). See ``rlinf/core/_outbox.py``.
* **Anything, then large:** every bulk frame set starts with the number of ZeroMQ frame
  sets the sender had sent to this peer before it (:func:`bulk_header`). The receiver
  counts the ZeroMQ frame sets it received from each sender and *parks* a bulk frame
  set until that count is reached, then delivers it, before the next ZeroMQ one.

ZeroMQ does not lose frame sets between live peers, so a parked frame set waits only
for frame sets already on their way; if one never comes (a connection dropped by the
network), the parked frame set is delivered after :data:`GRACE` seconds with a warning
rather than held forever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from typing import Callable

from ..transports.base import Received

__all__ = ["ArrivalOrder", "bulk_header", "GRACE"]

log = logging.getLogger("rlinf.core.communicator")

_ORDER = struct.Struct("!Q")
#: Seconds a bulk frame set waits for the ZeroMQ frame sets sent before it.
GRACE = 5.0


def bulk_header(zmq_sent: int, header: bytes) -> bytes:
    """The header of a bulk frame set: ``zmq_sent`` (ZeroMQ frame sets sent to the peer
    before it), then the wire header."""
    return _ORDER.pack(zmq_sent) + header


class ArrivalOrder:
    """The receiver's side: counts ZeroMQ frame sets per sender and parks bulk ones.

    Args:
        deliver: handles one frame set (wire header first), in order.
        loop: where the grace timers run.
    """

    def __init__(self, deliver: Callable[[Received], None], loop: asyncio.AbstractEventLoop) -> None:
        self._deliver = deliver
        self._loop = loop
        self._counts: dict[bytes, int] = {}
        self._parked: dict[bytes, collections.deque[tuple[int, Received]]] = {}

    def __repr__(self) -> str:
        return f"<ArrivalOrder senders={len(self._counts)} parked={sum(map(len, self._parked.values()))}>"

    def zmq(self, received: Received) -> None:
        """Handler of the ZeroMQ listener."""
        peer = received.peer
        count = self._counts[peer] = self._counts.get(peer, 0) + 1
        self._deliver(received)      # may forget the peer (its goodbye): counted first
        if self._parked:
            parked = self._parked.get(peer)
            if parked:
                self._release(peer, parked, count)

    def bulk(self, received: Received) -> None:
        """Handler of the bulk listener: deliver now, or park until the ZeroMQ frame sets
        sent before it arrived."""
        header = received.header
        if len(header) < _ORDER.size:
            log.warning("rlinf: dropped a bulk frame set without its order")
            return
        (after,) = _ORDER.unpack_from(header)
        received.header = header[_ORDER.size:]
        peer = received.peer
        parked = self._parked.get(peer)
        if not parked and self._counts.get(peer, 0) >= after:
            self._deliver(received)
            return
        if parked is None:
            parked = self._parked[peer] = collections.deque()
        parked.append((after, received))
        self._loop.call_later(GRACE, self._overdue, peer, received)

    def _release(self, peer: bytes, parked: collections.deque, count: int) -> None:
        while parked and parked[0][0] <= count:
            self._deliver(parked.popleft()[1])
        if not parked:
            del self._parked[peer]

    def _overdue(self, peer: bytes, received: Received) -> None:
        parked = self._parked.get(peer)
        if not parked or all(r is not received for _, r in parked):
            return
        log.warning("rlinf: a bulk frame set from %s waited %.0f s for ZeroMQ frame sets sent before it; "
                    "delivering it now", peer.decode(errors="replace"), GRACE)
        while parked:
            after, r = parked.popleft()
            self._counts[peer] = max(self._counts.get(peer, 0), after)
            self._deliver(r)
            if r is received:
                break
        if not parked:
            self._parked.pop(peer, None)

    def forget(self, peer: bytes) -> None:
        """A sender's incarnation is gone: drop its count and what it parked."""
        self._counts.pop(peer, None)
        self._parked.pop(peer, None)
