"""The client side of a channel: :class:`Channel` handles, and creating / finding channels.

A handle talks to the channel's server (``channel.<name>:0``) with small batched
operations: every operation issued in one loop iteration leaves in one message, and the
server answers each handle the same way. See ``docs/channel.md`` for the semantics.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import pickle
import weakref
from typing import Any, Callable

from ..errors import AddressInUseError, ClosedError, CommTimeoutError, EndOfChannel, RlinfError, WouldBlock
from ..core.interface import SMALL_MESSAGE, Core, HasCore
from ..core.work import Work
from ..util.futures import retrieve
from ._admit import Admission, check_count, check_version, current_admission
from ._gets import GetsBase
from ._handle import MAX_COUNT, chain, check_key, check_weight, default_free_memory
from ._pacing import check_pacing
from ._payload import pack
from .policies import make_policy
from .server import ChannelServer, ServerProcess, check_name, server_address
from .stats import ChannelStats

__all__ = ["Channel", "create_channel", "open_channel", "create_cluster_channel", "default_free_memory"]

log = logging.getLogger("rlinf.channel")


class Channel(GetsBase):
    """A handle to a channel: put items in, get them out. Get one with
    ``await comm.channel(name)`` or ``await comm.create_channel(name)``.

    One handle serves any number of producers and consumers on its loop. A handle is a
    *consumer* once it calls ``get``; the policy assigns items among consumers.

    Args:
        comm: the communicator to talk through.
        name: the channel's name.
        prefetch: items the server may send ahead of ``get`` calls (per key; 0: none,
            every ``get`` is one round trip). Prefetched items count as pending for this
            consumer, are put back if it dies or detaches, and make ``get`` local.
        free_memory: ``() -> int | None`` reporting free device memory with each get
            (default: ``torch.cuda.mem_get_info`` when torch has initialised CUDA).
        decode_ahead: decode prefetched items as they arrive instead of in ``get``: the
            GPU tensors of an item (queued by the channel in host memory) are then copied
            to this process's current CUDA device ahead of time, off ``get``'s path.
            Needs ``prefetch`` > 0; an item that cannot be decoded fails its ``get``.
        speed: this consumer's expected speed (weight per second), a hint: the balancing
            policies use it until they have measured the consumer (``performance_aware``
            then places items at once, without waiting for a first measurement).
    """

    def __repr__(self) -> str:
        state = ("failed" if self._error else "drained" if self._drained else "closed" if self._remote_closed
                 else "detached" if self._detached else "open")
        buffered = sum(len(b) for b in self._buffers.values())
        return (f"<Channel {self.name!r} {state} via {self._core.address} gets={len(self._gets)} "
                f"blocked_puts={len(self._blocked)} buffered={buffered} unacked={self.unacked}>")

    # -- opening ---------------------------------------------------------------------------
    async def _open(self, timeout: float | None) -> Channel:
        core = self._core
        core.check_open()
        self._loop = asyncio.get_running_loop()
        try:
            info = await core.lookup(self._server, wait=True, timeout=timeout)
        except CommTimeoutError:
            raise CommTimeoutError(f"no channel named {self.name!r} appeared within {timeout} s") from None
        if info is not None and info.meta.get("kind") != "channel":
            raise ValueError(f"{self._server} is not a channel server")
        _track(core, self)
        self._reader = self._loop.create_task(self._read(), name=f"rlinf-channel-{self.name}-{self._hid}")
        node = core.info.node_id if core.info is not None else ""
        reply = self._call_start("hello", core.incarnation, node, self._consumer_name(), self._speed)
        self.info = await self._await_call(reply, timeout, "open")
        self._maxsize = self.info["maxsize"]
        self._credits += self.info["lease"]
        self._remote_closed = self.info["closed"]
        return self

    def _consumer_name(self) -> str:
        same = sum(1 for h in _registry.get(self._core, ()) if h.name == self.name and h is not self)
        return self._core.address if same == 0 else f"{self._core.address}#{same}"

    # -- producing -------------------------------------------------------------------------
    async def put(self, item: Any, weight: float = 1.0, key: Any = None, *, version: int | None = None,
                  timeout: float | None = None) -> None:
        """Put ``item`` in the sub-queue ``key``.

        Returns once the item is on its way to the channel, in order with this handle's
        other operations, and its buffers may be reused (large items are sent zero-copy
        and awaited). With ``maxsize``, waits for space first; a put that times out or is
        cancelled while waiting for space is withdrawn. When the communicator closes, it
        first delivers the puts that returned (or its ``aclose`` raises, saying how many
        may not have arrived). ``timeout``: seconds to wait for space (None:
        ``RLINF_TIMEOUT`` if set, else forever).

        ``version``: the policy version that made the item (an int >= 0; None: not
        versioned, never stale). Inside ``async with ch.admit(v)`` the put takes one of
        the admission's places and ``version`` defaults to ``admission.made_with``
        (``max(v, admission.current)``: the version a producer refreshed to).

        Raises:
            ValueError: ``weight`` is not finite and >= 0, or ``version`` < 0; inside
                an ``admit`` block, every place of the admission was put already.
            TypeError: bad key, weight or version.
            EncodeError: ``item`` cannot be encoded.
            ClosedError: the channel is closed (or this handle detached, or its
                communicator is closing).
            CommTimeoutError: no space within ``timeout``.
            PeerLostError: the channel process is gone.
        """
        timeout = self._core.timeout_of(timeout)
        entry = self._start_put(item, weight, key, version)
        if entry is None:
            if self._must_yield:     # a tight put loop: let the transport send the batch
                self._must_yield = False
                await asyncio.sleep(0)
            return
        future = entry[2]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(future)
        except TimeoutError:
            if self._withdraw(entry):
                raise CommTimeoutError(f"channel {self.name!r}: no space within {timeout} s") from None
            await future      # already on its way: finish sending it
        except asyncio.CancelledError:
            self._withdraw(entry)
            raise

    def put_nowait(self, item: Any, weight: float = 1.0, key: Any = None, *, version: int | None = None) -> None:
        """Put ``item`` without waiting (``version`` as for :meth:`put`).

        Buffer lifetime: a large item (>= 1 MiB) is sent zero-copy; do not modify its
        arrays until it is sent (use ``put`` or ``async_put`` to know when).

        Raises:
            WouldBlock: the channel is full as far as this handle knows (it holds no
                lease of free space; one is requested, so a later call may succeed).
            Same as :meth:`put` otherwise.
        """
        weight = check_weight(weight)
        check_key(key)
        version = None if version is None else check_version(version)
        self._check_producer()
        if self._maxsize and (self._blocked or self._credits <= 0):
            self._op(("want", 1, True))
            raise WouldBlock(f"channel {self.name!r} is full")
        payload, nbytes = pack(self._codec, item)
        if self._maxsize:
            self._credits -= 1
        future = self._send_put(self._put_op(key, weight, nbytes, payload, version), nbytes >= SMALL_MESSAGE)
        if future is not None and not future.done():
            future.add_done_callback(retrieve)

    def async_put(self, item: Any, weight: float = 1.0, key: Any = None, *,
                  version: int | None = None) -> Work[None]:
        """Start a put now (its order is fixed by this call) and return its :class:`Work`."""
        entry = self._start_put(item, weight, key, version)
        future = self._loop.create_future()
        if entry is None:
            future.set_result(None)
        else:
            chain(entry[2], future)
            # cancelled while waiting for space: withdrawn, as put() does
            future.add_done_callback(lambda f: f.cancelled() and self._withdraw(entry))
        return Work(future, f"put to channel {self.name}")

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the channel has processed every put this handle made so far
        (``timeout``: seconds; None: ``RLINF_TIMEOUT`` if set, else forever).

        Raises:
            ClosedError: some of them were refused because the channel was closed.
            CommTimeoutError, PeerLostError.
        """
        if self._drained and not self._rejected:
            return                              # drained: every put was processed
        rejected = self._rejected if self._drained else \
            await self._await_call(self._call_start("sync"), timeout, "flush")
        if rejected:
            raise ClosedError(f"channel {self.name!r} is closed: {rejected} put(s) from this handle were refused")

    def _start_put(self, item: Any, weight: Any, key: Any, version: Any = None) -> list | None:
        weight = check_weight(weight)
        check_key(key)
        version = None if version is None else check_version(version)
        self._check_producer()
        payload, nbytes = pack(self._codec, item)
        if self._core.trace is not None:
            self._core.trace.span("channel", "channel.put", self._core.trace.now(), channel=self.name, bytes=nbytes)
        op = self._put_op(key, weight, nbytes, payload, version)
        large = nbytes >= SMALL_MESSAGE
        if self._maxsize:
            if self._blocked or self._credits <= 0:
                admission = current_admission(self)
                entry = [op, large, self._loop.create_future(), admission]
                if admission is not None:        # its exit is told after this put
                    admission.queued()
                self._blocked.append(entry)
                self._op(("want", 1, False))
                return entry
            self._credits -= 1
        future = self._send_put(op, large)
        return None if future is None else [op, large, future]

    def _put_op(self, key: Any, weight: float, nbytes: int, payload: Any, version: int | None) -> tuple:
        """The "put" op; inside an admission's block, it takes one of the admission's
        places (and its version, unless ``version`` is given)."""
        admission = current_admission(self)
        if admission is None:
            return ("put", key, weight, nbytes, payload) if version is None else \
                ("put", key, weight, nbytes, payload, version, 0)
        return ("put", key, weight, nbytes, payload, *admission.take(version))

    # -- asynchronous RL: versions and pacing ------------------------------------------------
    async def advance(self, version: int, timeout: float | None = None) -> None:
        """Set the channel's current policy version (typically the trainer, after each
        update; any handle may). With ``max_staleness=k``, items older than
        ``version - k`` are no longer handed out (dropped, counted in ``stats()``), and
        with pacing, producers waiting in :meth:`admit` may now start.

        Args:
            version: an int >= the current version (equal: nothing changes).
            timeout: seconds to wait for the channel's answer (None: ``RLINF_TIMEOUT``
                if set, else forever).

        Raises:
            ValueError: ``version`` is below the channel's current version (a version
                never goes back; nothing changed) or negative. TypeError: not an int.
            PeerLostError, CommTimeoutError, ClosedError.
        """
        version = check_version(version)
        current = await self._await_call(self._call_start("advance", version), timeout, "advance")
        if current > version:
            raise ValueError(f"channel {self.name!r}: version {version} is behind the current version {current} "
                             "(a version never goes back)")

    def admit(self, version: int, *, n: int = 1, timeout: float | None = None) -> Admission:
        """``async with ch.admit(version): ... await ch.put(item)``: pacing for a
        producer about to make one rollout (``n`` items: a group, such as the samples
        of one prompt) with policy ``version``.

        Entering the block waits until ``n`` items started now, with the trainer's
        current version, will be at most ``max_staleness`` versions old when the
        trainer consumes them (see ``docs/channel.md``, "Asynchronous RL"); the
        admission's ``current`` is that version: a producer holding an older ``version``
        refreshes its weights first. Each put of this handle inside the block (same
        task) takes one of the ``n`` places, with version ``max(version, current)``
        unless it gives one; a put beyond ``n`` raises ``ValueError``. The admission
        ends with its ``n``-th put, or at the block's exit, which frees the places not
        put. A producer that dies or detaches gives its admissions back. On a channel
        without ``batch_size`` it admits at once.

        Args:
            version: the policy version the producer holds (an int >= 0).
            n: the items the block puts, at most ``(max_staleness + 1) * batch_size``.
            timeout: seconds to wait for admission (None: ``RLINF_TIMEOUT`` if set, else
                forever).

        Returns:
            An async context manager (an :class:`~rlinf.channel._admit.Admission`).

        Raises:
            TypeError / ValueError: a bad version or ``n`` (at once). On entering the block:
            CommTimeoutError (not admitted within ``timeout``; the request is
            withdrawn), ClosedError, PeerLostError. Cancelled while waiting: withdrawn.
        """
        batch_size = self.info.get("batch_size")
        span = None if batch_size is None else (self.info["max_staleness"] + 1) * batch_size
        return Admission(self, check_version(version), check_count(n, span), timeout)

    async def _admit_wait(self, version: int, n: int, timeout: float | None) -> tuple[int, int]:
        """Wait for admission: its id (0: the channel does not pace) and the channel's
        current version then (``version`` when it does not pace)."""
        self._check_producer()
        if self.info.get("batch_size") is None:
            return 0, version
        call = self._call_start("admit", version, n)
        try:
            current = await self._await_call(call, timeout, "admission")
        except BaseException:
            self._admit_release(call[0])      # withdrawn, or given back if granted meanwhile
            raise
        if current is None:
            raise ClosedError(f"channel {self.name!r} is closed")
        return call[0], current

    def _admit_release(self, rid: int) -> None:
        """Admission ``rid`` ends (the server ignores it after the admission's put)."""
        if self._error is None and not self._drained and self._loop is not None:
            self._op(("release", rid))

    # -- consuming -------------------------------------------------------------------------
    async def get(self, key: Any = None, timeout: float | None = None, *, ack: bool = False) -> Any:
        """Take the next item of sub-queue ``key`` meant for this consumer.

        Calling ``get`` also tells the channel that the items this handle got before
        (without ``ack``) are finished: their processing time is measured from the
        previous ``get``'s return to this call.

        Args:
            key: the sub-queue.
            timeout: seconds to wait (None: ``RLINF_TIMEOUT`` if set, else forever). A
                get that times out or is cancelled loses nothing: an item already on its
                way goes back.
            ack: keep the item assigned to this consumer until :meth:`task_done`; if the
                consumer dies first, the item is put back in the queue.

        Raises:
            EndOfChannel: the channel is closed and nothing of ``key`` is left.
            CommTimeoutError, PeerLostError (the channel process died), ClosedError.
        """
        check_key(key)
        timeout = self._core.timeout_of(timeout)
        buffer = self._buffers.get(key)
        if buffer and not self._must_yield and self._error is None:
            if self._core.trace is not None:
                self._core.trace.span("channel", "channel.get", self._core.trace.now(), channel=self.name, items=1)
            return self._take_buffered(key, buffer, ack)    # prefetched: no wait
        return (await self._get_items(key, 1, None, ack, timeout))[0]

    async def get_batch(self, target_weight: float | None = None, max_items: int | None = None, key: Any = None,
                        timeout: float | None = None, *, ack: bool = False) -> list[Any]:
        """Take a batch: waits for the first item, then takes at once, in order, the
        items available to this consumer while both hold: at most ``max_items`` items,
        and a total weight <= ``target_weight``. The first item is always taken, even
        if it alone weighs more than the target; taking stops at the first item that
        does not fit (later, lighter items are not picked out of order). With neither
        limit, every available item is taken. It never waits to fill a batch.

        Raises:
            ValueError: ``target_weight`` < 0 or not finite, ``max_items`` < 1.
            Same as :meth:`get`.
        """
        if target_weight is not None:
            target_weight = check_weight(target_weight)
        if max_items is not None and (isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1):
            raise ValueError(f"max_items must be None or an int >= 1, got {max_items!r}")
        if max_items is not None:
            max_items = min(max_items, MAX_COUNT)      # no more is ever there
        return await self._get_items(key, max_items, target_weight, ack, self._core.timeout_of(timeout))

    def get_nowait(self, key: Any = None, *, ack: bool = False) -> Any:
        """Take an item already in this handle: prefetched (``prefetch`` > 0) or sent ahead.

        Raises:
            WouldBlock: no item of ``key`` is buffered here (prefetched, or sent ahead at
                ``prefetch=0`` under a batch policy).
            EndOfChannel: the channel is closed and nothing of ``key`` is left.
        """
        check_key(key)
        self._check_usable()
        buffer = self._buffers.get(key)
        if not buffer:
            self._check_consumer(key)
            if self._prefetch:
                self._ensure_credit(key)
            raise WouldBlock(f"channel {self.name!r}: no item of key {key!r} is buffered here")
        return self._take_buffered(key, buffer, ack)

    def async_get(self, key: Any = None, *, ack: bool = False) -> Work[Any]:
        """Start a get now (its order is fixed by this call) and return its :class:`Work`
        (it has no timeout: wait on the Work with one)."""
        check_key(key)
        if self._prefetch or key in self._topping:    # (a get_batch tops up: after it, _get_now)
            self._check_consumer(key)
            if self._prefetch:
                self._ensure_credit(key)
            task = self._loop.create_task(self.get(key, math.inf, ack=ack))
        else:
            self._check_consumer(key)
            buffer = self._buffers.get(key)
            if buffer and self._error is None:      # sent ahead by the channel (_ahead): taken now
                future = self._loop.create_future()
                future.set_result(self._take_buffered(key, buffer, ack))
                return Work(future, f"get from channel {self.name}")
            self._report_done()
            rid, future = self._start_get(key, 1, None)
            task = self._loop.create_task(self._finish_get_one(rid, future, ack))
            # cancelled before it ever ran: its request is still live, withdraw it
            task.add_done_callback(lambda t: t.cancelled() and self._abandon(rid, future))
        return Work(task, f"get from channel {self.name}")

    async def _finish_get_one(self, rid: int, future: asyncio.Future, ack: bool) -> Any:
        return (await self._finish_get(rid, future, ack, None))[0]

    def task_done(self, *items: Any) -> None:
        """Mark items got with ``ack=True`` as finished (each object as ``get`` returned it).

        The time since ``get`` returned them is reported as their processing time: once
        for the items of one ``get_batch`` (a batch weighing 8 done in 0.5 s ran at 16 per
        second), whether they are finished together or not.

        Raises:
            ValueError: an object is not an unfinished ``ack=True`` item of this handle
                (nothing is marked then).
            ClosedError: the handle is detached or failed (its unfinished items went back
                to the channel, for other consumers).
        """
        self._check_usable()
        need = collections.Counter(id(obj) for obj in items)
        for obj_id, n in need.items():
            if len(self._unacked.get(obj_id, ())) < n:
                raise ValueError("task_done: not an unacknowledged item from get(ack=True) on this handle")
        now, by_get = self._clock(), {}
        for obj in items:
            queue = self._unacked[id(obj)]
            item_id, since, _obj = queue.popleft()
            if not queue:
                del self._unacked[id(obj)]
            by_get.setdefault(since, []).append(item_id)   # one get's items share its time
        for since, ids in by_get.items():
            self._done(ids, now - since)

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.get(timeout=math.inf)     # iterating has no deadline, RLINF_TIMEOUT or not
        except EndOfChannel:
            raise StopAsyncIteration from None

    async def close(self, timeout: float | None = None) -> None:
        """Close the channel for everyone: puts are refused from now on; consumers drain
        what is left, then get ``EndOfChannel``. The channel process exits once drained.
        Idempotent.

        Raises:
            PeerLostError. CommTimeoutError: no answer within ``timeout`` (None:
                ``RLINF_TIMEOUT`` if set, else forever); the request is on its way all
                the same, so the channel closes when it gets it.
        """
        if self._drained:
            return
        try:
            await self._await_call(self._call_start("close"), timeout, "close")
        except ClosedError:
            if not self._drained:   # else closed by another handle meanwhile, and drained: done
                raise
        self._remote_closed = True

    async def stats(self, timeout: float | None = None) -> ChannelStats:
        """A snapshot of the channel (see :class:`ChannelStats`), within ``timeout``
        (None: ``RLINF_TIMEOUT`` if set, else forever).

        Raises:
            PeerLostError, CommTimeoutError, ClosedError.
        """
        return ChannelStats.from_dict(await self._await_call(self._call_start("stats"), timeout, "stats"))

    async def detach(self) -> None:
        """Stop using this handle (not the channel): prefetched items and, with acks,
        unfinished ones go back to the queue; items got without ack count as finished.
        Idempotent. Also done when the communicator closes."""
        if self._detached or self._loop is None:
            return
        self._detached = True
        back = [i[0] for buffer in self._buffers.values() for i in buffer]
        self._buffers.clear()
        if self._error is None and not self._drained:
            if back:
                self._ops.append(("unget", back))
            if self._credits:
                self._ops.append(("ret", self._credits))
                self._credits = 0
            self._ops.append(("bye",))
            try:
                future = self._flush()
                if future is not None and not future.done():
                    future.add_done_callback(retrieve)
            except RlinfError:
                pass
        self._fail(lambda: ClosedError(f"channel handle {self.name!r} is detached"))
        _untrack(self._core, self)

    # -- plumbing ----------------------------------------------------------------------------




# -- handles per communicator (closed with it) ------------------------------------------------
_registry: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _track(core: Core, ch: Channel) -> None:
    handles = _registry.get(core)
    if handles is None:
        handles = _registry[core] = []
        core.add_drainer(lambda linger: _drain_handles(core, linger))
        core.add_closer(lambda: _close_handles(core))
    handles.append(ch)


def _untrack(core: Core, ch: Channel) -> None:
    handles = _registry.get(core)
    if handles is not None and ch in handles:
        handles.remove(ch)


async def _drain_handles(core: Core, linger: float) -> None:
    """The communicator is closing: every handle's puts reach their channel first."""
    handles = list(_registry.get(core, ()))
    results = await asyncio.gather(*(h._drain_puts(linger) for h in handles), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors[1:]:
        log.warning("rlinf %s: closing: %s", core.address, error)
    if errors:
        raise errors[0]


def _close_handles(core: Core) -> None:
    for ch in list(_registry.get(core, ())):
        ch._detached = True
        ch._fail(lambda: ClosedError(f"communicator {core.address} is closed"))
    _registry.pop(core, None)


# -- creating and finding channels -------------------------------------------------------------
async def open_channel(comm: HasCore, name: str, *, timeout: float | None = 30.0, prefetch: int = 0,
                       free_memory: Callable[[], int | None] | None = None, decode_ahead: bool = False,
                       speed: float | None = None) -> Channel:
    """A handle to the channel ``name``, waiting up to ``timeout`` for it to appear
    (None: ``RLINF_TIMEOUT`` if set, else forever).

    Raises:
        CommTimeoutError: no such channel appeared in time.
        ValueError / TypeError: a bad name or option.
    """
    timeout = comm.internal.timeout_of(timeout)
    return await Channel(comm, name, prefetch=prefetch, free_memory=free_memory,
                         decode_ahead=decode_ahead, speed=speed)._open(timeout)


async def create_channel(comm: HasCore, name: str, *, maxsize: int = 0, policy: Any = "fifo", in_process: bool = False,
                         work_stealing: bool | None = None, timeout: float | None = 60.0, prefetch: int = 0,
                         free_memory: Callable[[], int | None] | None = None, decode_ahead: bool = False,
                         max_staleness: int | None = None, batch_size: int | None = None,
                         speed: float | None = None) -> Channel:
    """Start channel ``name`` (in a new process on this node, or in this loop with
    ``in_process=True``) and return a handle to it. It lives until it is closed and
    drained, or until ``comm`` closes (which stops it).

    ``max_staleness=k``: items put with a version older than the current version
    (:meth:`Channel.advance`) minus ``k`` when they would be handed out are dropped and
    counted. ``batch_size=B`` (needs ``max_staleness``): pacing, for a trainer that
    consumes ``B`` items per version; see :meth:`Channel.admit`.

    ``work_stealing``: an idle consumer takes the last waiting item of the consumer
    expected to finish last, when it would finish it sooner; None: the policy's default
    (on for ``performance_aware`` and ``shortest_queue``, see ``docs/channel.md``).

    Raises:
        ValueError: a bad name, maxsize, policy name, max_staleness or batch_size.
        AddressInUseError (a ValueError): the channel already exists, or another
            creator started it first (of two racing for one name, one wins).
        TypeError: a bad policy object, or one that cannot be pickled (without
            ``in_process``, the policy travels to the channel process); a
            max_staleness or batch_size that is not an int; a work_stealing that is
            not None, a bool or an int (0 / 1).
        WorkerFailedError: its process failed to start. CommTimeoutError.
    """
    check_name(name)
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize must be an int >= 0 (0: unbounded), got {maxsize!r}")
    make_policy(policy)                      # fail here, not in the server
    max_staleness, batch_size = check_pacing(max_staleness, batch_size)
    if not in_process:
        try:
            pickle.dumps(policy)
        except Exception as exc:
            raise TypeError(f"policy {policy!r} cannot be pickled for the channel process ({exc!r}): "
                            "define its class at module level, or pass in_process=True") from None
    core = comm.internal
    timeout = core.timeout_of(timeout)
    core.check_open()
    address = server_address(name)
    if await core.lookup(address, wait=False, timeout=timeout) is not None:
        raise AddressInUseError(f"a channel named {name!r} already exists")
    if work_stealing is not None:
        if not isinstance(work_stealing, int):     # (a bool is an int; 0 / 1 as before)
            raise TypeError(f"work_stealing must be None or a bool, got {work_stealing!r}")
        work_stealing = bool(work_stealing)
    config = {"maxsize": maxsize, "policy": policy, "work_stealing": work_stealing,
              "max_staleness": max_staleness, "batch_size": batch_size}
    if in_process:
        server = ChannelServer(name, manager=core.manager_address, token=core.token, **config)
        try:
            await server.start()
        except AddressInUseError as exc:
            raise AddressInUseError(f"a channel named {name!r} already exists ({exc})") from None
        core.add_closer(server.aclose)
        # closes it once drained; cancelled when the communicator closes (which stops it)
        core.add_closer(asyncio.get_running_loop().create_task(_close_when_done(server)).cancel)
    else:
        process = ServerProcess(name, manager=core.manager_address, token=core.token, config=config)
        core.add_closer(process.stop)
        await process.wait_ready(timeout)
    return await open_channel(comm, name, timeout=timeout, prefetch=prefetch, free_memory=free_memory,
                              decode_ahead=decode_ahead, speed=speed)


async def _close_when_done(server: ChannelServer) -> None:
    await server.wait_done()
    await server.aclose()


_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_owner_ids = itertools.count()


async def create_cluster_channel(cluster, name: str, **options: Any) -> Channel:
    """``Cluster.create_channel``: the channel is owned by a communicator of the cluster's
    driver (``cluster.<pid>:<n>``), so closing the cluster stops it."""
    owner = _owners.get(cluster)
    if owner is None:
        owner = _owners[cluster] = asyncio.get_running_loop().create_task(
            cluster.connect(f"cluster.{os.getpid()}:{next(_owner_ids)}").start())
    comm = await asyncio.shield(owner)
    return await create_channel(comm, name, **options)
