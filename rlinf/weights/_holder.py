"""The holder of a weight store's shard: the publisher's side, in the publisher's process.

A process that publishes shard ``k`` of store ``name`` joins the cluster as the worker
``weights.<name>:<k>`` (its own small communicator, registered ``exclusive``: the name is
found cluster-wide the way a channel's server is, and two publishers of one shard
cannot both hold it). It owns the shared-memory buckets of its versions
(:class:`~rlinf.weights._buckets.Buckets`: files named after the process, swept if it
dies) and serves:

* ``free`` (from the directory): a version's bucket may be reused;
* ``fetch`` (from pullers on other nodes): the bytes of a version, in chunks of a few
  MiB, over the normal messaging path (the bulk stream between nodes), at most
  ``window`` chunks ahead of the puller, which asks for ``more`` as it takes them (its
  memory stays bounded) and says ``unfetch`` when it stops early (nothing more is sent);
* when ``k == 0``, the directory (:mod:`._directory`): ``shard``, ``acquire``,
  ``release``, ``cancel``, ``relayed``, ``latest``, ``stats``.

When the publisher's communicator closes, the holder closes with it: its buckets are
unlinked (pullers still copying keep their mappings) and pullers waiting get
``PeerLostError``. When the directory leaves, the other holders free every version at
once (the directory knew the readers): a same-node puller still copying one sees the
bucket's stamp change if it is refilled (:mod:`._buckets`) and fails; a bucket whose
bytes are still being sent to another node is reused only once the sends are done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from ..core.communicator import CoreCommunicator
from ..core.interface import Core
from ..errors import ClosedError, DecodeError, PeerLostError, RlinfError
from ._buckets import Bucket, Buckets
from ._calls import Calls, error_message, tag_of
from ._directory import Directory, Grant, ShardRef, Version
from ._layout import Layout

__all__ = ["Holder", "holder_address", "spans", "CHUNK", "WINDOW"]

log = logging.getLogger("rlinf.weights")

#: Bytes per ``fetch`` message, as the puller asks: small enough that copying one
#: chunk overlaps the next one's transfer, and that a relay forwards a chunk soon after
#: it began to receive the version (each hop of the chain adds about one chunk's time).
CHUNK = 8 << 20
MIN_CHUNK, MAX_CHUNK = 1 << 20, 1 << 30
#: Chunks a fetch sends ahead of the puller (one on the wire, some queued, one copied).
WINDOW = 8
MAX_WINDOW = 64


def holder_address(name: str, shard: int) -> str:
    """The worker address of the holder of ``name``'s shard ``shard`` (0: the directory)."""
    return f"weights.{name}:{shard}"


def spans(total: int, size: int = CHUNK) -> list[tuple[int, int]]:
    """A bucket of ``total`` bytes cut into chunks of ``size`` bytes (the last one
    shorter): ``(start, end)`` each. Chunks cut through tensors: a relay forwards the
    first few MiB of a large tensor while the rest is still on its way."""
    return [(start, min(start + size, total)) for start in range(0, total, size)]


class Holder:
    """Holds the buckets of one shard (see the module docstring).

    Args:
        core: the publisher's communicator (for the cluster and the closing).
        name, shard, num_shards: the store and the shard published here.
    """

    def __init__(self, core: Core, name: str, shard: int, num_shards: int) -> None:
        self.name, self.shard, self.num_shards = name, shard, num_shards
        self.address = holder_address(name, shard)
        self.directory_address = holder_address(name, 0)
        self.tag = tag_of(name)
        meta = {"kind": "weights", "store": name, "shard": shard}
        self.comm = CoreCommunicator(self.address, manager=core.manager_address, token=core.token, meta=meta,
                                     exclusive=True)
        self.buckets = Buckets()
        self.versions: dict[int, Bucket] = {}              # version -> its bucket
        self.layouts: dict[int, Layout] = {}
        self._fetching: dict[tuple[str, int], _Fetch] = {}  # (puller, req) -> what is left to send
        self.directory = Directory(name) if shard == 0 else None
        self.node = ""
        self._calls: Calls | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<Holder {self.address} versions={sorted(self.versions)} {self.buckets!r}>"

    async def start(self) -> Holder:
        """Join the cluster as :attr:`address`.

        Raises:
            AddressInUseError: another live process holds this shard.
        """
        await self.comm.start()
        internal = self.comm.internal
        self.node = internal.info.node_id if internal.info is not None else ""
        self._calls = Calls(internal, self.tag)
        internal.on_peer_gone(self._on_gone)
        self._task = asyncio.get_running_loop().create_task(self._serve(), name=f"rlinf-{self.address}")
        return self

    # -- publishing --------------------------------------------------------------------
    async def take_bucket(self, nbytes: int) -> Bucket:
        """A bucket of at least ``nbytes`` for a new version (see :class:`Buckets`).

        Raises:
            RlinfError: no room in ``/dev/shm``.
        """
        return await self.buckets.take(nbytes)

    def drop_bucket(self, bucket: Bucket) -> None:
        """Give back ``bucket`` (holding no version), once no send reads it."""
        self.buckets.give(bucket)

    async def add(self, number: int, bucket: Bucket, layout: Layout) -> None:
        """Make ``bucket`` (filled) version ``number`` of this shard: with the directory
        here, at once; else by asking it.

        Cancelled while the directory has not answered, the bucket stays this
        version's until the answer comes: the directory may have registered it, and then
        only its ``free`` gives the bucket back (a refusal or its departure does too).

        Raises:
            ValueError: the directory refused it (not newer, shard count differs).
            PeerLostError: the directory is gone.
        """
        ref = ShardRef(self.address, self.node, bucket.name, layout.total, layout.key, layout.to_wire(),
                       bucket.stamp)
        self.versions[number], self.layouts[number] = bucket, layout
        try:
            if self.directory is not None:
                grants, freed = self.directory.add_shard(number, self.shard, self.num_shards, ref)
                self._answer(grants)
                self._free(freed)
            else:
                _, answer = self._calls.start(self.directory_address, "shard", number, self.shard, self.num_shards,
                                              *dataclasses.astuple(ref))
                try:
                    await asyncio.shield(answer)
                except asyncio.CancelledError:
                    if not answer.done():
                        answer.add_done_callback(lambda f: self._registered(number, bucket, f))
                        raise
                    if answer.cancelled() or answer.exception() is not None:
                        self._unadd(number, bucket)
                    raise
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError) or self.directory is not None:
                self._unadd(number, bucket)
            raise

    def _registered(self, number: int, bucket: Bucket, answer: asyncio.Future) -> None:
        """The directory answered a registration its publisher stopped waiting for."""
        if answer.cancelled() or answer.exception() is not None:
            self._unadd(number, bucket)

    def _unadd(self, number: int, bucket: Bucket) -> None:
        if self.versions.get(number) is bucket:
            del self.versions[number], self.layouts[number]
            self.drop_bucket(bucket)

    # -- serving -----------------------------------------------------------------------
    async def _serve(self) -> None:
        internal = self.comm.internal
        while True:
            try:
                message, src = await internal.recv_any(self.tag)
            except DecodeError as exc:
                log.warning("rlinf %s: dropped an undecodable message: %s", self.address, exc)
                continue
            except (ClosedError, asyncio.CancelledError):
                return
            try:
                self._handle(src, message)
            except (ValueError, TypeError, LookupError, IndexError, RlinfError) as exc:
                if isinstance(message, (list, tuple)) and len(message) > 1 and isinstance(message[1], int):
                    self._send(src, error_message(message[1], exc))
                else:
                    log.warning("rlinf %s: bad request from %s: %r", self.address, src, exc)

    def _handle(self, src: str, message: tuple) -> None:
        op = message[0]
        if op in ("value", "error"):
            self._calls.settle(message)
        elif op == "free":
            self._free_local(message[1])
        elif op == "fetch":
            self._fetch(src, *message[1:])
        elif op == "more":
            self._more(src, message[1], message[2])
        elif op == "unfetch":
            self._fetching.pop((src, message[1]), None)
        elif self.directory is None:
            raise ValueError(f"{self.address} is not the directory of {self.name!r} (got {op!r})")
        elif op == "shard":
            req, number, shard, num_shards, *ref = message[1:]
            grants, freed = self.directory.add_shard(number, shard, num_shards, ShardRef(*ref))
            self._send(src, ("value", req, None))
            self._answer(grants)
            self._free(freed)
        elif op == "acquire":
            req, newer_than, known, node, *lost = message[1:]
            for number, relay, relay_req in lost[0] if lost else ():     # relays the puller found gone
                self._answer(self.directory.relay_lost(str(relay), number, relay_req))
            try:
                grant = self.directory.acquire(src, req, newer_than, str(node))
            except LookupError as exc:
                raise PeerLostError(str(exc)) from None
            if grant is not None:
                self._answer([grant], set(known))
        elif op in ("relaying", "relayed"):
            number, segments, token = message[1:]
            segments = None if segments is None else {int(k): (str(s), int(n), int(t)) for k, s, n, t in segments}
            stale = token != self.directory.token          # granted by an earlier directory
            if op == "relaying":
                if not stale and segments is not None:
                    self._answer(self.directory.relay_started(src, number, segments))
                return
            grants = None if stale else self.directory.relayed(src, number, segments)
            if segments is not None and grants is None:
                self._send(src, ("free", number))           # freed or failed meanwhile: so are its copies
            self._answer(grants or [])
        elif op == "release":
            number, path, nbytes, token = message[1:]
            if token == self.directory.token:
                self._free(self.directory.release(src, number, path, nbytes))
        elif op == "cancel":
            self.directory.cancel(src, message[1])
            self._free(self.directory.collect())
        elif op == "latest":
            self._send(src, ("value", message[1], self.directory.latest))
        elif op == "stats":
            self._send(src, ("value", message[1], self.directory.snapshot()))
        else:
            raise ValueError(f"unknown weight store request {op!r}")

    def _send(self, dst: str, message: tuple) -> asyncio.Future | None:
        try:
            future = self.comm.internal.start_send(message, dst, self.tag)
        except RlinfError as exc:            # gone or closing: its own hooks tidy up
            log.debug("rlinf %s: cannot answer %s: %s", self.address, dst, exc)
            return None
        future.add_done_callback(_ignore)
        return future

    def _answer(self, grants: list[Grant], known: set[str] | None = None) -> None:
        for g in grants:
            shards = []
            node = g.via.node if g.via is not None else ""
            for k in sorted(g.version.shards):
                wire = g.version.shards[k].to_wire(known is None or g.version.shards[k].layout_key not in known)
                relay = 0                  # read from a relay: its req names it in a lost-relay report
                if g.via is not None and k in g.via.segments:       # the node's copy, at its relay
                    wire[0], wire[1], (wire[2], wire[3], wire[6]) = g.via.address, node, g.via.segments[k]
                    relay = g.via.req
                elif g.source is not None and k in g.source.segments:   # streamed from the upstream relay
                    wire[0], wire[1] = g.source.address, g.source.node
                    relay = g.source.req
                shards.append([*wire, relay])
            self._send(g.src, ("grant", g.req, g.version.number, shards, "relay" if g.relay else "",
                               self.directory.token))

    def _free(self, versions: list[Version]) -> None:
        for version in versions:
            for ref in version.shards.values():
                if ref.holder == self.address:
                    self._free_local(version.number)
                else:
                    self._send(ref.holder, ("free", version.number))
            for relay in [*version.relays.values(), *version.retired]:
                if relay.ready:
                    self._send(relay.address, ("free", version.number))

    def _free_local(self, number: int) -> None:
        bucket = self.versions.pop(number, None)
        self.layouts.pop(number, None)
        if bucket is not None:
            self.drop_bucket(bucket)
        for (src, req), fetch in list(self._fetching.items()):   # only when the directory left
            if fetch.number == number:
                del self._fetching[src, req]
                self._send(src, error_message(req, PeerLostError(
                    f"version {number} of {self.name!r} was freed at {self.address} during the fetch "
                    f"(the store's directory left)", peer=self.address)))

    def _fetch(self, src: str, req: int, number: int, size: int, window: int, shard: int | None = None) -> None:
        """Send version ``number``'s bytes to ``src``, a chunk of ``size`` bytes per
        message (:func:`spans`), ``window`` chunks ahead of its ``more`` (the reader holds
        the version: the bucket stays as it is meanwhile; it cut the same chunks). The
        ``shard`` a relay names is this holder's."""
        if isinstance(size, bool) or not isinstance(size, int) or not MIN_CHUNK <= size <= MAX_CHUNK:
            raise ValueError(f"chunk size {size!r} out of [{MIN_CHUNK}, {MAX_CHUNK}]")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"fetch window {window!r} out of [1, {MAX_WINDOW}]")
        bucket, layout = self.versions.get(number), self.layouts.get(number)
        if bucket is None:
            raise PeerLostError(f"version {number} of {self.name!r} is no longer held by {self.address}")
        self._fetching[src, req] = _Fetch(number, bucket, spans(layout.total, size), window)
        self._pump(src, req)

    def _more(self, src: str, req: int, count: int) -> None:
        fetch = self._fetching.get((src, req))
        if fetch is not None and isinstance(count, int) and 0 < count <= MAX_WINDOW:
            fetch.credit += count
            self._pump(src, req)

    def _pump(self, src: str, req: int) -> None:
        """Send the chunks the puller has room for."""
        fetch = self._fetching[src, req]
        bucket = fetch.bucket
        while fetch.credit > 0 and fetch.next < len(fetch.pieces):
            start, end = fetch.pieces[fetch.next]
            fetch.next += 1
            fetch.credit -= 1
            sent = self._send(src, ("chunk", req, start, bucket.array[start:end]))
            if sent is not None:           # the bucket is not reused before the bytes are out
                self.buckets.reading(bucket, sent)
        if fetch.next == len(fetch.pieces):
            del self._fetching[src, req]

    def _answer_lost(self, failed: list[tuple[str, int]], holder: str) -> None:
        error = PeerLostError(f"{holder}, the publisher of a shard of weight store {self.name!r}, is gone",
                              peer=holder)
        for src, req in failed:
            self._send(src, error_message(req, error))

    def _on_gone(self, address: str, incarnation: str) -> None:
        for key in [k for k in self._fetching if k[0] == address]:
            del self._fetching[key]
        if self._calls is not None:
            self._calls.fail(address, PeerLostError(f"{address} is gone", peer=address))
        if self.directory is not None:
            if address.startswith("weights.") and address != self.address:
                freed, failed = self.directory.holder_gone(address)
                self._free(freed)
                self._answer_lost(failed, address)
            grants, freed = self.directory.reader_gone(address)
            self._answer(grants)
            self._free(freed)
        elif address == self.directory_address:
            for number in list(self.versions):        # the directory knew the readers: start afresh
                self._free_local(number)

    async def aclose(self) -> None:
        """Leave the cluster and unlink the buckets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        try:
            await self.comm.aclose()
        finally:
            self.versions.clear()
            self.buckets.close()


class _Fetch:
    """A fetch in progress: the ``(start, end)`` of its chunks, the next to send, and how
    many more the puller has room for."""

    __slots__ = ("number", "bucket", "pieces", "next", "credit")

    def __init__(self, number: int, bucket: Bucket, pieces: list[tuple[int, int]], credit: int) -> None:
        self.number, self.bucket, self.pieces, self.next, self.credit = number, bucket, pieces, 0, credit


def _ignore(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
