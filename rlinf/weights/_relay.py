"""A relay's side of the chain: serving the chunks of a version while they land.

A puller that is its node's relay (see :mod:`._directory`) fills a shared-memory bucket
of its own per remote shard, chunk by chunk, in order. Each such bucket is a
:class:`Stream`, served from the moment the relay has it:

* ``fetch`` (from the relay downstream, on another node): the chunks, as a holder sends
  them (``("chunk", req, start, bytes)``, at most ``window`` ahead of the fetcher's
  ``more``), but never one that has not fully landed here;
* ``follow`` (from the node's other pullers, which map the bucket themselves):
  ``("landed", req, upto)`` each time more bytes landed, so that they copy each chunk
  as soon as it is in (one copy, from shared memory);
* ``unfetch``: the subscriber stopped; nothing more is sent to it.

Chunks land in order (the relay receives them in order and copies each before the
next), so ``landed`` is one offset: every byte before it is in the bucket for good
(until the directory frees the version, which waits for every subscriber's release).
A stream that fails (its own source is gone, the relay was cancelled), or is freed
while subscribers are still attached (the store's directory left), answers every one
of them with an error; they ask the directory again (or fail, the store being gone).
Pure bookkeeping: the methods return ``(destination, message, reads)`` triples that the
caller sends; ``reads`` is the bucket a chunk is a zero-copy view of (None for other
messages): it must not be reused before that send is done
(:meth:`~rlinf.weights._buckets.Buckets.reading`).
"""

from __future__ import annotations

from typing import Any

from ..errors import PeerLostError
from ._calls import error_message
from ._holder import MAX_CHUNK, MAX_WINDOW, MIN_CHUNK, spans
from ._layout import Layout

__all__ = ["Stream", "Streams"]

Out = list[tuple[str, tuple, Any]]


class _Fetcher:
    __slots__ = ("pieces", "next", "credit")

    def __init__(self, pieces: list[tuple[int, int]], credit: int) -> None:
        self.pieces, self.next, self.credit = pieces, 0, credit


class Stream:
    """One remote shard of one version, landing in a relay's bucket ``array`` (uint8);
    ``bucket``: the one ``array`` belongs to, named with each chunk sent from it."""

    def __init__(self, number: int, shard: int, array: Any, layout: Layout, bucket: Any = None) -> None:
        self.number, self.shard, self.array, self.layout = number, shard, array, layout
        self.bucket = bucket
        self.landed = 0
        self.failed: BaseException | None = None
        self._fetchers: dict[tuple[str, int], _Fetcher] = {}
        self._followers: dict[tuple[str, int], int] = {}      # -> the offset last told

    def __repr__(self) -> str:
        return (f"<Stream v{self.number} shard {self.shard} landed {self.landed}/{self.layout.total} "
                f"fetchers={len(self._fetchers)} followers={len(self._followers)}>")

    @property
    def complete(self) -> bool:
        return self.landed >= self.layout.total

    def fetch(self, src: str, req: int, size: Any, window: Any) -> Out:
        """``src`` streams this shard (as from a holder), ``size``-byte chunks, ``window`` ahead.

        Raises:
            ValueError: a chunk size or window out of range.
        """
        if isinstance(size, bool) or not isinstance(size, int) or not MIN_CHUNK <= size <= MAX_CHUNK:
            raise ValueError(f"chunk size {size!r} out of [{MIN_CHUNK}, {MAX_CHUNK}]")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"fetch window {window!r} out of [1, {MAX_WINDOW}]")
        self._fetchers[src, req] = _Fetcher(spans(self.layout.total, size), window)
        return self._pump(src, req)

    def follow(self, src: str, req: int) -> Out:
        """``src`` (on this node) copies from the bucket as it lands."""
        self._followers[src, req] = 0
        return self._tell(src, req)

    def more(self, src: str, req: int, count: Any) -> Out:
        fetcher = self._fetchers.get((src, req))
        if fetcher is None or not isinstance(count, int) or not 0 < count <= MAX_WINDOW:
            return []
        fetcher.credit += count
        return self._pump(src, req)

    def drop(self, src: str, req: int | None = None) -> None:
        """``src`` stopped (``req``), or is gone (None: all of its subscriptions)."""
        for subs in (self._fetchers, self._followers):
            for key in [k for k in subs if k[0] == src and (req is None or k[1] == req)]:
                del subs[key]

    def has(self, src: str, req: int) -> bool:
        return (src, req) in self._fetchers or (src, req) in self._followers

    def land(self, upto: int) -> Out:
        """Every byte before ``upto`` is in the bucket: serve what that allows."""
        self.landed = max(self.landed, upto)
        out: Out = []
        for src, req in list(self._fetchers):
            out += self._pump(src, req)
        for src, req in list(self._followers):
            out += self._tell(src, req)
        return out

    def fail(self, exc: BaseException, relay: str) -> Out:
        """The relay stops filling (or serving) this stream: every subscriber gets
        ``PeerLostError``."""
        self.failed = exc
        error = PeerLostError(f"{relay}, the relay of version {self.number} of this weight store on its "
                              f"node, stopped: {exc!r}", peer=relay)
        out = [(src, error_message(req, error), None) for src, req in [*self._fetchers, *self._followers]]
        self._fetchers.clear()
        self._followers.clear()
        return out

    def _pump(self, src: str, req: int) -> Out:
        fetcher = self._fetchers[src, req]
        out: Out = []
        while fetcher.credit > 0 and fetcher.next < len(fetcher.pieces):
            start, end = fetcher.pieces[fetcher.next]
            if end > self.landed:
                break
            fetcher.next += 1
            fetcher.credit -= 1
            out.append((src, ("chunk", req, start, self.array[start:end]), self.bucket))
        if fetcher.next == len(fetcher.pieces):
            del self._fetchers[src, req]
        return out

    def _tell(self, src: str, req: int) -> Out:
        if self._followers[src, req] >= self.landed:
            return []
        self._followers[src, req] = self.landed
        if self.complete:
            del self._followers[src, req]
        return [(src, ("landed", req, self.landed), None)]


class Streams:
    """A relay's streams, by ``(version, shard)``, and the requests that reach them."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._by_key: dict[tuple[int, int], Stream] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, stream: Stream) -> None:
        self._by_key[stream.number, stream.shard] = stream

    def handle(self, src: str, message: tuple) -> Out:
        """Serve ``fetch``/``follow``/``more``/``unfetch`` (``op, req, ...``); an error
        answer when this relay has no such stream (freed, failed, or never here)."""
        op, req = message[0], message[1]
        if op == "more":
            return [m for s in self._by_key.values() for m in s.more(src, req, message[2])]
        if op == "unfetch":
            for s in self._by_key.values():
                s.drop(src, req)
            return []
        number, shard = message[2], (message[5] if op == "fetch" and len(message) > 5 else
                                     message[3] if op == "follow" else None)
        stream = self._by_key.get((number, shard))
        if stream is None or stream.failed is not None:
            return [(src, error_message(req, PeerLostError(
                f"{self.address} relays no shard {shard} of version {number} (any more)", peer=self.address)), None)]
        if op == "fetch":
            return stream.fetch(src, req, message[3], message[4])
        return stream.follow(src, req)

    def fail(self, number: int, exc: BaseException) -> Out:
        """The streams of version ``number`` stop (the relay failed): errors for their subscribers."""
        out: Out = []
        for key in [k for k in self._by_key if k[0] == number]:
            out += self._by_key.pop(key).fail(exc, self.address)
        return out

    def free(self, number: int | None, why: BaseException) -> Out:
        """Version ``number`` (None: every one) was freed: its streams go. Errors (``why``)
        for the subscribers still attached (the directory that freed it left, or no
        longer knew them): they must not wait for chunks that will not come."""
        out: Out = []
        for key in [k for k in self._by_key if number is None or k[0] == number]:
            out += self._by_key.pop(key).fail(why, self.address)
        return out

    def gone(self, src: str) -> None:
        for s in self._by_key.values():
            s.drop(src)
