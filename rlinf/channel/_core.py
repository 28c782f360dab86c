"""The channel's state machine: queues, consumers, assignment and accounting. No I/O.

:class:`ChannelCore` is driven by the server (:mod:`rlinf.channel.server`) with the
operations each client handle sends, and answers through a ``send(handle, op)`` callback.
It never awaits, so every operation is atomic with respect to the event loop.

An item moves through these states (each is counted in exactly one place):

``shared[key]`` (nobody chosen yet)  or  ``handle.assigned[key]`` (chosen by the policy)
  -> ``handle.inflight`` (sent to the consumer, receipt not confirmed)
  -> ``handle.working`` (returned by its ``get``; not finished)
  -> finished (its next ``get`` without acks, ``task_done`` with acks).

A consumer that leaves or dies has its assigned and in-flight items (and, with acks,
its unfinished ones) put back in the queue in id order: no item is lost. An item
returned by ``get`` without ``ack`` counts as delivered and is not put back.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Callable

from .policies import ConsumerInfo, ItemInfo, LoadBalancePolicy, SpeedMeter, make_policy, select_checked

__all__ = ["ChannelCore", "Handle", "Item"]

log = logging.getLogger("rlinf.channel")

_BUSY_WINDOW = 10.0
_BUSY_BUCKET = 0.25
_RATE_WINDOW = 5


class Item:
    __slots__ = ("id", "weight", "key", "payload", "nbytes", "producer", "ack")

    def __init__(self, item_id: int, weight: float, key: Any, payload: Any, nbytes: int, producer: str) -> None:
        self.id = item_id
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


class _Request:
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
        self.requests: dict[Any, collections.deque[_Request]] = {}
        self.credit: dict[Any, int] = {}
        self.pending_count = 0
        self.pending_weight = 0.0
        self.consumed_count = 0
        self.consumed_weight = 0.0
        self.meter = SpeedMeter()
        self.busy: collections.deque[list] = collections.deque()     # [bucket, busy seconds]
        self.busy_fraction = 0.0
        self.free_memory: int | None = None

    def __repr__(self) -> str:
        return f"<Handle {self.name} pending={self.pending_count} leased={self.leased}>"

    def wants(self, key: Any) -> bool:
        return bool(self.requests.get(key)) or self.credit.get(key, 0) > 0

    @property
    def waiting(self) -> bool:
        return any(self.requests.values()) or any(n > 0 for n in self.credit.values())

    def add_pending(self, item: Item, sign: int) -> None:
        self.pending_count += sign
        self.pending_weight += sign * item.weight
        if self.pending_count == 0:
            self.pending_weight = 0.0   # no float drift when idle

    def snapshot(self) -> ConsumerInfo:
        return ConsumerInfo(self.name, self.node_id, self.pending_count, self.pending_weight,
                            self.consumed_count, self.consumed_weight, self.meter.value,
                            self.busy_fraction, self.free_memory, self.waiting)


def _insert_by_id(queue: collections.deque[Item], item: Item) -> None:
    if not queue or queue[-1].id < item.id:
        queue.append(item)
        return
    for i, other in enumerate(queue):
        if other.id > item.id:
            queue.insert(i, item)
            return
    queue.append(item)


class ChannelCore:
    """Queues and consumers of one channel.

    Args:
        name: the channel's name.
        maxsize: bound on items waiting in the channel (0: unbounded).
        policy: a policy spec for :func:`~rlinf.channel.policies.make_policy`.
        work_stealing: let a consumer with nothing to do take the last item assigned to
            the consumer expected to finish last, when it would finish it sooner.
        send: ``send(handle, op)`` delivers one op (a tuple) to a handle.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, name: str, *, maxsize: int = 0, policy: Any = "fifo", work_stealing: bool = False,
                 send: Callable[[Handle, tuple], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.maxsize = maxsize
        self.policy: LoadBalancePolicy = make_policy(policy)
        self.work_stealing = work_stealing
        self.send = send
        self.clock = clock
        self.started = clock()
        self.handles: dict[tuple[str, int], Handle] = {}
        self.shared: dict[Any, collections.deque[Item]] = {}
        self.consumers: dict[Any, list[Handle]] = {}       # per key, in join order
        self.wanting: dict[Any, collections.deque[Handle]] = {}
        self.key_len: dict[Any, int] = collections.defaultdict(int)
        self.key_weight: dict[Any, float] = collections.defaultdict(float)
        self.live: dict[Any, int] = collections.defaultdict(int)   # put, not yet delivered/finished
        self.live_total = 0
        self.queued = 0
        self.queued_weight = 0.0
        self.leased_total = 0
        self.want_queue: collections.deque[Handle] = collections.deque()
        self.soft_wants: collections.deque[Handle] = collections.deque()
        self.closed = False
        self.finished = False
        self.next_id = 1
        self.put_count = self.get_count = self.requeued = self.rejected = 0
        self.bytes_in = self.bytes_out = 0
        self._rates: collections.deque[list] = collections.deque()   # [second, puts, gets]
        self._deferred: set | None = None   # keys to serve once the current batch is applied

    def __repr__(self) -> str:
        return (f"<ChannelCore {self.name} queued={self.queued} live={self.live_total} "
                f"handles={len(self.handles)} closed={self.closed}>")

    # -- dispatch of client operations -----------------------------------------------------
    def handle_ops(self, src: str, hid: int, ops: list) -> None:
        """Apply the ops one client handle sent, in order.

        Raises:
            ValueError / TypeError / KeyError / IndexError: a malformed op (the server
                logs it as a protocol error; the ops before it were applied).
        """
        h = self.handles.get((src, hid))
        # Items put to the shared queue by this batch are handed out once it is applied:
        # a waiting consumer then gets them in one "items" op, not one op per item.
        self._deferred = deferred = set()
        try:
            for op in ops:
                kind = op[0]
                if kind == "hello":
                    h = self._hello(src, hid, *op[1:])
                    continue
                if h is None:
                    raise ValueError(f"op {kind!r} from {src} for unknown channel handle {hid}")
                method = self._OPS.get(kind)
                if method is None:
                    raise ValueError(f"unknown channel op {kind!r}")
                method(self, h, *op[1:])
        finally:
            self._deferred = None
            for key in deferred:
                self._serve_wanting(key)
        self._grant()

    def _hello(self, src: str, hid: int, rid: int, incarnation: str, node_id: str, name: str) -> Handle:
        old = self.handles.get((src, hid))
        if old is not None:
            self.remove(old)
        if any(h.name == name for h in self.handles.values()):
            name = f"{name}#{hid}"
        h = self.handles[(src, hid)] = Handle(src, hid, incarnation, node_id, name, self.clock())
        lease = 0
        if self.maxsize and not self.closed:
            lease = min(self._free(), self._lease_batch())
            h.leased = max(lease, 0)
            self.leased_total += h.leased
        self.send(h, ("info", rid, {"maxsize": self.maxsize, "policy": self.policy.name,
                                    "closed": self.closed, "lease": h.leased, "name": h.name}))
        return h

    def _op_put(self, h: Handle, key: Any, weight: float, nbytes: int, payload: Any) -> None:
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"bad weight {weight!r}")
        if h.leased > 0:
            h.leased -= 1
            self.leased_total -= 1
        if self.closed:
            self.rejected += 1
            h.rejected += 1
            self.send(h, ("rejected", 1))
            return
        item = Item(self.next_id, float(weight), key, payload, int(nbytes), h.src)
        self.next_id += 1
        h.puts += 1
        self.put_count += 1
        self.bytes_in += item.nbytes
        self._count_rate(0)
        self.live[key] += 1
        self.live_total += 1
        self._route(item)
        if self.maxsize and not self.want_queue and h.leased * 2 < self._lease_batch():
            top_up = min(self._free(), self._lease_batch() - h.leased)
            if top_up > 0:         # keep a producer that is putting supplied (revocable)
                self._lease(h, top_up)

    def _op_want(self, h: Handle, n: int, nowait: bool) -> None:
        if not self.maxsize:
            return
        if self.closed:
            self.send(h, ("closed",))
            return
        if nowait:                 # put_nowait found no lease: lease space now or once free
            free = self._free()
            if free > 0 and not self.want_queue:
                self._lease(h, min(free, max(1, self._lease_batch() - h.leased)))
            elif h not in self.soft_wants:
                self.soft_wants.append(h)
            return
        h.want += int(n)
        if h not in self.want_queue:
            self.want_queue.append(h)

    def _op_ret(self, h: Handle, n: int) -> None:
        n = min(int(n), h.leased)
        h.leased -= n
        self.leased_total -= n
        h.revoking = False

    def _op_get(self, h: Handle, rid: int, key: Any, max_items: int | None, target: float | None,
                memory: int | None) -> None:
        self._join(h, key, memory)
        h.requests.setdefault(key, collections.deque()).append(_Request(rid, key, max_items, target))
        self._serve(h, key)

    def _op_credit(self, h: Handle, key: Any, n: int, memory: int | None) -> None:
        self._join(h, key, memory)
        h.credit[key] = h.credit.get(key, 0) + int(n)
        self._serve(h, key)

    def _op_cancel(self, h: Handle, rid: int) -> None:
        for requests in h.requests.values():
            for r in requests:
                if r.rid == rid:
                    requests.remove(r)
                    return

    def _op_took(self, h: Handle, ids: list, ack: bool) -> None:
        for item_id in ids:
            item = h.inflight.pop(item_id, None)
            if item is None:
                continue
            item.ack = bool(ack)
            h.working[item_id] = item
            if not item.ack:
                self._retire(item)

    def _op_unget(self, h: Handle, ids: list) -> None:
        back = [h.inflight.pop(i) for i in ids if i in h.inflight]
        for item in back:
            h.add_pending(item, -1)
        self._requeue(back)

    def _op_done(self, h: Handle, ids: list, seconds: float) -> None:
        weight, first = 0.0, None
        for item_id in ids:
            item = h.working.pop(item_id, None)
            if item is None:
                continue
            first = first or item
            weight += item.weight
            h.add_pending(item, -1)
            h.consumed_count += 1
            h.consumed_weight += item.weight
            if item.ack:
                self._retire(item)
        if first is None or not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            return
        h.meter.update(weight, float(seconds))
        now = self.clock()
        bucket = int(now / _BUSY_BUCKET)          # busy seconds per 1/4 s: a bounded window
        busy = h.busy
        if busy and busy[-1][0] == bucket:
            busy[-1][1] += float(seconds)
        else:
            busy.append([bucket, float(seconds)])
            while busy[0][0] < bucket - _BUSY_WINDOW / _BUSY_BUCKET:
                busy.popleft()
        span = min(_BUSY_WINDOW, max(now - h.joined, 1e-9))
        h.busy_fraction = min(1.0, sum(b[1] for b in busy) / span)
        if seconds > 0:
            try:
                self.policy.on_consumed(h.name, ItemInfo(first.id, weight, first.key, first.nbytes,
                                                         first.producer), float(seconds))
            except Exception:   # a user policy's bug must not stop the channel
                log.exception("channel %s: policy %s.on_consumed failed", self.name, self.policy.name)

    def _op_close(self, h: Handle, rid: int) -> None:
        self.close()
        self.send(h, ("reply", rid, None))

    def _op_stats(self, h: Handle, rid: int) -> None:
        self.send(h, ("reply", rid, self.stats()))

    def _op_sync(self, h: Handle, rid: int) -> None:
        self.send(h, ("reply", rid, h.rejected))

    def _op_bye(self, h: Handle) -> None:
        self.remove(h)

    _OPS = {"put": _op_put, "want": _op_want, "ret": _op_ret, "get": _op_get, "credit": _op_credit,
            "cancel": _op_cancel, "took": _op_took, "unget": _op_unget, "done": _op_done,
            "close": _op_close, "stats": _op_stats, "sync": _op_sync, "bye": _op_bye}

    # -- membership ------------------------------------------------------------------------
    def _join(self, h: Handle, key: Any, memory: int | None) -> None:
        h.consumer = True
        if memory is not None:
            h.free_memory = int(memory)
        if key not in h.keys:
            h.keys.add(key)
            self.consumers.setdefault(key, []).append(h)

    def has_source(self, src: str) -> bool:
        return any(s == src for s, _ in self.handles)

    def gone(self, src: str, incarnation: str) -> None:
        """Every handle of ``src`` (that incarnation; any when empty) left or died."""
        for (s, _), h in list(self.handles.items()):
            if s == src and (not incarnation or h.incarnation == incarnation):
                self.remove(h)
        self._grant()

    def remove(self, h: Handle) -> None:
        """Forget a handle; put back every item it had not finished (see module docs)."""
        if h.dead:
            return
        h.dead = True
        self.handles.pop((h.src, h.hid), None)
        self.leased_total -= h.leased
        h.leased = 0
        try:
            self.want_queue.remove(h)
        except ValueError:
            pass
        back: list[Item] = []
        for key, queue in h.assigned.items():
            for item in queue:
                self._dequeue_count(item)
            back.extend(queue)
        h.assigned.clear()
        back.extend(h.inflight.values())
        h.inflight.clear()
        for item in h.working.values():
            if item.ack:
                item.ack = False
                back.append(item)
        h.working.clear()
        for key in h.keys:
            members = self.consumers.get(key)
            if members is not None and h in members:
                members.remove(h)
        h.requests.clear()
        h.credit.clear()
        back.sort(key=lambda it: it.id)
        self._requeue(back)
        for key in list(self.live):
            self._check_end(key)

    # -- placing items ---------------------------------------------------------------------
    def _route(self, item: Item) -> None:
        """Queue a new or returned item: to a consumer chosen by the policy, or shared."""
        key = item.key
        self.queued += 1
        self.queued_weight += item.weight
        self.key_len[key] += 1
        self.key_weight[key] += item.weight
        members = self.consumers.get(key)
        if self.policy.assigns and members:
            try:
                choice = select_checked(self.policy, item.info(), [c.snapshot() for c in members])
            except Exception:   # a user policy's bug must not stop the channel: fall back to FIFO
                log.exception("channel %s: policy %s failed; item %d goes to the shared queue",
                              self.name, self.policy.name, item.id)
            else:
                h = members[choice]
                _insert_by_id(h.assigned.setdefault(key, collections.deque()), item)
                h.add_pending(item, +1)
                self._serve(h, key)
                if self.work_stealing:
                    self._serve_wanting(key)
                return
        _insert_by_id(self.shared.setdefault(key, collections.deque()), item)
        if self._deferred is not None:
            self._deferred.add(key)
        else:
            self._serve_wanting(key)

    def _requeue(self, items: list[Item]) -> None:
        for item in items:
            self.requeued += 1
            self._route(item)

    def _dequeue_count(self, item: Item) -> None:
        self.queued -= 1
        self.queued_weight -= item.weight
        key = item.key
        self.key_len[key] -= 1
        self.key_weight[key] -= item.weight
        if self.key_len[key] == 0:
            self.key_weight[key] = 0.0
        if self.queued == 0:
            self.queued_weight = 0.0

    def _source(self, h: Handle, key: Any) -> collections.deque[Item] | None:
        """Where ``h``'s next item for ``key`` comes from: the older head of its own
        assigned queue and the shared queue; else (work stealing) a victim's tail."""
        mine = h.assigned.get(key)
        shared = self.shared.get(key)
        if mine and shared:
            return mine if mine[0].id < shared[0].id else shared
        if mine or shared:
            return mine or shared
        if self.work_stealing and self._steal(h, key):
            return h.assigned[key]
        return None

    def _steal(self, h: Handle, key: Any) -> bool:
        victims = [v for v in self.consumers.get(key, ()) if v is not h and v.assigned.get(key)]
        if not victims:
            return False
        speeds = self._speeds([h, *victims])
        ends = [v.pending_weight / speeds[i + 1] for i, v in enumerate(victims)]
        best = max(range(len(victims)), key=lambda i: ends[i])
        victim = victims[best]
        item = victim.assigned[key][-1]
        if (h.pending_weight + item.weight) / speeds[0] >= ends[best]:
            return False   # it would not finish sooner here
        victim.assigned[key].pop()
        victim.add_pending(item, -1)
        h.assigned.setdefault(key, collections.deque()).append(item)
        h.add_pending(item, +1)
        self.requeued += 1
        return True

    def _speeds(self, handles: list[Handle]) -> list[float]:
        known = [h.meter.value for h in handles if h.meter.value]
        fallback = sum(known) / len(known) if known else 1.0
        return [h.meter.value or fallback for h in handles]

    def _take(self, h: Handle, source: collections.deque[Item]) -> Item:
        item = source.popleft()
        self._dequeue_count(item)
        if source is not h.assigned.get(item.key):
            h.add_pending(item, +1)
        h.inflight[item.id] = item
        self.get_count += 1
        self.bytes_out += item.nbytes
        self._count_rate(1)
        return item

    # -- serving consumers -----------------------------------------------------------------
    def _serve(self, h: Handle, key: Any) -> None:
        """Give ``h`` what its requests and credit for ``key`` ask for, while items last."""
        while h.wants(key) and self._fill_one(h, key):
            pass
        if h.wants(key):
            if not self._check_end(key):
                wanting = self.wanting.setdefault(key, collections.deque())
                if h not in wanting:
                    wanting.append(h)

    def _serve_wanting(self, key: Any) -> None:
        """Hand items to waiting consumers of ``key`` in turn (FIFO competition)."""
        wanting = self.wanting.get(key)
        rounds = len(wanting) if wanting else 0
        while wanting and rounds > 0:
            h = wanting.popleft()
            if h.dead or not h.wants(key):
                rounds = len(wanting)
                continue
            if self._fill_one(h, key):
                rounds = len(wanting) + 1
            else:
                rounds -= 1
            if h.wants(key):
                wanting.append(h)

    def _fill_one(self, h: Handle, key: Any) -> bool:
        """Answer ``h``'s oldest request for ``key`` (or one unit of credit). False: nothing to give."""
        requests = h.requests.get(key)
        if requests:
            request = requests[0]
            items: list[Item] = []
            total = 0.0
            while True:
                source = self._source(h, key)
                if source is None:
                    break
                nxt = source[0]
                if items and ((request.max_items and len(items) >= request.max_items)
                              or (request.target is not None and total + nxt.weight > request.target)):
                    break
                items.append(self._take(h, source))
                total += nxt.weight
                if request.max_items and len(items) >= request.max_items:
                    break
            if not items:
                return False
            requests.popleft()
            self.send(h, ("items", request.rid, key, [(it.id, it.weight, it.payload) for it in items]))
            return True
        credit = h.credit.get(key, 0)
        if credit > 0:   # prefetch: as many items as the credit covers, in one op
            items = []
            while credit > 0:
                source = self._source(h, key)
                if source is None:
                    break
                items.append(self._take(h, source))
                credit -= 1
            if not items:
                return False
            h.credit[key] = credit
            self.send(h, ("items", 0, key, [(it.id, it.weight, it.payload) for it in items]))
            return True
        return False

    # -- end of channel ----------------------------------------------------------------------
    def _retire(self, item: Item) -> None:
        """``item`` left the channel for good (delivered, or finished under acks)."""
        key = item.key
        self.live[key] -= 1
        self.live_total -= 1
        item.payload = None
        if self.closed and self.live[key] == 0:
            self._check_end(key)

    def _check_end(self, key: Any) -> bool:
        """After close: once no item of ``key`` remains anywhere, end every get on it."""
        if not self.closed or self.live.get(key, 0) > 0:
            return False
        for h in self.consumers.get(key, ()):
            for request in h.requests.pop(key, ()):
                self.send(h, ("end", request.rid, key))
            if h.credit.pop(key, 0) > 0:
                self.send(h, ("end", 0, key))
        self.wanting.pop(key, None)
        if self.live_total == 0 and not self.finished:
            self.finished = True
            for h in list(self.handles.values()):
                self.send(h, ("drained",))
        return True

    def close(self) -> None:
        """No more puts: refuse them from now on; consumers drain, then get EndOfChannel."""
        if self.closed:
            return
        self.closed = True
        for h in list(self.handles.values()):
            self.send(h, ("closed",))
            h.want = 0
        self.want_queue.clear()
        self.soft_wants.clear()
        keys = set(self.live) | {k for h in self.handles.values() for k in h.requests} \
            | {k for h in self.handles.values() for k in h.credit}
        for key in keys:
            self._check_end(key)
        if self.live_total == 0 and not self.finished:
            self.finished = True
            for h in list(self.handles.values()):
                self.send(h, ("drained",))

    # -- space leases (maxsize > 0) ----------------------------------------------------------
    def _free(self) -> int:
        return self.maxsize - self.queued - self.leased_total

    def _lease_batch(self) -> int:
        return max(1, min(64, self.maxsize // 8))

    def _lease(self, h: Handle, n: int) -> None:
        h.leased += n
        self.leased_total += n
        self.send(h, ("grant", n))

    def _grant(self) -> None:
        """Give free space to producers waiting for it, oldest first; if none is free,
        ask idle lease holders to give theirs back."""
        if not self.maxsize or self.closed:
            return
        while self.want_queue and self._free() > 0:
            h = self.want_queue[0]
            n = min(self._free(), h.want)
            if n > 0:
                h.want -= n
                self._lease(h, n)
            if h.want <= 0:
                h.want = 0
                self.want_queue.popleft()
        if self.want_queue:
            for h in self.handles.values():
                if h.leased > 0 and h.want == 0 and not h.revoking:
                    h.revoking = True
                    self.send(h, ("revoke",))
            return
        while self.soft_wants and self._free() > 0:
            h = self.soft_wants.popleft()
            if not h.dead:
                self._lease(h, min(self._free(), max(1, self._lease_batch() - h.leased)))

    # -- introspection -----------------------------------------------------------------------
    def _count_rate(self, column: int) -> None:
        second = int(self.clock())
        rates = self._rates
        if not rates or rates[-1][0] != second:
            rates.append([second, 0, 0])
            while rates[0][0] <= second - _RATE_WINDOW:
                rates.popleft()
        rates[-1][column + 1] += 1

    def stats(self) -> dict[str, Any]:
        """A plain-value snapshot (see :class:`~rlinf.channel.stats.ChannelStats`)."""
        now = self.clock()
        uptime = now - self.started
        recent = [r for r in self._rates if r[0] > int(now) - _RATE_WINDOW]
        span = min(float(_RATE_WINDOW), max(uptime, 1.0))
        consumers, seen = [], set()
        for members in self.consumers.values():
            for h in members:
                if h in seen:
                    continue
                seen.add(h)
                consumers.append([h.name, h.node_id, h.pending_count, h.pending_weight,
                                  sum(1 for it in h.working.values() if it.ack), h.consumed_count,
                                  h.consumed_weight, h.meter.value, h.busy_fraction, h.free_memory,
                                  h.waiting])
        return {
            "name": self.name, "policy": self.policy.name, "maxsize": self.maxsize, "closed": self.closed,
            "length": self.queued, "weight": self.queued_weight,
            "keys": [[k, n, self.key_weight[k]] for k, n in self.key_len.items()],
            "consumers": consumers,
            "producers": sum(1 for h in self.handles.values() if h.puts),
            "put_count": self.put_count, "get_count": self.get_count,
            "requeued": self.requeued, "rejected": self.rejected,
            "put_rate": sum(r[1] for r in recent) / span, "get_rate": sum(r[2] for r in recent) / span,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "uptime": uptime,
        }
