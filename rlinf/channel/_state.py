"""What the channel core keeps: items, client handles, and the handles' get requests.

Plain records, no logic beyond their own bookkeeping; :mod:`rlinf.channel._core` owns
the rules that move items between them.
"""

from __future__ import annotations

import collections
from typing import Any

from .policies import ConsumerInfo, ItemInfo, SpeedMeter

__all__ = ["Item", "Handle", "Request", "insert_by_id"]


class Item:
    """One item in the channel: id (put order), weight, key, the producer's opaque
    payload, its size and producer; ``ack``: taken with ``get(ack=True)``; ``version``:
    the policy version that made it (None: not versioned); ``paced``: it took an
    admission's place; ``handed``: it was handed out once (staleness recorded)."""

    __slots__ = ("id", "weight", "key", "payload", "nbytes", "producer", "ack", "version", "paced", "handed")

    def __init__(self, item_id: int, weight: float, key: Any, payload: Any, nbytes: int, producer: str,
                 version: int | None = None, paced: bool = False) -> None:
        self.id = item_id
        self.version = version
        self.paced = paced
        self.handed = False
        self.weight = weight
        self.key = key
        self.payload = payload
        self.nbytes = nbytes
        self.producer = producer
        self.ack = False

    def info(self) -> ItemInfo:
        return ItemInfo(self.id, self.weight, self.key, self.nbytes, self.producer)

    def __repr__(self) -> str:
        return f"<Item {self.id} w={self.weight} key={self.key!r}>"


class Request:
    """One ``get`` of a handle waiting for an answer (``rid``) with items of ``key``."""

    __slots__ = ("rid", "key", "max_items", "target")

    def __init__(self, rid: int, key: Any, max_items: int | None, target: float | None) -> None:
        self.rid = rid
        self.key = key
        self.max_items = max_items
        self.target = target


class Handle:
    """One client handle (a ``Channel`` object in some worker): producer and/or consumer."""

    def __init__(self, src: str, hid: int, incarnation: str, node_id: str, name: str, now: float) -> None:
        self.src, self.hid, self.incarnation, self.node_id, self.name = src, hid, incarnation, node_id, name
        self.dead = False
        self.lost = False        # taken for lost: suspended until it is back or forgotten
        self.suspensions = 0     # times it was taken for lost (which suspension a hold timer is for)
        self.joined = now
        # producer side (maxsize > 0): space leased to it, and puts waiting for space
        self.leased = 0
        self.want = 0
        self.revoking = False
        self.puts = 0
        self.rejected = 0
        # consumer side
        self.consumer = False
        self.keys: set = set()
        self.assigned: dict[Any, collections.deque[Item]] = {}
        self.inflight: dict[int, Item] = {}
        self.working: dict[int, Item] = {}
        self.requests: dict[Any, collections.deque[Request]] = {}
        self.credit: dict[Any, int] = {}
        self.pending_count = 0
        self.pending_weight = 0.0
        self.consumed_count = 0
        self.consumed_weight = 0.0
        self.meter = SpeedMeter()
        self.busy: collections.deque[list] = collections.deque()     # [bucket, busy seconds]
        self.busy_fraction = 0.0
        self.free_memory: int | None = None
        self.staleness: Any = None      # a _pacing.Staleness once it got a versioned item
        self.placed_speed: float | None = None   # its speed when a batch policy last placed items (_balance)
        self.sent_at = now              # when it was last sent items
        self.last_sent: dict[Any, int] = {}     # key -> the newest item id sent (batch policies)
        self.rate = [0.0, 0.0]          # decayed sums of weight done and its seconds (_balance)
        self.hint: float | None = None  # the speed it declared, until measured
        self.ahead: Any = None          # an _ahead.Ahead once it was answered under a batch policy

    def __repr__(self) -> str:
        return f"<Handle {self.name} pending={self.pending_count} leased={self.leased}>"

    def wants(self, key: Any) -> bool:
        return bool(self.requests.get(key)) or self.credit.get(key, 0) > 0

    @property
    def waiting(self) -> bool:
        return any(self.requests.values()) or any(n > 0 for n in self.credit.values())

    def add_pending(self, count: int, weight: float) -> None:
        """``count`` items of total ``weight`` more (or, negative, fewer) pending here."""
        self.pending_count += count
        self.pending_weight += weight
        if self.pending_count == 0:
            self.pending_weight = 0.0   # no float drift when idle

    def snapshot(self) -> ConsumerInfo:
        return ConsumerInfo(self.name, self.node_id, self.pending_count, self.pending_weight,
                            self.consumed_count, self.consumed_weight, self.meter.value or self.hint,
                            self.busy_fraction, self.free_memory, self.waiting)


def insert_by_id(queues: dict[Any, collections.deque[Item]], key: Any, item: Item) -> None:
    """Put ``item`` in ``queues[key]`` (made when missing), which stays in id order."""
    queue = queues.get(key)
    if queue is None:
        queues[key] = collections.deque((item,))
    elif not queue or queue[-1].id < item.id:     # the usual case: a new item, the newest
        queue.append(item)
    else:                                         # a returned item goes back in its place
        for i, other in enumerate(queue):
            if other.id > item.id:
                queue.insert(i, item)
                return
        queue.append(item)
