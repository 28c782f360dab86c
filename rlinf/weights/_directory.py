"""The directory of a weight store: which versions exist, which are complete, who reads them.

Pure state, no I/O (the holder of shard 0 runs it and does the messaging): shards come
in (:meth:`Directory.add_shard`), pullers acquire the newest complete version
(:meth:`Directory.acquire`, or they wait) and release it when their copy is done
(:meth:`Directory.release`). A version's memory may be reused only once it is no longer
the newest complete version and no reader holds it: every method returns the versions
that became free, and the caller frees each shard's bucket.

**Per-node fan-out, a chain between nodes.** The first puller of a version on a node
that holds no copy of a shard becomes that node's *relay*: it streams the remote shards
into shared-memory buckets of its own, chunk by chunk. Its source is the relay that
was chosen before it on another node (its *upstream*, which forwards each chunk as it
lands), or the holders for the first one: the relays of a version form a chain, so
every node's link carries the version about once in and once out, whatever the number
of nodes. A relay whose upstream has not started yet waits for it (``deferred``). Once
a relay has its buckets (:meth:`Directory.relay_started`), the node's other pullers are
granted them and copy each chunk as it lands; :meth:`Directory.relayed` says when all
is in. If a relay fails (or leaves, or a puller reports it lost), the pullers waiting
for it fetch for themselves, the relays deferred on it are routed anew, and those
streaming from it (or from a relay downstream of it: ``doomed``) fail and ask again.

**Memory.** A version is freed once nobody reads it and it is older than the newest
complete one, or lost (a holder of one of its shards died), or can never be complete (a
shard it lacks has published a later version), or is an incomplete one beyond the
newest :data:`PENDING_KEPT` incomplete ones (a shard that stopped publishing does not
make the others' memory grow without bound).

Invariants: ``latest`` only grows (until a holder dies and takes its versions with it);
a granted version is never freed before its reader released it (or left), not even when
a holder of one of its shards dies (the version is *lost*: no new grants, its waiting
pullers fail, the surviving shards' buckets stay until the readers are done); a puller
waiting for its node's relay counts as a reader.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Directory", "Grant", "ShardRef", "Version", "PENDING_KEPT"]

#: Incomplete versions kept at most (the newest ones; older ones are freed).
PENDING_KEPT = 4


@dataclass
class ShardRef:
    """Where one shard of one version lives: its holder (address, node), its bucket
    (shared-memory segment name, size, and the stamp of this version's fill), and its
    layout (key, and the layout itself as plain data)."""

    holder: str
    node: str
    segment: str
    size: int
    layout_key: str
    layout: list
    stamp: int = 0

    def to_wire(self, with_layout: bool) -> list:
        return [self.holder, self.node, self.segment, self.size, self.layout_key,
                self.layout if with_layout else None, self.stamp]


@dataclass(eq=False)          # compared by identity (relays refer to each other)
class Relay:
    """The puller that brings a version's remote shards to its ``node``: ``started`` once
    it has its buckets (``segments``: shard -> (segment, size, stamp)), ``ready`` once
    they are full; ``waiting``: the node's other pullers ``(src, req)``; ``req``: its own
    acquire; ``upstream``: the relay it streams from (None: the holders); ``deferred``:
    relays waiting for this one to start; ``doomed``: its upstream chain failed."""

    address: str
    node: str = ""
    req: int = 0
    ready: bool = False
    started: bool = False
    doomed: bool = False
    upstream: Relay | None = None
    segments: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    waiting: list[tuple[str, int]] = field(default_factory=list)
    deferred: list[Relay] = field(default_factory=list)


@dataclass
class Version:
    number: int
    num_shards: int
    shards: dict[int, ShardRef] = field(default_factory=dict)
    readers: collections.Counter = field(default_factory=collections.Counter)
    published: float = 0.0
    relays: dict[str, Relay] = field(default_factory=dict)      # node -> its relay
    retired: list[Relay] = field(default_factory=list)         # ready, out of the chain: freed with it
    lost: str | None = None          # why it is lost (a holder of a shard died), or None

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.num_shards

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.shards.values())


@dataclass
class Grant:
    """An answer to an acquire: ``(src, req)`` gets ``version``; ``relay``: it is its
    node's relay (it says :meth:`Directory.relay_started`, streams the remote shards from
    ``source``, a started relay of another node, or from the holders, then says
    :meth:`Directory.relayed`); ``via``: read the remote shards from this started
    relay's buckets instead, each chunk once it landed."""

    src: str
    req: int
    version: Version
    relay: bool = False
    via: Relay | None = None
    source: Relay | None = None


class Directory:
    """See the module docstring. ``token``: this directory's, in its grants; a release
    or relay report that does not carry it answers an earlier directory of the name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.token = secrets.token_hex(8)
        self.versions: dict[int, Version] = {}
        self.latest: int | None = None
        self.num_shards: int | None = None
        self.lost: str | None = None      # why no version is complete after a holder died
        self._waiting: list[tuple[str, int, int | None, str]] = []    # (src, req, newer_than, node)
        self._last: dict[int, int] = {}        # shard -> the version it published last
        self.subscribers: set[str] = set()
        self.publishes = 0
        self.grants = 0
        self.bytes_by_path: collections.Counter = collections.Counter()
        self.last_publish: float | None = None
        self.last_pull: float | None = None

    def __repr__(self) -> str:
        return f"<Directory {self.name} latest={self.latest} versions={sorted(self.versions)}>"

    # -- publishing --------------------------------------------------------------------
    def add_shard(self, number: int, shard: int, num_shards: int, ref: ShardRef) -> tuple[list[Grant], list[Version]]:
        """Shard ``shard`` of version ``number`` is in. Returns the grants this makes
        (the version became complete: waiting pullers get it) and the versions freed.

        Raises:
            ValueError: the version is not newer than the newest complete one, the shard
                is already in, the version was lost, or ``num_shards`` differs from the
                store's.
        """
        if self.num_shards is not None and num_shards != self.num_shards:
            raise ValueError(f"weight store {self.name!r} has {self.num_shards} shard(s), "
                             f"this publish says num_shards={num_shards}")
        if self.latest is not None and number <= self.latest:
            raise ValueError(f"version {number} of weight store {self.name!r} is not newer than its "
                             f"latest complete version {self.latest}")
        entry = self.versions.get(number)
        if entry is None:
            entry = self.versions[number] = Version(number, num_shards)
        if entry.lost is not None:
            raise ValueError(f"version {number} of weight store {self.name!r} was lost ({entry.lost}): "
                             f"publish a newer one")
        if shard in entry.shards:
            raise ValueError(f"shard {shard} of version {number} of {self.name!r} was already published")
        self.num_shards = num_shards
        entry.shards[shard] = ref
        self._last[shard] = number
        if not entry.complete:
            return [], self.collect()
        entry.published = time.time()
        self.latest, self.lost = number, None
        self.publishes += 1
        self.last_publish = entry.published
        due = [w for w in self._waiting if w[2] is None or number > w[2]]
        self._waiting = [w for w in self._waiting if not (w[2] is None or number > w[2])]
        grants = [g for src, req, _, node in due if (g := self._route(src, req, entry, node)) is not None]
        return grants, self.collect()

    # -- pulling -----------------------------------------------------------------------
    def acquire(self, src: str, req: int, newer_than: int | None, node: str = "") -> Grant | None:
        """The newest complete version for ``src`` on ``node`` (held for it until it
        releases), or None: then ``src`` waits (for a newer version, or for its node's
        relay), and a later :meth:`add_shard` or :meth:`relayed` grants it.

        Raises:
            LookupError: no version is complete because a holder died (``lost``).
        """
        self.subscribers.add(src)
        if self.latest is not None and (newer_than is None or self.latest > newer_than):
            return self._route(src, req, self.versions[self.latest], node)
        if self.lost is not None:
            raise LookupError(self.lost)
        self._waiting.append((src, req, newer_than, node))
        return None

    def _route(self, src: str, req: int, entry: Version, node: str) -> Grant | None:
        """``src`` reads ``entry`` from now on: directly, as its node's relay, from the
        node's ready relay, or (None) once the relay is ready."""
        entry.readers[src] += 1
        self.grants += 1
        self.last_pull = time.time()
        if not node or all(s.node == node for s in entry.shards.values()):
            return Grant(src, req, entry)
        relay = entry.relays.get(node)
        if relay is None:
            relay = entry.relays[node] = Relay(src, node, req)
            return self._source(entry, relay)
        if relay.started:
            return Grant(src, req, entry, via=relay)
        relay.waiting.append((src, req))
        return None

    def _source(self, entry: Version, relay: Relay) -> Grant | None:
        """The relay's grant with its upstream: the last relay chosen before it on another
        node (not doomed), once that one started; None: it waits for it (deferred)."""
        upstream = None
        for other in entry.relays.values():
            if other is relay:
                break
            if not other.doomed:
                upstream = other
        relay.upstream = upstream
        _undoom(relay)                 # its chain is whole again
        if upstream is None or upstream.started:
            return Grant(relay.address, relay.req, entry, relay=True, source=upstream)
        upstream.deferred.append(relay)
        return None

    def relay_started(self, src: str, number: int, segments: dict[int, tuple[str, int, int]]) -> list[Grant]:
        """The relay ``src`` has its buckets for version ``number`` (``segments``) and
        fills them: the node's waiting pullers and the relays deferred on it are granted."""
        relay = self._relay_of(src, number)
        if relay is None or relay.started:
            return []
        entry = self.versions[number]
        relay.started, relay.segments = True, dict(segments)
        waiting, relay.waiting = relay.waiting, []
        deferred, relay.deferred = relay.deferred, []
        grants = [Grant(s, req, entry, via=relay) for s, req in waiting]
        return grants + [Grant(d.address, d.req, entry, relay=True, source=relay) for d in deferred]

    def relayed(self, src: str, number: int, segments: dict[int, tuple[str, int, int]] | None) -> list[Grant] | None:
        """The relay ``src`` has version ``number``'s remote shards in its buckets
        (``segments``), or failed (None: its node's pullers then fetch for themselves).
        Returns the grants this makes, or None when ``src`` relays no such version
        (any more): its copy is not needed."""
        relay = self._relay_of(src, number)
        if relay is None or relay.ready:
            return None if relay is None else []
        if segments is None:
            return self._fail_relay(self.versions[number], relay)
        grants = self.relay_started(src, number, segments)
        relay.ready = True
        return grants

    def relay_lost(self, src: str, number: int, req: int) -> list[Grant]:
        """A puller found ``src``, relay of ``number`` for its acquire ``req``, gone
        (before this directory may know): it fails as by :meth:`relayed` with None (a
        report about an earlier relay at that address is ignored). A relay that was
        ready leaves the chain but holds its copy until the version is freed, like the
        others (:attr:`Version.retired`). Returns the grants this makes."""
        relay = self._relay_of(src, number)
        if relay is None or relay.req != req:
            return []
        entry = self.versions[number]
        if relay.ready:
            entry.retired.append(relay)
        return self._fail_relay(entry, relay)

    def _relay_of(self, src: str, number: int) -> Relay | None:
        entry = self.versions.get(number)
        if entry is None:
            return None
        return next((r for r in entry.relays.values() if r.address == src), None)

    def _fail_relay(self, entry: Version, relay: Relay) -> list[Grant]:
        """``relay`` fails: gone from the chain; the pullers waiting for it fetch for
        themselves, the relays deferred on it are routed anew, and the relays that stream
        from it (or further down) are doomed: they will fail."""
        del entry.relays[relay.node]
        doomed = {id(relay)}
        for other in entry.relays.values():          # in chain order: an upstream comes first
            if other.upstream is not None and id(other.upstream) in doomed and not other.ready:
                other.doomed = True
                doomed.add(id(other))
        grants = [Grant(src, req, entry) for src, req in relay.waiting]
        relay.waiting = []
        for d in relay.deferred:
            if entry.relays.get(d.node) is d and (g := self._source(entry, d)) is not None:
                grants.append(g)
        relay.deferred = []
        return grants

    def cancel(self, src: str, req: int) -> bool:
        """``src`` stopped waiting for ``req``; False if it was not waiting (granted)."""
        before = len(self._waiting)
        self._waiting = [w for w in self._waiting if (w[0], w[1]) != (src, req)]
        if len(self._waiting) != before:
            return True
        for entry in self.versions.values():
            for relay in entry.relays.values():
                if (src, req) in relay.waiting:
                    relay.waiting.remove((src, req))
                    self.release(src, entry.number)
                    return True
                if relay.address == src and relay.req == req and relay.upstream is not None \
                        and relay in relay.upstream.deferred:     # a relay waiting for its upstream
                    relay.upstream.deferred.remove(relay)
                    self._fail_relay(entry, relay)
                    self.release(src, entry.number)
                    return True
        return False

    def release(self, src: str, number: int, path: str = "", nbytes: int = 0) -> list[Version]:
        """``src`` finished reading ``number`` (moving ``nbytes`` by ``path``). Returns
        the versions freed. A release that matches no read is ignored."""
        entry = self.versions.get(number)
        if entry is None or entry.readers[src] <= 0:
            return []
        self._unread(entry, src)
        if path:
            self.bytes_by_path[path] += int(nbytes)
        return self.collect()

    def reader_gone(self, src: str) -> tuple[list[Grant], list[Version]]:
        """``src`` left or died: it reads nothing any more, nor waits, nor relays (the
        pullers waiting for it fetch for themselves: the grants returned). Returns
        those grants and the versions freed."""
        self._waiting = [w for w in self._waiting if w[0] != src]
        self.subscribers.discard(src)
        grants: list[Grant] = []
        for entry in self.versions.values():
            entry.readers.pop(src, None)
            for relay in list(entry.relays.values()):
                relay.waiting = [w for w in relay.waiting if w[0] != src]
            for relay in list(entry.relays.values()):
                if relay.address == src and entry.relays.get(relay.node) is relay:
                    grants += self._fail_relay(entry, relay)   # its buckets are gone: fetch anew
        return grants, self.collect()

    def holder_gone(self, holder: str) -> tuple[list[Version], list[tuple[str, int]]]:
        """The holder ``holder`` died: its versions are lost (never granted again; the
        rest of their shards are freed once their readers are done). Returns the
        versions freed and the ``(src, req)`` that must fail: those waiting for a relay
        of a lost version and, when no complete version is left, every waiting pull
        (``lost`` says why)."""
        why = f"the publisher of a shard of weight store {self.name!r} ({holder}) is gone"
        hit = [v for v in self.versions.values() if any(s.holder == holder for s in v.shards.values())]
        failed: list[tuple[str, int]] = []
        for entry in hit:
            entry.lost = why
            for relay in entry.relays.values():
                waiting = relay.waiting + [(d.address, d.req) for d in relay.deferred]
                for src, req in waiting:              # they counted as readers: no more
                    self._unread(entry, src)
                    failed.append((src, req))
                relay.waiting, relay.deferred = [], []
        self.latest = max((n for n, v in self.versions.items() if v.complete and v.lost is None), default=None)
        if self.latest is None and hit:
            self.lost = why
            failed += [(src, req) for src, req, _, _ in self._waiting]
            self._waiting = []
        return self.collect(), failed

    def collect(self) -> list[Version]:
        """The versions nobody reads that are lost, older than the newest complete one,
        never to be complete, or incomplete beyond the newest :data:`PENDING_KEPT`:
        freed now (see the module docstring)."""
        free = [v for v in self.versions.values() if not v.readers and self._useless(v)]
        pending = sorted(n for n, v in self.versions.items()
                         if not v.complete and v.lost is None and v not in free)
        free += [self.versions[n] for n in pending[:-PENDING_KEPT]]
        for entry in free:
            del self.versions[entry.number]
        return free

    def _useless(self, entry: Version) -> bool:
        if entry.lost is not None or (self.latest is not None and entry.number < self.latest):
            return True
        return not entry.complete and any(self._last.get(k, entry.number) > entry.number
                                          for k in range(entry.num_shards) if k not in entry.shards)

    def _unread(self, entry: Version, src: str) -> None:
        entry.readers[src] -= 1
        if entry.readers[src] <= 0:
            del entry.readers[src]

    def snapshot(self) -> dict[str, Any]:
        """Plain data for :class:`rlinf.weights.stats.WeightStats`."""
        return {
            "name": self.name, "latest": self.latest, "num_shards": self.num_shards,
            "versions": {n: {"complete": v.complete, "bytes": v.nbytes, "readers": sum(v.readers.values()),
                             "shards": len(v.shards), "lost": v.lost is not None}
                         for n, v in sorted(self.versions.items())},
            "subscribers": sorted(self.subscribers), "waiting": len(self._waiting),
            "publishes": self.publishes, "pulls": self.grants, "bytes_by_path": dict(self.bytes_by_path),
            "last_publish": self.last_publish, "last_pull": self.last_pull,
        }


def _undoom(relay: Relay) -> None:
    """``relay`` (not started) has a sound upstream again: so have those deferred on it."""
    relay.doomed = False
    for d in relay.deferred:
        _undoom(d)
