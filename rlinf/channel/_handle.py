"""The machinery of a channel handle: state, batched ops, the reader, failure handling.

:class:`HandleBase` holds what :class:`rlinf.channel.Channel` needs under its public
methods. Operations issued in one loop iteration leave as one message (per-get
bookkeeping, "took"/"done"/"credit", is merged into one op of each kind), and the
server's answers are dispatched by :meth:`HandleBase._on_ops`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import numbers
import sys
import time
from typing import Any, Callable

from ..core import wire
from ..core.interface import Core
from ..errors import (ClosedError, CommTimeoutError, DecodeError, EndOfChannel, PeerLostError, ProtocolError,
                      RlinfError)
from ..util.futures import retrieve
from ._ahead import batch_len
from ._payload import decoded, unpack
from ._wire import decode_ops, encode_ops
from .server import REQUEST_TAG, check_name, reply_tag, server_address

__all__ = ["HandleBase", "MAX_COUNT", "chain", "check_key", "check_weight", "default_free_memory"]

log = logging.getLogger("rlinf.channel")

_hids = itertools.count(1)
_NO_KEY = object()
_KEY_TYPES = (str, int, bytes, type(None))
_MEMORY_PERIOD = 0.1
_MAX_BATCH = 1024      # ops per message before a tight loop flushes (and put yields once)


def check_key(key: Any) -> None:
    """Raise TypeError / ValueError unless ``key`` can name a sub-queue."""
    if isinstance(key, tuple):
        for part in key:
            check_key(part)
    elif not isinstance(key, _KEY_TYPES):
        raise TypeError(f"a channel key must be None, str, int, bytes or a tuple of them, got {type(key).__name__}")
    elif isinstance(key, int):
        if not wire.INT_MIN <= key <= wire.INT_MAX:     # what msgpack can carry
            raise ValueError(f"a channel key int must lie in [-2**63, 2**64 - 1], got {key}")
    elif isinstance(key, str):
        try:
            key.encode()
        except UnicodeEncodeError as exc:       # lone surrogates
            raise ValueError(f"a channel key str must be valid Unicode text: {exc}") from None


#: A count no channel reaches: larger ``max_items``/``prefetch`` mean the same (and must
#: fit the wire's integers).
MAX_COUNT = 1 << 31


def check_weight(weight: Any) -> float:
    """``weight`` as a float; TypeError / ValueError unless it is a finite real >= 0."""
    kind = type(weight)
    if kind is not float and kind is not int and (isinstance(weight, bool) or not isinstance(weight, numbers.Real)):
        raise TypeError(f"weight must be a real number, got {kind.__name__}")
    try:
        weight = float(weight)
    except OverflowError:
        raise ValueError(f"weight must be finite and >= 0, got {weight!r}") from None
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
    return weight


def default_free_memory() -> int | None:
    """Free bytes on this process's current GPU, if torch has initialised CUDA; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        free, _total = torch.cuda.mem_get_info()
    except RuntimeError:      # a device in a bad state reports nothing rather than failing gets
        return None
    return int(free)


def chain(source: asyncio.Future, target: asyncio.Future) -> None:
    """Complete ``target`` as ``source`` completes (unless it is done already)."""
    def done(f: asyncio.Future) -> None:
        if target.done():
            retrieve(f)
        elif f.cancelled():
            target.cancel()
        elif f.exception() is not None:
            target.set_exception(f.exception())
        else:
            target.set_result(None)

    source.add_done_callback(done)


def _error_factory(exc: BaseException, ch: HandleBase) -> Callable[[], BaseException]:
    if isinstance(exc, PeerLostError):
        message = f"channel {ch.name!r}: its server {ch._server} is gone ({exc})"

        def make() -> BaseException:
            error = PeerLostError(message, peer=ch._server)
            error.__cause__ = exc
            return error
        return make
    if isinstance(exc, ClosedError):
        return lambda: ClosedError(f"channel {ch.name!r}: {exc}")
    return lambda: exc



class HandleBase:
    """State and plumbing of a channel handle (see :class:`rlinf.channel.Channel`)."""

    def __init__(self, comm, name: str, *, prefetch: int = 0,
                 free_memory: Callable[[], int | None] | None = None, decode_ahead: bool = False,
                 speed: float | None = None) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if speed is not None:
            if isinstance(speed, bool) or not isinstance(speed, numbers.Real):
                raise TypeError(f"speed must be a real number, got {type(speed).__name__}")
            if not (math.isfinite(speed) and speed > 0):
                raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        self._speed = None if speed is None else float(speed)
        if not isinstance(decode_ahead, bool):
            raise TypeError(f"decode_ahead must be a bool, got {decode_ahead!r}")
        if decode_ahead and not prefetch:
            raise ValueError("decode_ahead needs prefetch > 0 (only prefetched items arrive ahead of get)")
        self._decode_ahead = decode_ahead
        self.name = check_name(name)
        self._core: Core = comm.internal
        self._server = server_address(name)
        self._hid = next(_hids)
        self._tag = reply_tag(self._hid)
        self._codec = self._core.codec
        self._prefetch = min(prefetch, MAX_COUNT)
        self._free_memory = free_memory or default_free_memory
        self._memory: tuple[float, int | None] = (-1.0, None)
        self._clock = time.monotonic
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._rids = itertools.count(1)
        self._ops: list = []
        self._flush_scheduled = False
        self._must_yield = False
        self._large = False
        self._acc_took: dict[bool, list] = {}
        self._acc_done: list | None = None
        self._acc_credit: dict[Any, int] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._gets: dict[int, asyncio.Future] = {}
        self._get_keys: dict[int, tuple] = {}  # rid -> (key, max_items, target) of a get at prefetch=0 (_ahead)
        self._error: Callable[[], BaseException] | None = None
        self._detached = False
        self._drained = False
        self.info: dict[str, Any] = {}
        # producer
        self._maxsize = 0
        self._credits = 0
        self._blocked: collections.deque[list] = collections.deque()
        self._remote_closed = False
        self._rejected = 0
        self._closing = False         # its communicator is closing: no more puts
        # Puts sent, and how many of them the server has confirmed: it answers a call
        # after applying the ops sent before it, so a call's answer confirms the puts
        # sent before the call (``_call_marks``: rid -> puts sent by then).
        self._puts_sent = 0
        self._puts_confirmed = 0
        self._call_marks: dict[int, int] = {}
        # consumer
        self._buffers: dict[Any, collections.deque] = {}
        self._buffer_waiters: dict[Any, list[asyncio.Future]] = {}
        self._credited: set = set()
        self._ended: set = set()
        self._working: list[int] = []
        self._working_since = 0.0
        self._unacked: dict[int, collections.deque] = {}
        # key -> (ids recalled while a get_batch tops up, set once it settles): _gets._from_ahead
        self._topping: dict[Any, tuple[set, asyncio.Event]] = {}

    @property
    def unacked(self) -> int:
        """Items this handle got with ``ack=True`` and has not ``task_done`` yet."""
        return sum(len(q) for q in self._unacked.values())

    def _gone_drained(self) -> ClosedError:
        return ClosedError(f"channel {self.name!r} is closed and drained: its server has exited")

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error()
        if self._loop is None:
            raise ClosedError("channel handle is not open: use 'await comm.channel(name)'")

    def _check_producer(self) -> None:
        self._check_usable()
        if self._remote_closed or self._drained:
            raise ClosedError(f"channel {self.name!r} is closed")
        if self._closing:
            raise ClosedError(f"channel {self.name!r}: communicator {self._core.address} is closing")
        if self._rejected:
            raise ClosedError(f"channel {self.name!r} is closed: {self._rejected} put(s) were refused")

    def _check_consumer(self, key: Any) -> None:
        if (self._drained or key in self._ended) and not self._buffers.get(key) and not self._detached:
            raise EndOfChannel(f"channel {self.name!r} is closed and drained (key {key!r})")
        self._check_usable()

    def _send_put(self, op: tuple, large: bool) -> asyncio.Future | None:
        self._ops.append(op)
        self._puts_sent += 1
        if op[4][0] == 2:
            self._large = True
        if large:
            return self._flush()
        if len(self._ops) >= _MAX_BATCH:
            self._must_yield = True
            future = self._flush()
            if not future.done():
                future.add_done_callback(retrieve)
            return None
        self._schedule_flush()
        return None

    def _release_blocked(self) -> None:
        while self._blocked and self._credits > 0:
            op, large, future, admission = self._blocked.popleft()
            self._credits -= 1
            try:
                sent = self._send_put(op, large)
            except RlinfError as exc:
                future.set_exception(exc)
                if admission is not None:
                    admission.settled(True)
                continue
            if admission is not None:   # (its block's exit, if told, follows the put)
                admission.settled(False)
            if sent is None:
                future.set_result(None)
            else:
                chain(sent, future)

    def _withdraw(self, entry: list) -> bool:
        try:
            self._blocked.remove(entry)
        except ValueError:
            return False
        entry[2].cancel()
        if entry[3] is not None:      # an admission's place is free again
            entry[3].settled(True)
        return True

    def _abandon(self, rid: int, future: asyncio.Future) -> None:
        """Give up get ``rid`` without losing an item (idempotent)."""
        key = self._get_keys.pop(rid, (_NO_KEY,))[0]
        if self._gets.pop(rid, None) is None:
            return
        if not future.done():
            future.cancel()
        if future.cancelled():
            self._op(("cancel", rid))          # an answer still on its way is given back
        elif future.exception() is None:       # answered, never returned: give them back
            buffer = self._buffers.get(key) if not self._prefetch else None
            if buffer:      # before the rest of the items sent ahead with them: kept, in order
                buffer.extendleft(reversed(future.result()))
            else:
                self._op(("unget", [i[0] for i in future.result()]))

    def _ensure_credit(self, key: Any) -> None:
        if key not in self._credited:
            self._credited.add(key)
            self._credit(key, self._prefetch)

    def _take_buffered(self, key: Any, buffer: collections.deque, ack: bool) -> Any:
        """A ``get`` of one item served from the prefetch ``buffer`` of ``key`` (not empty).

        The same steps as the general path (finish the previous items, credit the server
        back, deliver), for one item, with one clock reading and one flush scheduled.
        """
        item_id, _weight, payload = buffer.popleft()
        now = self._clock()
        working = self._working
        if working:                 # the items of the previous get are finished
            self._add_done(working, now - self._working_since)
            self._working = []
        if self._prefetch:         # (an item the channel sent ahead at prefetch=0 returns no credit)
            credit = self._acc_credit[key] = self._acc_credit.get(key, 0) + 1
            if credit * 2 >= self._prefetch:
                self._must_yield = True
        try:
            obj = unpack(self._codec, payload)
        except (DecodeError, ValueError) as exc:
            raise self._drop_undecodable(item_id, [], exc) from exc
        took = self._acc_took.get(ack)
        if took is None:
            took = self._acc_took[ack] = []
        took.append(item_id)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_soon)
        if ack:
            self._unacked.setdefault(id(obj), collections.deque()).append((item_id, now, obj))
        else:
            self._working.append(item_id)
            self._working_since = now
        return obj

    def _from_buffer(self, key: Any, buffer: collections.deque, max_items: int | None, target: float | None,
                     ack: bool) -> list[Any]:
        """The ``get_batch`` rule applied to the items buffered here (not empty)."""
        taken, total = [], 0.0
        while buffer:
            weight = buffer[0][1]
            if taken and ((max_items and len(taken) >= max_items) or (target is not None and total + weight > target)):
                break
            taken.append(buffer.popleft())
            total += weight
            if max_items and len(taken) >= max_items:
                break
        if self._prefetch:
            self._credit(key, len(taken))
        return self._deliver(taken, ack)

    def _deliver(self, items: list, ack: bool) -> list[Any]:
        objects = []
        for item_id, _weight, payload in items:
            try:
                objects.append(unpack(self._codec, payload))
            except (DecodeError, ValueError) as exc:
                back = [i[0] for i in items if i[0] != item_id]
                raise self._drop_undecodable(item_id, back, exc) from exc
        ids = [i[0] for i in items]
        self._took(ids, ack)
        now = self._clock()
        if ack:
            for (item_id, _w, _p), obj in zip(items, objects):
                self._unacked.setdefault(id(obj), collections.deque()).append((item_id, now, obj))
        else:
            if not self._working:
                self._working_since = now
            self._working.extend(ids)
        return objects

    def _drop_undecodable(self, item_id: int, back: list[int], exc: BaseException) -> DecodeError:
        """Item ``item_id`` cannot be decoded here: it is consumed and dropped (given back,
        it would come round again and again), and the other items of the same get
        (``back``) return to the channel. Returns the error the get raises."""
        self._took([item_id], False)
        self._done([item_id], 0.0)
        if back:
            self._op(("unget", back))
        returned = f"; the other {len(back)} items of this get went back to the channel" if back else ""
        return DecodeError(f"channel {self.name!r}: an item cannot be decoded here and was dropped "
                           f"({exc}){returned}")

    def _report_done(self) -> None:
        if self._working:
            self._done(self._working, self._clock() - self._working_since)
            self._working = []

    def _memory_now(self) -> int | None:
        now = self._clock()
        when, value = self._memory
        if now - when >= _MEMORY_PERIOD:
            value = self._free_memory()
            self._memory = (now, value)
        return value

    def _op(self, op: tuple) -> None:
        self._ops.append(op)
        self._schedule_flush()

    # Per-get bookkeeping is merged until the next flush: one op of each kind per message.

    def _took(self, ids: list, ack: bool) -> None:
        self._acc_took.setdefault(ack, []).extend(ids)
        self._schedule_flush()

    def _done(self, ids: list, seconds: float) -> None:
        self._add_done(ids, seconds)
        self._schedule_flush()

    def _add_done(self, ids: list, seconds: float) -> None:
        """Merge ``ids`` into the pending "done" op (it takes ``ids`` over: not copied)."""
        if self._acc_done is None:
            self._acc_done = [ids, seconds]
        else:
            self._acc_done[0].extend(ids)
            self._acc_done[1] += seconds

    def _credit(self, key: Any, n: int) -> None:
        credit = self._acc_credit[key] = self._acc_credit.get(key, 0) + n
        if credit * 2 >= self._prefetch:
            self._must_yield = True
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        self._must_yield = False
        try:
            future = self._flush()
        except Exception as exc:   # the ops are gone: fail what waits on them, never leave it hanging
            self._fail(_error_factory(exc, self))
            return
        if future is not None and not future.done():
            future.add_done_callback(retrieve)

    def _flush(self) -> asyncio.Future | None:
        """Send the queued ops now, as one message. Returns the send's future."""
        ops: list = [("took", ids, ack) for ack, ids in self._acc_took.items()]
        if self._acc_done is not None:
            ops.append(("done", *self._acc_done))
        if self._acc_credit:
            memory = self._memory_now()
            ops.extend(("credit", key, n, memory) for key, n in self._acc_credit.items())
        if ops:
            self._acc_took, self._acc_done, self._acc_credit = {}, None, {}
            ops.extend(self._ops)
        elif not self._ops:
            return None
        else:
            ops = self._ops
        self._ops = []
        large, self._large = self._large, False
        blob, buffers = encode_ops(ops, large)
        return self._core.start_send([self._hid, blob, buffers], self._server, REQUEST_TAG)

    def _call_start(self, kind: str, *args: Any) -> tuple[int, asyncio.Future]:
        self._check_usable()
        if self._drained:
            raise self._gone_drained()
        rid = next(self._rids)
        future = self._calls[rid] = self._loop.create_future()
        self._call_marks[rid] = self._puts_sent
        self._op((kind, rid, *args))
        return rid, future

    async def _await_call(self, call: tuple[int, asyncio.Future], timeout: float | None, what: str) -> Any:
        """The answer to ``call``, within ``timeout`` (None: the communicator's default)."""
        rid, future = call
        try:
            timeout = self._core.timeout_of(timeout)
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise CommTimeoutError(f"channel {self.name!r}: {what} got no answer within {timeout} s") from None
        finally:
            self._calls.pop(rid, None)

    async def _read(self) -> None:
        core = self._core
        while True:
            try:
                ops = decode_ops(await core.recv(self._server, self._tag))
            except (DecodeError, ProtocolError) as exc:
                log.warning("channel %s: dropped an undecodable message: %r", self.name, exc)
                continue
            except (PeerLostError, ClosedError) as exc:
                if self._drained:   # it exited as it should once drained
                    self._fail(self._gone_drained)
                else:
                    self._fail(_error_factory(exc, self))
                return
            try:
                self._on_ops(ops)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                log.warning("channel %s: dropped a malformed message: %r", self.name, exc)
            # not kept while we wait for the next message: the items' buffers (shared
            # memory of their producer) must go once the caller drops what get() returned
            del ops

    def _on_ops(self, ops: list) -> None:
        for op in ops:
            kind = op[0]
            if kind == "items":
                rid, key, items = op[1], op[2], op[3]
                if rid == 0:
                    if self._decode_ahead:
                        items = [(item_id, weight, decoded(self._codec, payload)) for item_id, weight, payload in items]
                    self._buffers.setdefault(key, collections.deque()).extend(items)
                    self._wake(key)
                else:
                    future = self._gets.get(rid)
                    if future is not None and not future.done():
                        future.set_result(items)
                    else:       # its get was given up: to a get waiting here (prefetch=0), else back
                        back = items if self._prefetch else self._answer_waiting(key, items)
                        if back:
                            self._op(("unget", [i[0] for i in back]))
            elif kind == "ahead":
                self._ahead(op[1], op[2])
            elif kind == "recall":       # give back what is still buffered of those (_ahead)
                buffer, ids = self._buffers.get(op[1]), set(op[2])
                if op[1] in self._topping:      # (taken by a get_batch topping up: back if it is given up)
                    self._topping[op[1]][0].update(ids)
                back = [i for i in buffer if i[0] in ids] if buffer else []
                for entry in back:
                    buffer.remove(entry)
                if back:
                    self._op(("unget", [i[0] for i in back]))
            elif kind == "end":
                rid, key = op[1], op[2]
                self._ended.add(key)
                future = self._gets.get(rid) if rid else None
                if future is not None and not future.done():
                    future.set_exception(EndOfChannel(f"channel {self.name!r} is closed and drained (key {key!r})"))
                self._wake(key)
            elif kind == "grant":
                self._credits += op[1]
                self._release_blocked()
            elif kind == "revoke":
                self._op(("ret", self._credits))
                self._credits = 0
            elif kind in ("info", "reply"):
                confirmed = self._call_marks.pop(op[1], 0)
                if confirmed > self._puts_confirmed:
                    self._puts_confirmed = confirmed
                future = self._calls.pop(op[1], None)
                if future is not None and not future.done():
                    future.set_result(op[2])
            elif kind == "closed":
                self._remote_closed = True
                self._fail_puts(lambda: ClosedError(f"channel {self.name!r} is closed"))
            elif kind == "rejected":
                self._rejected += op[1]
            elif kind == "forgotten":
                self._forgotten(op[1])
            elif kind == "drained":
                self._drained = True       # our puts were applied, or refused as the channel closed
                self._puts_confirmed = self._puts_sent
                self._fail_puts(lambda: ClosedError(f"channel {self.name!r} is closed"))
                for future in self._gets.values():
                    if not future.done():
                        future.set_exception(EndOfChannel(f"channel {self.name!r} is closed and drained"))
                self._gets.clear()
                self._get_keys.clear()
                for key in list(self._buffer_waiters):
                    self._wake(key)

    def _ahead(self, key: Any, items: list) -> None:
        """The channel sent ``items`` of ``key`` ahead (prefetch=0, :mod:`rlinf.channel._ahead`):
        in order, one each, they answer the gets of ``key`` waiting here (the channel takes
        each get it receives while items are ahead here as answered by one), and the rest
        wait in the buffer for the next gets."""
        items = self._answer_waiting(key, items)
        if items:
            self._buffers.setdefault(key, collections.deque()).extend(items)
            self._wake(key)

    def _answer_waiting(self, key: Any, items: list) -> list:
        """Answer the gets of ``key`` waiting here (prefetch=0), oldest first, with
        ``items`` in order, each as many as its ``get_batch`` rule takes (what the channel
        counts for items sent ahead: :func:`rlinf.channel._ahead.batch_len`). Items sent
        ahead answer them so; so do the items of a get given up (answered meanwhile): they
        are older than what the waiting get's own answer will bring (that one then comes
        back here). Returns the items left over."""
        for rid, future in self._gets.items():
            if not items:
                break
            wanted = self._get_keys.get(rid)
            if wanted is not None and wanted[0] == key and not future.done():
                n = batch_len([i[1] for i in items], wanted[1], wanted[2])
                future.set_result(items[:n])
                items = items[n:]
        return items

    def _forgotten(self, processed: int) -> None:
        """The server forgot this handle while it took its worker for lost (and gave
        what it had sent here to other consumers): nothing it sends is applied any more.
        Items received and not returned yet are dropped (they went to others); every
        pending and later operation raises PeerLostError."""
        if self._error is not None:
            return
        self._buffers.clear()
        self._unacked.clear()
        missing = self._puts_sent - processed if processed >= 0 else None
        lost = (f"{missing} put(s) from this handle were not applied" if missing is not None
                else "an unknown number of puts from this handle may not have been applied")
        message = (f"channel {self.name!r} forgot this handle ({self._core.address}) while it took it for lost: "
                   f"{lost}, and the items sent to it and not taken went to other consumers; "
                   f"open a new handle")
        self._fail(lambda: PeerLostError(message, peer=self._server))

    def _wake(self, key: Any) -> None:
        for waiter in self._buffer_waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _drain_puts(self, linger: float) -> None:
        """Its communicator is closing (still open): refuse puts from now on, send the
        queued ones and wait until the server has applied every put this handle made,
        within ``linger`` seconds. Puts still waiting for space fail with ClosedError
        (they never returned).

        Raises:
            PeerLostError, CommTimeoutError, ClosedError: some puts may not have arrived
                (the message says how many).
        """
        self._closing = True
        self._fail_puts(lambda: ClosedError(f"channel {self.name!r}: communicator {self._core.address} is closing"))
        unsettled = self._puts_sent - self._puts_confirmed
        if not unsettled or self._drained or self._detached:
            return    # (a detached handle's puts went out with its goodbye, before this close)
        try:
            await self._await_call(self._call_start("sync"), linger, "the confirmation of its puts")
        except (PeerLostError, CommTimeoutError, ClosedError) as exc:
            if self._drained:
                return
            message = f"{exc}; {unsettled} put(s) from {self._core.address} may not have arrived"
            if isinstance(exc, PeerLostError):
                raise PeerLostError(message, peer=self._server) from exc
            raise type(exc)(message) from exc

    def _fail_puts(self, error: Callable[[], BaseException]) -> None:
        while self._blocked:
            future = self._blocked.popleft()[2]
            if not future.done():
                future.set_exception(error())

    def _fail(self, error: Callable[[], BaseException]) -> None:
        """The handle is unusable from now on: fail everything pending with ``error()``."""
        if self._error is None:
            self._error = error
        self._unacked.clear()      # the server takes them back (or they are lost with it)
        self._call_marks.clear()
        for table in (self._gets, self._calls):
            for future in table.values():
                if not future.done():
                    future.set_exception(error())
            table.clear()
        self._get_keys.clear()
        self._fail_puts(error)
        for key in list(self._buffer_waiters):
            self._wake(key)
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
