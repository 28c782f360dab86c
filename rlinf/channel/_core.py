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
import math
import time
from typing import Any, Callable

from ..util.bounded import Doubling, Recent
from . import _ahead, _lost
from ._balance import place_shared, speed_changed, steal
from ._guard import PolicyGuard
from ._keys import forget_idle_keys
from ._pacing import Pacing
from ._snapshot import count_rate, snapshot
from ._state import Handle, Item, Request, insert_by_id
from .policies import ItemInfo, LoadBalancePolicy, make_policy

__all__ = ["ChannelCore"]

_BUSY_WINDOW = 10.0
_BUSY_BUCKET = 0.25


class ChannelCore:
    """Queues and consumers of one channel.

    Args:
        name: the channel's name.
        maxsize: bound on items waiting in the channel (0: unbounded).
        policy: a policy spec for :func:`~rlinf.channel.policies.make_policy`.
        work_stealing: let a consumer with nothing to do take the last item assigned to
            the consumer expected to finish last, when it would finish it sooner (None:
            the policy's default, ``LoadBalancePolicy.steals``).
        max_staleness, batch_size: the staleness bound and pacing (:mod:`._pacing`).
        send: ``send(handle, op)`` delivers one op (a tuple) to a handle.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, name: str, *, maxsize: int = 0, policy: Any = "fifo", work_stealing: bool | None = None,
                 max_staleness: int | None = None, batch_size: int | None = None,
                 send: Callable[[Handle, tuple], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.maxsize = maxsize
        self.policy: LoadBalancePolicy = make_policy(policy)
        self.guard = PolicyGuard(name, self.policy)     # counts (stats) and logs its failures
        self.work_stealing = self.policy.steals if work_stealing is None else work_stealing
        # a batch policy: a run of puts is placed at once, after it is applied (_balance)
        self.batching = type(self.policy).assign_batch is not LoadBalancePolicy.assign_batch
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
        self.keys_looked = Doubling()       # when to forget idle keys again (_keys)
        self.forgotten = Recent()            # (src, hid) -> the Handle forgotten while taken for lost
        self.pacing = Pacing(max_staleness, batch_size, lambda h, rid, value: send(h, ("reply", rid, value)))
        self.timers: list = []               # items to send ahead, recalls (_ahead: the server runs them)
        self.recalls: dict[Any, int] = {}    # key -> consumers with items of it ahead, a recall due (_ahead)

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
        if h is not None and h.lost:
            _lost.resume(self, h)
        # Items put to the shared queue by this batch are handed out once it is applied:
        # a waiting consumer then gets them in one "items" op, not one op per item.
        self._deferred = deferred = set()
        try:
            i, n = 0, len(ops)
            while i < n:
                op = ops[i]
                kind = op[0]
                if kind == "hello":
                    h = self._hello(src, hid, *op[1:])
                    i += 1
                    continue
                if h is None:
                    _lost.tell_forgotten(self, src, hid, kind)
                    return
                if kind == "put":          # a run of puts (a producer's loop) is applied at once
                    j = i + 1
                    while j < n and ops[j][0] == "put":
                        j += 1
                    self._puts(h, ops, i, j)
                    for key in deferred if self.batching else ():   # placed before the next op
                        place_shared(self, key)
                    i = j
                    continue
                method = self._OPS.get(kind)
                if method is None:
                    raise ValueError(f"unknown channel op {kind!r}")
                method(self, h, *op[1:])
                i += 1
        finally:
            self._deferred = None
            for key in deferred:
                if self.batching:
                    place_shared(self, key)
                self._serve_wanting(key)
        self._grant()
        if self.keys_looked.due(len(self.live)):
            forget_idle_keys(self)

    def _hello(self, src: str, hid: int, rid: int, incarnation: str, node_id: str, name: str,
               speed: float | None = None) -> Handle:
        old = self.handles.get((src, hid))
        if old is not None:
            self.remove(old)
        if any(h.name == name for h in self.handles.values()):
            name = f"{name}#{hid}"
        h = self.handles[(src, hid)] = Handle(src, hid, incarnation, node_id, name, self.clock())
        h.hint = float(speed) if isinstance(speed, (int, float)) and 0 < speed < math.inf else None
        lease = 0
        if self.maxsize and not self.closed:
            lease = min(self._free(), self._lease_batch())
            h.leased = max(lease, 0)
            self.leased_total += h.leased
        self.send(h, ("info", rid, {"maxsize": self.maxsize, "policy": self.policy.name,
                                    "closed": self.closed, "lease": h.leased, "name": h.name,
                                    "max_staleness": self.pacing.max_staleness,
                                    "batch_size": self.pacing.batch_size}))
        return h

    def _puts(self, h: Handle, ops: list, start: int, stop: int) -> None:
        """Apply the "put" ops ``ops[start:stop]`` of ``h``, in order.

        Per item only what differs per item is done here; the counters of the whole run
        are added once at the end (also when a malformed op stops it: the puts before it
        stay applied, like every op before a malformed one).
        """
        count = nbytes_in = rejected = 0
        live = self.live
        try:
            for index in range(start, stop):
                op = ops[index]      # ("put", key, weight, nbytes, payload[, version, admission])
                _kind, key, weight, nbytes, payload = op[:5]
                version, paced = self.pacing.put(h, op[5], op[6]) if len(op) > 5 else (None, False)
                if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                    raise ValueError(f"bad weight {weight!r}")
                if h.leased > 0:
                    h.leased -= 1
                    self.leased_total -= 1
                if self.closed:
                    rejected += 1
                    continue
                item = Item(self.next_id, float(weight), key, payload, int(nbytes), h.src, version, paced)
                live[key] += 1            # (an unhashable key fails here, before anything changed)
                self.next_id += 1
                self.live_total += 1
                count += 1
                nbytes_in += item.nbytes
                self._route(item)
                if self.maxsize and not self.want_queue and h.leased * 2 < self._lease_batch():
                    top_up = min(self._free(), self._lease_batch() - h.leased)
                    if top_up > 0:         # keep a producer that is putting supplied (revocable)
                        self._lease(h, top_up)
        finally:
            if count:
                h.puts += count
                self.put_count += count
                self.bytes_in += nbytes_in
                self._count_rate(0, count)
            if rejected:
                self.rejected += rejected
                h.rejected += rejected
                self.send(h, ("rejected", rejected))

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
                memory: int | None, now: bool = False) -> None:
        self._join(h, key, memory)
        if now:        # a batch taken from items sent ahead, topped up: never answered by them (_ahead)
            return _ahead.top_up(self, h, rid, key, max_items, target)
        if h.ahead is not None and _ahead.on_get(self, h, key, max_items, target):
            return                 # answered by items sent ahead to it (_ahead)
        h.requests.setdefault(key, collections.deque()).append(Request(rid, key, max_items, target))
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
        ack = bool(ack)
        inflight, working = h.inflight, h.working
        if h.ahead is not None and (h.ahead.ids or h.ahead.held):
            _ahead.on_took(self, h, [inflight[i] for i in ids if i in inflight])
        if ack or self.closed:
            for item_id in ids:
                item = inflight.pop(item_id, None)
                if item is not None:
                    item.ack = ack
                    working[item_id] = item
                    if not ack:
                        self._retire(item)
            return
        # Delivered for good, while open: _retire inlined (no key can end before close).
        live = self.live
        retired = 0
        for item_id in ids:
            item = inflight.pop(item_id, None)
            if item is not None:
                item.ack = False
                working[item_id] = item
                live[item.key] -= 1
                item.payload = None
                retired += 1
        self.live_total -= retired

    def _op_unget(self, h: Handle, ids: list) -> None:
        back = [h.inflight.pop(i) for i in ids if i in h.inflight]
        if h.ahead is not None:
            _ahead.on_unget(self, h, back)
        for item in back:
            h.add_pending(-1, -item.weight)
        self._requeue(back)

    def _op_done(self, h: Handle, ids: list, seconds: float) -> None:
        working = h.working
        weight, count, first = 0.0, 0, None
        for item_id in ids:
            item = working.pop(item_id, None)
            if item is None:
                continue
            if first is None:
                first = item
            count += 1
            weight += item.weight
            if item.ack:
                self._retire(item)
        if count:
            h.add_pending(-count, -weight)
            h.consumed_count += count
            h.consumed_weight += weight
        if first is None or not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            return
        h.meter.update(weight, float(seconds))
        if h.ahead is not None:
            _ahead.on_done(h, float(seconds))
        if self.batching:       # a first or a new speed: what waits may be placed (again)
            speed_changed(self, h, weight, float(seconds))
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
            self.guard.consumed(h.name, ItemInfo(first.id, weight, first.key, first.nbytes, first.producer),
                                float(seconds))

    def _op_close(self, h: Handle, rid: int) -> None:
        self.close()
        self.send(h, ("reply", rid, None))

    def _op_stats(self, h: Handle, rid: int) -> None:
        self.send(h, ("reply", rid, self.stats()))

    def _op_sync(self, h: Handle, rid: int) -> None:
        self.send(h, ("reply", rid, h.rejected))

    def _op_bye(self, h: Handle) -> None:
        self.remove(h)

    # ("put" runs are applied by _puts)
    _OPS = {"want": _op_want, "ret": _op_ret, "get": _op_get, "credit": _op_credit,
            "cancel": _op_cancel, "took": _op_took, "unget": _op_unget, "done": _op_done,
            "close": _op_close, "stats": _op_stats, "sync": _op_sync, "bye": _op_bye,
            "advance": lambda self, h, rid, v: self.send(h, ("reply", rid, self.pacing.advance(int(v)))),
            "admit": lambda self, h, rid, v, n=1: self.pacing.admit(h, int(rid), int(v), int(n)),
            "release": lambda self, h, rid: self.pacing.release(h, int(rid))}

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
                self.remove(h, forgotten=True)
        self._grant()

    def unassign(self, h: Handle, *, pending: bool = False) -> list[Item]:
        """Take back what ``h`` was assigned and not sent (``pending``: a handle that stays)."""
        back: list[Item] = [item for queue in h.assigned.values() for item in queue]
        for item in back:
            self._dequeue_count(item)
            if pending:
                h.add_pending(-1, -item.weight)
        h.assigned.clear()
        return back

    def leave_keys(self, h: Handle) -> None:
        for key in h.keys:      # h no longer consumes its keys
            members = self.consumers.get(key)
            if members is not None and h in members:
                members.remove(h)

    def remove(self, h: Handle, forgotten: bool = False) -> None:
        """Forget a handle; put back every item it had not finished (see module docs).
        ``forgotten``: it did not say goodbye (it may still send: it is told then)."""
        if h.dead:
            return
        h.dead = True
        if forgotten:
            self.forgotten.add((h.src, h.hid), _lost.FORGOTTEN_KEPT, h)
        self.handles.pop((h.src, h.hid), None)
        self.leased_total -= h.leased
        h.leased = 0
        try:
            self.want_queue.remove(h)
        except ValueError:
            pass
        back = self.unassign(h)
        back.extend(h.inflight.values())
        h.inflight.clear()
        for item in h.working.values():
            if item.ack:
                item.ack = False
                back.append(item)
        h.working.clear()
        self.leave_keys(h)
        h.requests.clear()
        h.credit.clear()
        self.pacing.forget(h)
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
        if self.policy.assigns and members and not (self.batching and self._deferred is not None):
            # None: the policy failed (counted, logged once); the item goes to the shared queue
            choice = self.guard.select(item.info(), [c.snapshot() for c in members])
            if choice is not None:
                h = members[choice]
                insert_by_id(h.assigned, key, item)
                h.add_pending(1, item.weight)
                self._serve(h, key)
                if self.work_stealing:
                    self._serve_wanting(key)
                return
        insert_by_id(self.shared, key, item)
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

    def _collect(self, h: Handle, key: Any, max_items: int, target: float | None) -> list[Item]:
        """Take the items ``h`` gets next for ``key`` and put them in flight to it.

        Oldest first from its assigned queue and the shared queue (else, with work
        stealing, from a victim); at most ``max_items`` (0: no limit) and, past the first
        item, a total weight <= ``target`` (None: no limit); it stops at the first item
        that does not fit. Empty: nothing to give.
        """
        taken: list[Item] = []
        total = 0.0
        nbytes = 0
        fresh, fresh_weight = 0, 0.0        # from the shared queue: newly pending on h
        inflight = h.inflight
        full = False
        floor = self.pacing.floor
        while not full and not (max_items and len(taken) >= max_items):
            mine, shared = h.assigned.get(key), self.shared.get(key)
            if mine and shared:     # a run from the older head, up to the other's head
                source, bound = (mine, shared[0].id) if mine[0].id < shared[0].id else (shared, mine[0].id)
            elif mine or shared:
                source, bound = mine or shared, None
            elif self.work_stealing and steal(self, h, key):
                continue
            else:
                break
            from_shared = source is shared
            while source:
                item = source[0]
                if bound is not None and item.id > bound:
                    break
                if floor is not None and item.version is not None and item.version < floor:
                    source.popleft()        # too old to be trained on: dropped, counted
                    self._drop_stale(h, item, not from_shared)
                    continue
                if taken and ((max_items and len(taken) >= max_items)
                              or (target is not None and total + item.weight > target)):
                    full = True
                    break
                source.popleft()
                taken.append(item)
                inflight[item.id] = item
                total += item.weight
                nbytes += item.nbytes
                if from_shared:
                    fresh += 1
                    fresh_weight += item.weight
        if taken:       # what _dequeue_count does per item, once for the batch
            if self.batching:        # when its work started (_balance counts what is left)
                h.sent_at = self.clock()
                h.last_sent[key] = max(h.last_sent.get(key, 0), max(it.id for it in taken))
            n = len(taken)
            self.queued -= n
            self.queued_weight -= total
            self.key_len[key] -= n
            self.key_weight[key] -= total
            if self.key_len[key] == 0:
                self.key_weight[key] = 0.0
            if self.queued == 0:
                self.queued_weight = 0.0
            if fresh:
                h.add_pending(fresh, fresh_weight)
            self.get_count += n
            self.bytes_out += nbytes
            self._count_rate(1, n)
            if self.pacing.versioned:
                self.pacing.handed(h, taken)
        return taken

    def _drop_stale(self, h: Handle, item: Item, assigned: bool) -> None:
        """``item`` (just taken off a queue of ``h``'s, ``assigned`` to it or shared) is
        older than the staleness bound: it leaves the channel without being handed out."""
        self._dequeue_count(item)
        if assigned:
            h.add_pending(-1, -item.weight)
        self.pacing.dropped(item)
        self._retire(item)

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
                if self.recalls.get(key):   # an item sent ahead to a consumer still busy comes back
                    _ahead.recall_overdue(self, key, self.clock())

    def _serve_wanting(self, key: Any) -> None:
        """Hand items to waiting consumers of ``key`` in turn (FIFO competition)."""
        wanting = self.wanting.get(key)
        rounds = len(wanting) if wanting else 0
        while wanting and rounds > 0:
            h = wanting.popleft()
            if h.dead or h.lost or not h.wants(key):
                rounds = len(wanting)
                continue
            if self._fill_one(h, key):
                rounds = len(wanting) + 1
            else:
                rounds -= 1
            if h.wants(key):
                wanting.append(h)

    def _fill_one(self, h: Handle, key: Any) -> bool:
        """Answer ``h``'s oldest request for ``key`` (or its credit). False: nothing to give."""
        requests = h.requests.get(key)
        if requests:
            request = requests[0]
            items = self._collect(h, key, request.max_items or 0, request.target)
            if not items:
                return False
            requests.popleft()
            self.send(h, ("items", request.rid, key, [(it.id, it.weight, it.payload) for it in items]))
            if self.batching:
                _ahead.sent(self, h, key, items, answer=True)
            return True
        credit = h.credit.get(key, 0)
        if credit > 0:   # prefetch: as many items as the credit covers, in one op
            items = self._collect(h, key, credit, None)
            if not items:
                return False
            h.credit[key] = credit - len(items)
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
        self.pacing.close()
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
        if self.want_queue or (self.soft_wants and self._free() <= 0):
            for h in self.handles.values():   # a put_nowait waits for space too (soft_wants)
                if h.leased > 0 and h.want == 0 and not h.revoking:
                    h.revoking = True
                    self.send(h, ("revoke",))
            if self.want_queue:
                return
        while self.soft_wants and self._free() > 0:
            h = self.soft_wants.popleft()
            if not h.dead:
                self._lease(h, min(self._free(), max(1, self._lease_batch() - h.leased)))

    # -- introspection -----------------------------------------------------------------------
    def _count_rate(self, column: int, n: int) -> None:
        count_rate(self._rates, int(self.clock()), column, n)

    def stats(self) -> dict[str, Any]:
        """A plain-value snapshot (see :class:`~rlinf.channel.stats.ChannelStats`)."""
        return snapshot(self)
