"""The weight store handle: ``ws = await comm.weights(name)``. See ``docs/weights.md``.

Publishers capture a tree into a new version (one copy, into a shared-memory bucket of
their own :class:`~rlinf.weights._holder.Holder`); pullers ask the store's directory
(the holder of shard 0) for the newest complete version, copy it into their tensors
(straight from the holder's shared memory on the same node; on another node from its
relay's, which streams the version from the previous relay of the chain or the
holder, :mod:`._relay`) and release it. A version's buckets are reused only once no
pull reads them, so a pull never mixes two versions; a pull whose relay stopped asks
the directory again, and returns only once one version's every byte is in.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from typing import Any

import numpy as np

from ..channel.server import check_name
from ..core.interface import Core, HasCore
from ..errors import ClosedError, CommTimeoutError, DecodeError, PeerLostError, RlinfError
from ..util.copier import Copier
from ..util.futures import retrieve
from ._buckets import Buckets, read_stamp
from ._calls import Calls, error_message, tag_of
from ._holder import CHUNK, WINDOW, Holder, holder_address, spans
from ._layout import Layout, flatten, fresh, match, pack, unpack, unpack_range
from ._mapped import Mappings
from ._relay import Stream, Streams
from .stats import WeightStats

__all__ = ["WeightStore", "open_store"]

#: Trees of fewer bytes are copied on the event loop (a thread hop costs more).
_INLINE = 1 << 20
_LAYOUTS_KEPT = 8
#: Times a pull asks the directory again after a relay it read from was lost.
_REROUTES = 8


class WeightStore:
    """A handle to the versioned weight store ``name`` (``await comm.weights(name)``).

    The name is cluster-wide: every handle of that name, in any process, sees the same
    versions. The store appears with its first publish; pulls made before wait for it.
    One handle per communicator and name (``comm.weights`` returns the same one).
    """

    def __init__(self, core: Core, name: str) -> None:
        self.name = check_name(name)
        self._core = core
        self._tag = tag_of(name)
        self._directory = holder_address(name, 0)
        self._calls = Calls(core, self._tag)
        self._holder: Holder | None = None
        self._publish_lock = asyncio.Lock()
        self._published: int | None = None
        self._fetches: dict[int, tuple[str, asyncio.Queue]] = {}
        self._layouts: collections.OrderedDict[str, Layout] = collections.OrderedDict()
        self._mappings = Mappings()
        self._relay_pool: Buckets | None = None        # buckets this handle fills as its node's relay
        self._relay_held: dict[int, list] = {}          # version -> those buckets, until freed
        self._streams = Streams(core.address)          # what this handle relays, served as it lands
        self._copier = Copier()
        self._reader: asyncio.Task | None = None
        self._found = False              # the directory is known to exist (until it goes)
        self._epoch = 0                  # counts the directory's departures
        self._closed = False
        self._pulls = 0
        self._bytes: collections.Counter = collections.Counter()
        self._last_pull: float | None = None

    def __repr__(self) -> str:
        return (f"<WeightStore {self.name!r} via {self._core.address} published={self._published} "
                f"pulls={self._pulls} in_flight={len(self._calls)}>")

    # -- publishing --------------------------------------------------------------------
    async def publish(self, tree: Any, version: int, *, shard: int | None = None,
                      num_shards: int | None = None, timeout: float | None = None) -> None:
        """Capture ``tree`` as ``version`` (or as shard ``shard`` of ``num_shards`` of it).

        Args:
            tree: torch tensors and numpy arrays (any device, any strides) in nested
                dicts, lists and tuples. Shards of one version hold distinct dict keys.
            version: an int, larger than every version published before.
            shard, num_shards: for sharded publishers (each rank its part): both or
                neither, the same ``num_shards`` every time, ``0 <= shard < num_shards``.
            timeout: seconds for all of it (None: ``RLINF_TIMEOUT`` if set, else
                forever): the first publish of shard k > 0 waits for shard 0's
                publisher to appear, and every one for the directory to register it.

        Returns once the data is captured: the caller may change its tensors then. An
        unsharded version is visible (``latest()``, pulls) when this returns; a sharded
        one once every shard returned. A publish that timed out or was cancelled while
        the directory registered it may still be registered: publish a newer version.

        Raises:
            ValueError: ``version`` not newer, bad ``shard``/``num_shards``, or another
                process already publishes this shard (AddressInUseError).
            TypeError: a leaf that is not a tensor or array.
            RlinfError: no shared memory left for the version.
            PeerLostError: (sharded) the directory, shard 0's publisher, is gone.
            CommTimeoutError: not done within ``timeout``.
        """
        self._core.check_open()
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}")
        shard, num_shards = _check_shard(shard, num_shards)
        layout, leaves = Layout.of(tree)
        timeout = self._core.timeout_of(timeout)
        try:
            async with asyncio.timeout(timeout):
                await self._publish(layout, leaves, version, shard, num_shards)
        except TimeoutError:
            raise CommTimeoutError(f"weight store {self.name!r}: version {version} (shard {shard} of "
                                   f"{num_shards}) not published within {timeout} s") from None

    async def _publish(self, layout: Layout, leaves: list, version: int, shard: int, num_shards: int) -> None:
        async with self._publish_lock:
            if self._published is not None and version <= self._published:
                raise ValueError(f"version {version} is not newer than version {self._published}, "
                                 f"published before by this handle")
            holder = await self._holder_for(shard, num_shards)
            bucket = await holder.take_bucket(layout.total)
            running: list[asyncio.Future] = []
            try:
                await self._run(pack, layout, leaves, bucket.array, self._copier, size=layout.total,
                                running=running)
            except BaseException:
                _after(running, lambda: holder.drop_bucket(bucket))   # once the copy stopped writing
                raise
            await holder.add(version, bucket, layout)
            self._published = version

    async def _holder_for(self, shard: int, num_shards: int) -> Holder:
        holder = self._holder
        if holder is not None:
            if (holder.shard, holder.num_shards) != (shard, num_shards):
                raise ValueError(f"this handle publishes shard {holder.shard} of {holder.num_shards}, "
                                 f"not {shard} of {num_shards}")
            return holder
        holder = Holder(self._core, self.name, shard, num_shards)
        try:
            await holder.start()
        except BaseException:          # refused, timed out or cancelled: leave the cluster again
            asyncio.get_running_loop().create_task(holder.aclose()).add_done_callback(retrieve)
            raise
        self._holder = holder
        self._core.add_closer(holder.aclose)
        return holder

    # -- pulling -----------------------------------------------------------------------
    async def pull(self, into: Any, *, newer_than: int | None = None, timeout: float | None = None) -> int:
        """Copy the newest complete version into the tensors of ``into``, in place.

        Args:
            into: a tree like the published one (the same keys, shapes and dtypes; its
                tensors may be on any device and have any strides).
            newer_than: wait for a version newer than this first (None: take the newest
                there is; if none was published yet, wait for the first).
            timeout: seconds for all of it (None: ``RLINF_TIMEOUT`` if set, else forever).

        Returns:
            the version copied. Every tensor of ``into`` then holds that version: a
            pull never mixes two versions.

        Raises:
            ValueError: a key, shape or dtype differs (naming the first; nothing was
                copied then). TypeError: a leaf of ``into`` is not a tensor or array.
            CommTimeoutError: no such version within ``timeout``.
            PeerLostError: the publisher holding the data is gone.
            ClosedError: the communicator is closed.
        """
        _, targets = flatten(into)
        return (await self._pull(targets, newer_than, timeout))[1]

    async def get(self, *, newer_than: int | None = None, timeout: float | None = None) -> tuple[Any, int]:
        """Like :meth:`pull`, into fresh CPU tensors (numpy arrays where numpy arrays
        were published): returns ``(tree, version)``; the tree is the caller's."""
        return await self._pull(None, newer_than, timeout)

    async def _pull(self, targets: list | None, newer_than: int | None,
                    timeout: float | None) -> tuple[Any, int]:
        core = self._core
        core.check_open()
        if newer_than is not None and (isinstance(newer_than, bool) or not isinstance(newer_than, int)):
            raise TypeError(f"newer_than must be an int or None, got {newer_than!r}")
        timeout = core.timeout_of(timeout)
        lost: list[tuple[int, str, int]] = []      # told with the next acquire only
        reroutes = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    number, refs, epoch, role, token = await self._acquire(newer_than, lost)
                    lost = []
                    held = True
                    try:
                        layouts = [ref[1] for ref in refs]
                        if targets is None:
                            tree, leaves = fresh(layouts)
                            plans = [(per, list(range(len(per)))) for per in leaves]
                        else:
                            tree, plans = None, match(layouts, targets)
                        held = False
                        await self._copy(number, refs, plans, epoch, role, token)
                        return tree, number
                    except PeerLostError as exc:
                        if self._epoch != epoch:          # whatever failed first: the store is gone
                            raise PeerLostError(f"{self._directory}, the publisher of weight store "
                                                f"{self.name!r}, is gone", peer=self._directory) from exc
                        # a relay it read from stopped (not a holder): ask again, telling
                        # the directory which relay (its grant's req: not a later relay at
                        # that address); what was copied is overwritten
                        if _is_holder(exc.peer) or reroutes >= _REROUTES:
                            raise
                        reroutes += 1
                        lost = [(number, exc.peer, ref[6]) for ref in refs if ref[0] == exc.peer][:1]
                    finally:
                        if held:
                            self._give_up(number, role, token)
        except TimeoutError:
            raise CommTimeoutError(f"no version of weight store {self.name!r}"
                                   f"{'' if newer_than is None else f' newer than {newer_than}'} "
                                   f"within {timeout} s") from None

    async def _acquire(self, newer_than: int | None, lost: list | None = None) -> tuple[int, list, int, str, str]:
        """A grant of the directory: ``(version, refs, epoch, role, token)`` (``token``:
        the directory's, sent back with the release). Asks again, with no layout taken
        as known, if one it was sent without was evicted meanwhile. ``lost``: the
        ``(version, relay, relay's req)`` this pull found gone since it asked last, for
        the directory to route around (told once)."""
        await self._find()
        epoch = self._epoch
        node = self._core.info.node_id if self._core.info is not None else ""
        known = list(self._layouts)
        while True:
            req, answer = self._calls.start(self._directory, "acquire", newer_than, known, node, lost or [])
            lost = None
            try:
                number, shards, role, token = await answer
            except asyncio.CancelledError:
                if self._calls.abandon(req):       # still waiting there: stop (a late grant is released)
                    self._send(self._directory, ("cancel", req))
                elif answer.done() and not answer.cancelled() and answer.exception() is None:
                    number, _, role, token = answer.result()      # granted as it was cancelled
                    self._give_up(number, role, token)
                raise
            refs = self._refs(shards)
            if refs is not None:
                return number, refs, epoch, role, token
            self._give_up(number, role, token)
            if not known:
                raise RlinfError(f"weight store {self.name!r}: a grant of version {number} lacks a layout")
            known = []

    def _refs(self, shards: list) -> list | None:
        """The granted shards with their layouts (None: one's layout is not known here):
        ``(holder, layout, node, segment, size, stamp, relay)`` each, ``holder`` the
        address to read from (a relay's, then ``relay`` is its acquire's req). Every
        layout of the grant is kept (at least as many as shards), then the oldest others
        are evicted."""
        layouts = []
        for holder, node, segment, size, key, wire, stamp, _ in shards:
            layout = self._layouts.get(key)
            if layout is None:
                if wire is None:
                    return None
                layout = self._layouts[key] = Layout.from_wire(wire)
            layouts.append(layout)
        for _, _, _, _, key, _, _, _ in shards:
            self._layouts.move_to_end(key)
        while len(self._layouts) > max(_LAYOUTS_KEPT, 2 * len(shards)):
            self._layouts.popitem(last=False)
        self._mappings.keep = max(self._mappings.keep, 3 * len(shards) + 1)
        return [(holder, layout, node, segment, size, stamp, relay)
                for (holder, node, segment, size, _, _, stamp, relay), layout in zip(shards, layouts)]

    async def _copy(self, number: int, refs: list, plans: list, epoch: int, role: str, token: str) -> None:
        """Copy version ``number`` per plan, then release it (once every copy ended, also
        when this is cancelled or fails midway). As its node's relay (``role``), stream
        the remote shards into buckets of this process first, serving each chunk to the
        node's other pullers and the next relay as it lands (:mod:`._relay`)."""
        mine = self._core.info.node_id if self._core.info is not None else None
        moved = collections.Counter()
        running: list[asyncio.Future] = []
        relayed: list[list] = []           # [shard, segment, size, stamp] of the buckets filled here
        buckets: list = []
        streams: dict[int, Stream] = {}
        done = False
        try:
            if role == "relay":
                for k, (holder, layout, node, segment, size, stamp, _) in enumerate(refs):
                    if layout.total and node != mine:
                        own = await self._relay_buckets().take(layout.total)
                        buckets.append(own)
                        streams[k] = Stream(number, k, own.array, layout, own)
                        self._streams.add(streams[k])
                        relayed.append([k, own.name, layout.total, own.stamp])
                self._send(self._directory, ("relaying", number, relayed, token))
            for k, ((holder, layout, node, segment, size, stamp, _), (targets, order)) in enumerate(zip(refs, plans)):
                if not layout.total:
                    continue
                if k in streams:
                    await self._fetch(holder, number, layout, targets, order, running, stream=streams[k])
                elif node != mine or not await self._local(holder, number, k, layout, segment, stamp, targets,
                                                           order, running):
                    await self._fetch(holder, number, layout, targets, order, running)
                moved["shm" if node == mine else "net"] += layout.total
            if self._epoch != epoch:
                raise PeerLostError(f"the publisher of weight store {self.name!r} left during the pull",
                                    peer=self._directory)
            done = True
        except BaseException as exc:
            if streams:
                self._send_all(self._streams.fail(number, exc))
            raise
        finally:     # the relay's answer first, then (once no copy reads the version) the release
            if role == "relay":
                if done:
                    self._relay_held[number] = buckets
                    self._send(self._directory, ("relayed", number, relayed, token))
                else:
                    self._send(self._directory, ("relayed", number, None, token))
                    # reused once its copy threads stopped and the chunks it forwarded are out
                    _after(running, lambda: [self._relay_pool.give(b) for b in buckets])
            _after(running, lambda: self._release(number, "net" if moved["net"] else "shm", sum(moved.values()),
                                                  token))
        self._pulls += 1
        self._last_pull = time.time()
        self._bytes.update(moved)

    async def _local(self, holder: str, number: int, k: int, layout: Layout, segment: str, stamp: int,
                     targets: list, order: list, running: list) -> bool:
        """Copy shard ``k`` from a bucket on this node: a holder's, whole; or its relay's,
        each chunk once it landed there (the relay says how far it is, ``landed``).
        False: the holder's bucket cannot be mapped here (not shareable after all, or
        gone): fetch it from the holder instead."""
        try:
            mapped = self._mappings.get(segment, layout.total)
        except OSError:
            if _is_holder(holder):
                return False
            raise PeerLostError(f"this node's copy of version {number} of {self.name!r} ({holder}'s) is gone",
                                peer=holder) from None
        self._check_stamp(mapped, stamp, number, holder)
        if _is_holder(holder):
            await self._run(unpack, layout, mapped[:layout.total], targets, order, self._copier,
                            size=layout.total, running=running)
        else:
            by_leaf = dict(zip(order, targets))
            req, queue = self._subscribe(holder, ("follow", number, k))
            copied, done = 0, False
            try:
                while copied < layout.total:      # copy whatever landed since, in one go
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    landed = min(int(item[0]), layout.total)
                    await self._run(unpack_range, layout, mapped, copied, landed, by_leaf, self._copier,
                                    size=landed - copied, running=running)
                    copied = max(copied, landed)
                done = True
            finally:
                self._unsubscribe(holder, req, done)
        self._check_stamp(mapped, stamp, number, holder)     # refilled while copied: may be torn
        return True

    def _subscribe(self, src: str, request: tuple) -> tuple[int, asyncio.Queue]:
        """Send ``(op, req, *args)`` to ``src``: ``req`` and the queue its answers
        (chunks, offsets, an error) come into."""
        queue: asyncio.Queue = asyncio.Queue()
        req = self._calls.next_id()
        self._fetches[req] = (src, queue)
        try:
            self._send(src, (request[0], req, *request[1:]), must=True)
        except BaseException:
            del self._fetches[req]
            raise
        return req, queue

    def _unsubscribe(self, src: str, req: int, done: bool) -> None:
        """The answers to ``req`` are not wanted any more (``done``: all came)."""
        self._fetches.pop(req, None)
        if not done:
            self._send(src, ("unfetch", req))

    async def _fetch(self, holder: str, number: int, layout: Layout, targets: list, order: list,
                     running: list, stream: Stream | None = None) -> None:
        """The bytes of a version from a holder (or a relay) on another node, chunk by
        chunk, into a buffer of the whole shard (the relay's bucket of ``stream``, served
        from there as each chunk lands; else one of its own), and from there into the
        targets while the next arrives; at most :data:`WINDOW` chunks ahead (queued here
        or on their way), and none more once this stops early."""
        by_leaf = dict(zip(order, targets))
        pieces = spans(layout.total, CHUNK)
        buf = stream.array if stream is not None else np.empty(layout.total, np.uint8)
        req, queue = self._subscribe(holder, ("fetch", number, CHUNK, WINDOW,
                                              stream.shard if stream is not None else None))
        done = False
        try:
            for k, (start, end) in enumerate(pieces):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if k + WINDOW < len(pieces):     # room for one more
                    self._send(holder, ("more", req, 1))
                at, data = item
                if at != start or not isinstance(data, np.ndarray) or data.nbytes != end - start:
                    raise RlinfError(f"weight store {self.name!r}: a chunk at {at} does not fit the layout")
                await self._run(self._copier.copy, [(buf[start:end], data.reshape(-1).view(np.uint8))],
                                size=end - start, running=running)
                if stream is not None:
                    self._send_all(stream.land(end))
                await self._run(unpack_range, layout, buf, start, end, by_leaf, self._copier,
                                size=end - start, running=running)
            done = True
        finally:
            self._unsubscribe(holder, req, done)

    def _check_stamp(self, mapped: np.ndarray, stamp: int, number: int, holder: str) -> None:
        if read_stamp(mapped) != stamp:
            raise PeerLostError(f"version {number} of weight store {self.name!r} was freed at {holder} while "
                                f"this pull read it (the store's directory left): the copy may be torn",
                                peer=holder)

    def _release(self, number: int, path: str, nbytes: int, token: str) -> None:
        self._send(self._directory, ("release", number, path, nbytes, token))

    def _give_up(self, number: int, role: str, token: str) -> None:
        """Release a version granted and not read (a relay says it will not relay)."""
        if role == "relay":
            self._send(self._directory, ("relayed", number, None, token))
        self._release(number, "", 0, token)

    def _relay_buckets(self) -> Buckets:
        if self._relay_pool is None:
            self._relay_pool = Buckets()
        return self._relay_pool

    def _free_relayed(self, number: int | None) -> None:
        """The directory freed ``number`` (None: every version, it is gone): its buckets
        here may be reused (once the chunks sent from them are out), and the pulls still
        reading them from here fail."""
        why = PeerLostError(f"the store's directory {'left' if number is None else 'freed it'}",
                            peer=self._directory)
        self._send_all(self._streams.free(number, why))
        for n in list(self._relay_held) if number is None else [number]:
            for bucket in self._relay_held.pop(n, ()):
                self._relay_pool.give(bucket)

    # -- asking the directory ----------------------------------------------------------
    async def latest(self, *, timeout: float | None = None) -> int | None:
        """The newest complete version, or None (none yet, or no such store yet).

        Args:
            timeout: seconds to wait for the directory's answer (None: ``RLINF_TIMEOUT``
                if set, else forever).

        Raises:
            PeerLostError, ClosedError; CommTimeoutError after ``timeout``.
        """
        return await self._ask("latest", None, timeout)

    async def stats(self, *, timeout: float | None = None) -> WeightStats:
        """A snapshot of the store (:class:`~rlinf.weights.stats.WeightStats`; readable
        when printed): versions held, sizes, subscribers, bytes moved per path, last
        publish and pull times, and this handle's own pulls.

        Args:
            timeout: as for :meth:`latest`.

        Raises:
            PeerLostError, ClosedError; CommTimeoutError after ``timeout``.
        """
        data = await self._ask("stats", {}, timeout)
        return WeightStats.from_dict(data, name=self.name, this_pulls=self._pulls,
                                     this_bytes_by_path=dict(self._bytes), this_last_pull=self._last_pull,
                                     this_published=self._published)

    async def _ask(self, op: str, absent: Any, timeout: float | None) -> Any:
        core = self._core
        core.check_open()
        timeout = core.timeout_of(timeout)
        try:
            async with asyncio.timeout(timeout):
                if not self._found and await core.lookup(self._directory, wait=False, timeout=timeout) is None:
                    return absent
                await self._find()
                _, answer = self._calls.start(self._directory, op)
                return await answer
        except TimeoutError:
            raise CommTimeoutError(f"weight store {self.name!r}: no answer to {op} in {timeout} s") from None

    async def _find(self) -> None:
        """Wait for the directory to exist (the first publish), and read its answers."""
        if self._closed:
            raise ClosedError(f"weight store handle {self.name!r} is closed")
        if not self._found:
            await self._core.lookup(self._directory, wait=True, timeout=None)
            self._found = True
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"rlinf-weights-{self.name}")

    async def _read(self) -> None:
        core = self._core
        while True:
            try:
                message, src = await core.recv_any(self._tag)
            except DecodeError:
                continue
            except (ClosedError, asyncio.CancelledError):
                return
            if not isinstance(message, (list, tuple)) or len(message) < 2:
                continue
            op = message[0]
            if op in ("chunk", "landed"):
                fetch = self._fetches.get(message[1])
                if fetch is not None and fetch[0] == src and len(message) == (4 if op == "chunk" else 3):
                    fetch[1].put_nowait(tuple(message[2:]))
            elif op in ("fetch", "follow", "more", "unfetch"):      # this handle relays to others
                try:
                    self._send_all(self._streams.handle(src, message))
                except (ValueError, TypeError, IndexError) as exc:
                    self._send(src, error_message(message[1], exc))
            elif op == "error" and message[1] in self._fetches:
                self._fetches[message[1]][1].put_nowait(PeerLostError(str(message[3]), peer=src))
            elif op == "free" and src == self._directory:
                self._free_relayed(message[1])
            elif not self._calls.settle(message) and op == "grant" and len(message) == 6:
                self._give_up(message[2], message[4], message[5])     # granted after its pull gave up

    def _send_all(self, messages: list[tuple[str, tuple, Any]]) -> None:
        """Send a relay's messages (:mod:`._relay`); a chunk keeps the bucket it is a
        view of from reuse until it is out."""
        for dst, message, reads in messages:
            future = self._send(dst, message)
            if future is not None and reads is not None:
                self._relay_pool.reading(reads, future)

    def _send(self, dst: str, message: tuple, *, must: bool = False) -> asyncio.Future | None:
        try:
            future = self._core.start_send(message, dst, self._tag)
        except RlinfError:
            if must:
                raise
            return None              # the peer is gone or we are closing: nothing to tell it
        future.add_done_callback(retrieve)
        return future

    def _on_gone(self, address: str, incarnation: str) -> None:
        error = PeerLostError(f"{address}, a part of weight store {self.name!r}, is gone", peer=address)
        self._calls.fail(address, error)
        for holder, queue in self._fetches.values():     # the directory gone: every source frees
            if holder == address or address == self._directory:
                queue.put_nowait(error)
        self._streams.gone(address)
        if address == self._directory:
            self._found = False
            self._epoch += 1
            self._free_relayed(None)

    async def _run(self, fn: Any, *args: Any, size: int, running: list) -> None:
        """``fn(*args)``: on the loop when small, else in a thread, whose future goes in
        ``running`` (a cancelled caller returns while the thread still copies)."""
        if size < _INLINE:
            fn(*args)
            return
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        running.append(future)
        await asyncio.shield(future)

    def close(self) -> None:
        """Stop this handle (the communicator's closing does it): pending calls fail
        with ClosedError. A holder here closes with the communicator."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        error = ClosedError(f"communicator {self._core.address} is closed")
        self._calls.fail(None, error)
        for _, queue in self._fetches.values():
            queue.put_nowait(error)
        self._mappings.close()
        self._copier.close()
        if self._relay_pool is not None:
            self._relay_pool.close()


def _after(running: list[asyncio.Future], then: Any) -> None:
    """``then()`` once every future of ``running`` is done (now, if they are)."""
    pending = [f for f in running if not f.done()]
    if not pending:
        then()
        return
    left = [len(pending)]

    def one_done(future: asyncio.Future) -> None:
        retrieve(future)
        left[0] -= 1
        if not left[0]:
            then()

    for f in pending:
        f.add_done_callback(one_done)


def _is_holder(peer: str | None) -> bool:
    """Whether ``peer`` (of a PeerLostError) is a holder, or unknown: not a relay."""
    return peer is None or peer.startswith("weights.")


def _check_shard(shard: Any, num_shards: Any) -> tuple[int, int]:
    if shard is None and num_shards is None:
        return 0, 1
    for what, value in (("shard", shard), ("num_shards", num_shards)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be an int (give shard and num_shards together), got {value!r}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    return shard, num_shards


# -- handles per communicator (closed with it) ------------------------------------------------
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def open_store(comm: HasCore, name: str) -> WeightStore:
    """``comm.weights(name)``: this communicator's handle to the store ``name``.

    Raises:
        ValueError: a bad name. ClosedError: the communicator is closed.
    """
    core = comm.internal
    core.check_open()
    stores = _stores.get(core)
    if stores is None:
        stores = _stores[core] = {}
        core.add_closer(lambda: [s.close() for s in list(stores.values())])
        core.on_peer_gone(lambda address, inc: [s._on_gone(address, inc) for s in list(stores.values())])
    store = stores.get(name)
    if store is None:
        store = stores[name] = WeightStore(core, name)
    return store
