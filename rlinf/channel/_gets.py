"""How a channel handle gets items: asks the channel, or takes them from its buffer.

:class:`GetsBase` holds the get paths under :meth:`rlinf.channel.Channel.get` and
:meth:`~rlinf.channel.Channel.get_batch`: with ``prefetch``, from the items prefetched;
at ``prefetch=0``, a get op per call, or the items the channel sent ahead
(:mod:`rlinf.channel._ahead`), topped up.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ..errors import CommTimeoutError, RlinfError
from ._handle import HandleBase, check_key

__all__ = ["GetsBase"]


class GetsBase(HandleBase):
    """The get paths of a channel handle (see :class:`rlinf.channel.Channel`)."""

    async def _get_items(self, key: Any, max_items: int | None, target: float | None, ack: bool,
                         timeout: float | None) -> list[Any]:
        trace = self._core.trace
        started = trace.now() if trace is not None else 0
        check_key(key)
        self._check_consumer(key)
        self._report_done()
        if self._prefetch:
            items = await self._get_buffered(key, max_items, target, ack, timeout)
        else:
            items = await self._get_now(key, max_items, target, ack, timeout)
        if trace is not None:
            trace.span("channel", "channel.get", started, channel=self.name, items=len(items))
        return items

    async def _get_now(self, key: Any, max_items: int | None, target: float | None, ack: bool,
                       timeout: float | None) -> list[Any]:
        """A get at ``prefetch=0``: from the items sent ahead buffered here (topped up by
        the channel), else asked of it. While a ``get_batch`` of ``key`` tops up here, it
        waits for that first (within ``timeout``): the channel still counts the items
        that one took as ahead here, and would take a get sent meanwhile as answered by
        them (:func:`rlinf.channel._ahead.on_get`)."""
        if key in self._topping:
            timeout = await self._after_top_up(key, timeout)
            self._check_consumer(key)
        buffer = self._buffers.get(key)
        if buffer:        # sent ahead by the channel (_ahead), topped up by it
            return await self._from_ahead(key, buffer, max_items, target, ack, timeout)
        rid, future = self._start_get(key, max_items, target)
        return await self._finish_get(rid, future, ack, timeout)

    async def _after_top_up(self, key: Any, timeout: float | None) -> float | None:
        """Wait until no ``get_batch`` of ``key`` tops up here. Returns the time left of
        ``timeout``. Raises CommTimeoutError past it."""
        deadline = None if timeout is None else self._loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                while key in self._topping:
                    await self._topping[key][1].wait()
        except TimeoutError:
            raise CommTimeoutError(f"channel {self.name!r}: no item within {timeout} s") from None
        return None if deadline is None else max(deadline - self._loop.time(), 0.0)

    def _start_get(self, key: Any, max_items: int | None, target: float | None,
                   now: bool = False) -> tuple[int, asyncio.Future]:
        rid = next(self._rids)
        future = self._gets[rid] = self._loop.create_future()
        if not now:      # (a top-up get is never answered by items sent ahead)
            self._get_keys[rid] = (key, max_items, target)
        self._op(("get", rid, key, max_items, target, self._memory_now(), True) if now
                 else ("get", rid, key, max_items, target, self._memory_now()))
        return rid, future

    async def _finish_get(self, rid: int, future: asyncio.Future, ack: bool, timeout: float | None,
                          deliver: bool = True) -> list[Any]:
        try:
            async with asyncio.timeout(timeout):
                items = await future
        except BaseException as exc:
            self._abandon(rid, future)
            if isinstance(exc, TimeoutError) and not isinstance(exc, RlinfError):
                raise CommTimeoutError(f"channel {self.name!r}: no item within {timeout} s") from None
            raise
        self._gets.pop(rid, None)
        self._get_keys.pop(rid, None)
        return self._deliver(items, ack) if deliver else items

    async def _get_buffered(self, key: Any, max_items: int | None, target: float | None, ack: bool,
                            timeout: float | None) -> list[Any]:
        self._ensure_credit(key)
        buffer = self._buffers.setdefault(key, collections.deque())
        if buffer and self._must_yield:
            # A tight get loop served from the buffer never lets the loop run: yield once
            # so the credit it returned goes out and the server keeps the buffer full.
            self._must_yield = False
            await asyncio.sleep(0)
        if not buffer:   # (a buffered item is taken without setting up a timeout)
            try:
                async with asyncio.timeout(timeout):
                    while not buffer:
                        self._check_consumer(key)
                        waiter = self._loop.create_future()
                        self._buffer_waiters.setdefault(key, []).append(waiter)
                        try:
                            await waiter
                        finally:
                            waiters = self._buffer_waiters.get(key)
                            if waiters and waiter in waiters:
                                waiters.remove(waiter)
            except TimeoutError:
                raise CommTimeoutError(f"channel {self.name!r}: no item within {timeout} s") from None
        return self._from_buffer(key, buffer, max_items, target, ack)

    # -- channel-wide ----------------------------------------------------------------------

    async def _from_ahead(self, key: Any, buffer: collections.deque, max_items: int | None, target: float | None,
                          ack: bool, timeout: float | None) -> list[Any]:
        """``get_batch`` at ``prefetch=0`` with items sent ahead buffered here (not empty):
        those, by the ``get_batch`` rule, then, if it took them all and has room (and no
        ``target``), what else the channel has for it now (a *top-up* get it answers at
        once, maybe with nothing, and never with items sent ahead: the module docs of
        :mod:`rlinf.channel._ahead`). Their ``took`` leaves with the answer's, once it is
        here: cancelled meanwhile, those stay here, still ahead for the channel (recalled,
        or given back on detach, like any); timed out, the batch is those alone."""
        if target is not None or (max_items and len(buffer) >= max_items) or self._error is not None:
            return self._from_buffer(key, buffer, max_items, target, ack)
        taken = list(buffer)
        buffer.clear()
        rid, future = self._start_get(key, max_items - len(taken) if max_items else None, None, True)
        recalled, settled = self._topping[key] = (set(), asyncio.Event())
        try:
            more = await self._finish_get(rid, future, ack, timeout, deliver=False)
        except CommTimeoutError:
            more = []        # (the top-up's answer, if any, goes back: _abandon)
        except BaseException:
            # not reported taken: taken later, in order; those recalled meanwhile go back
            buffer.extendleft(reversed([i for i in taken if i[0] not in recalled]))
            if recalled.intersection(i[0] for i in taken):
                self._op(("unget", [i[0] for i in taken if i[0] in recalled]))
            raise
        finally:       # the gets of key waiting for it go on (_get_now)
            self._topping.pop(key, None)
            settled.set()
        return self._deliver([*taken, *more], ack)
