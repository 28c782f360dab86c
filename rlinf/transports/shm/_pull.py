"""Single-copy pulls: a copy-out receiver reads a same-node sender's buffers in place.

A receiver that asked for owned copies (``shm_views=False``) would get a large
same-node message with two copies: the sender's into a shared-memory slot, then its own
out of the slot. With a pull there is one: the sender sends only the addresses of its
buffers (a :class:`rlinf.transports.descriptors.PullRef`), keeps them alive and unchanged, and the receiver
copies them straight into its own recycled memory with ``process_vm_readv``
(:mod:`.cma`), then tells the sender, whose send completes then.

**Who pulls from whom** is settled per pair, by the receiver, with SYSTEM notices
(tag ``"pull"``), because whether one process may read another depends on the kernel's
ptrace rules, not on either process alone:

1. A copy-out receiver that got a message through a slot of a sender asks it:
   ``["ask", receiver_incarnation]``.
2. The sender answers with where it keeps its cookie (:class:`.cma.Cookie`):
   ``["cookie", sender_incarnation, pid, address, value]``.
3. The receiver reads the cookie (:func:`.cma.verify`), keeps the sender's process (a
   pidfd) and answers ``["ok", receiver_incarnation]``; if it cannot read it, it logs
   why and stays on slots (the sender hears nothing and goes on using slots).
4. From then on the sender's messages to that receiver of at least ``RLINF_SHM_PULL``
   bytes (default 1 MiB; ``0`` turns pulls off) carry a pull descriptor instead of a
   slot. The receiver reads one **when it arrives** (in an executor thread from
   ``RLINF_SHM_OFFLOAD`` bytes), not when it is received, so two processes sending to
   each other before receiving never wait on each other; then it answers
   ``["done", pull_id]``.

Giving up: a send that times out or is cancelled, or fails (its receiver left, or we
close), *revokes* its hold: we zero the message's token (a word of ours whose address
and value the entry carries) before the caller gets its buffers back. The receiver
reads the token after the data; a changed token means the data may be anything, and
that receive raises :class:`~rlinf.errors.DecodeError`. A revoked entry still queued is
not sent. Closing first waits a moment for the reads in flight (:meth:`PullSession.drain`).

Failures: a sender that dies before a read ends makes the receive of that message raise
:class:`~rlinf.errors.PeerLostError` (its pidfd says so: what was read from a pid that
another process may have taken meanwhile is discarded); any other failed read raises
``DecodeError`` there. Every entry opened is answered ``done``, read or refused (a
frame set dropped whole, malformed or from a peer taken for dead, is not). A receiver
that leaves or dies fails the sends waiting on it with ``PeerLostError``; closing fails
them with ``ClosedError``.

Buffer lifetime: the sender holds a pulled message's buffers (they must not change)
until the receiver's ``done``, the receiver's departure, the send's cancellation or
close; only then does the send complete (or fail). The receiver's buffers are recycled
private memory, owned by it (reused once nothing references them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any, Callable, Sequence

import numpy as np

from .. import descriptors
from ...util.copier import Copier
from ...errors import ClosedError, DecodeError, PeerLostError, ProtocolError
from ...config import DEFAULTS
from .. import cma
from ._pool import Recycler

__all__ = ["PullSession", "PullPeer", "DEFAULT_PULL"]

log = logging.getLogger("rlinf.transports.shm")

#: Payloads from this many bytes are pulled by a copy-out receiver (``RLINF_SHM_PULL``'s
#: default; the communicator passes the setting as ``threshold``).
DEFAULT_PULL = DEFAULTS.shm_pull
TAG = "pull"


class _SendFuture(asyncio.Future):
    """The future of a pulled send: cancelling it revokes the hold at once, before
    ``cancel()`` returns, so the caller may reuse its buffers from then on (a done
    callback would run a loop turn later)."""

    def __init__(self, *, loop: asyncio.AbstractEventLoop, revoke: Callable[[], None]) -> None:
        super().__init__(loop=loop)
        self._revoke = revoke

    def cancel(self, msg: Any = None) -> bool:
        if not self.done():
            self._revoke()
        return super().cancel(msg)


class _Held:
    """A pulled message's buffers, held by the sender until the receiver is done.

    ``token`` is a word of ours the receiver reads after the data: it holds ``value``
    while the hold lasts and 0 once it was revoked (see :meth:`PullSession.drop`).
    ``sent`` is the outbox's future of the entry; cancelling it before the entry left
    drops the entry."""

    __slots__ = ("dst", "incarnation", "buffers", "future", "sent", "token", "value")

    def __init__(self, dst: str, incarnation: str, buffers: list, future: asyncio.Future,
                 sent: asyncio.Future) -> None:
        self.dst = dst
        self.incarnation = incarnation
        self.buffers = buffers
        self.future = future
        self.sent = sent
        self.value = int.from_bytes(os.urandom(8), "little") | 1
        self.token = np.array([self.value], np.uint64)


class PullPeer:
    """What a :class:`PullSession` knows about one peer incarnation, as a receiver of
    our pulled messages and as a sender we pull from: a
    :class:`~rlinf.transports.base.PeerState`, handed out by :meth:`PullSession.peer`
    and closed once (:meth:`close`) when that incarnation is gone.

    Attributes:
        address, incarnation: the peer's.
        cookied: we sent it our cookie (it asked to pull from us).
        agreed: it read our cookie: our large messages to it are pulled.
        asked: we asked it to be pulled from.
        source: its process, once we read its cookie (None: we do not pull from it).
        closed: it is gone (nothing is agreed with it any more).
    """

    __slots__ = ("address", "incarnation", "cookied", "agreed", "asked", "source", "closed", "_session")

    def __init__(self, session: PullSession, address: str, incarnation: str) -> None:
        self.address, self.incarnation = address, incarnation
        self.cookied = self.agreed = self.asked = self.closed = False
        self.source: cma.Process | None = None
        self._session = session

    def __repr__(self) -> str:
        flags = [f for f in ("cookied", "agreed", "asked", "closed") if getattr(self, f)]
        return f"<PullPeer {self.address}|{self.incarnation} {' '.join(flags)} source={self.source is not None}>"

    def close(self, *, process_gone: bool = False) -> None:
        """The incarnation left or died: fail the sends it still had to read, forget
        the agreement and its process (once; ``process_gone`` changes nothing here)."""
        if self.closed:
            return
        self.closed = True
        self.agreed = self.cookied = False
        self._session._forget(self)
        if self.source is not None:
            self.source.close()
            self.source = None


class PullSession:
    """One communicator's pulls, as sender and as receiver (loop thread, except the reads).

    Args:
        loop: the communicator's loop.
        incarnation: ours.
        send_notice: ``send_notice(dst, obj)`` sends a SYSTEM notice with tag ``"pull"``
            now (it raises if ``dst`` is gone).
        recycler: the receiver's private memory.
        copier: splits large reads across threads.
        offload: reads of this many bytes or more run in an executor thread.
        threshold: messages of this many bytes or more are pulled when the receiver agreed;
            0: pulls are off (we neither ask nor answer).
        pid_of: ``pid_of(address)``: a peer's pid from the roster, when known.

    Attributes:
        offered: messages we sent to be pulled.
        pulled: messages we pulled (read, or failed to).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, incarnation: str, send_notice: Callable[[str, Any], None],
                 recycler: Recycler, copier: Copier, *, offload: int, threshold: int,
                 pid_of: Callable[[str], int | None]) -> None:
        self.threshold = threshold if cma.available() else 0
        self.offered = self.pulled = 0
        self._loop = loop
        self._incarnation = incarnation
        self._send_notice = send_notice
        self._recycler = recycler
        self._copier = copier
        self._offload = offload
        self._pid_of = pid_of
        self._cookie = cma.Cookie()
        self._ids = itertools.count()
        self.peers: dict[tuple[str, str], PullPeer] = {}   # (address, incarnation) -> what we know of it
        self._held: dict[int, _Held] = {}           # pull_id -> what a receiver still reads
        self._emptied: asyncio.Event | None = None  # set when _held empties (drain)
        self._closed = False

    def __repr__(self) -> str:
        report = self.report()
        return (f"<PullSession threshold={self.threshold} offered={self.offered} pulled={self.pulled} "
                f"agreed={report['agreed']} held={len(self._held)} sources={report['sources']}>")

    def report(self) -> dict:
        """Plain values for the stats a worker reports (``rlinf top``)."""
        peers = self.peers.values()
        return {"threshold": self.threshold, "offered": self.offered, "pulled": self.pulled,
                "agreed": sum(p.agreed for p in peers), "sources": sum(p.source is not None for p in peers),
                "held": len(self._held)}

    def peer(self, address: str, incarnation: str) -> PullPeer:
        """What we know of ``address``'s ``incarnation`` (made on first use; a closed one
        is replaced: that incarnation may send again after it was taken for lost)."""
        peer = self.peers.get((address, incarnation))
        if peer is None:
            peer = self.peers[(address, incarnation)] = PullPeer(self, address, incarnation)
        return peer

    def _forget(self, peer: PullPeer) -> None:
        """``peer`` closed: the sends it still had to read fail, and it is forgotten."""
        if self.peers.get((peer.address, peer.incarnation)) is peer:
            del self.peers[(peer.address, peer.incarnation)]
        error = PeerLostError(f"{peer.address} left or was lost before it read the message", peer=peer.address)
        for pull_id in [i for i, h in self._held.items() if h.dst == peer.address
                        and h.incarnation == peer.incarnation]:
            self.drop(pull_id, error)

    # -- sending ---------------------------------------------------------------------------
    def agreed(self, dst: str, incarnation: str) -> bool:
        """Whether ``dst`` (this incarnation) pulls our large messages (cheap: one lookup)."""
        peer = self.peers.get((dst, incarnation))
        return peer is not None and peer.agreed

    def offer(self, dst: str, incarnation: str, buffers: Sequence[Any],
              sizes: Sequence[int]) -> tuple[list, list, asyncio.Future, asyncio.Future]:
        """Hold ``buffers`` for ``dst`` (``incarnation``) to pull: ``(layout, wire item,
        future, sent)``. ``future`` completes once ``dst`` has read them (see the module
        docstring); cancelling it (a send that timed out) revokes the hold. ``sent`` is
        for the outbox (its entry's future)."""
        pull_id = next(self._ids)
        self.offered += 1
        self.peer(dst, incarnation)     # its close fails what it still has to read
        addresses = [cma.address_of(b) for b, n in zip(buffers, sizes) if n]
        future = _SendFuture(loop=self._loop, revoke=lambda: self._revoke(pull_id))
        sent = self._loop.create_future()
        held = self._held[pull_id] = _Held(dst, incarnation, list(buffers), future, sent)
        sent.add_done_callback(lambda f: self._left(pull_id, f))
        item = [pull_id, addresses, cma.address_of(held.token), held.value]
        return [-n if n else 0 for n in sizes], item, future, sent

    def _left(self, pull_id: int, sent: asyncio.Future) -> None:
        """The outbox is done with the entry: it failed to send it, or dropped it."""
        if not sent.cancelled() and sent.exception() is not None:
            self.drop(pull_id, sent.exception())

    def drop(self, pull_id: int, error: BaseException | None) -> None:
        """Give up the hold of ``pull_id`` (:meth:`_revoke`) and fail its send with
        ``error`` (None: "dropped unsent")."""
        held = self._revoke(pull_id)
        if held is not None and not held.future.done():
            held.future.set_exception(error or ClosedError("the message was dropped unsent"))

    def _revoke(self, pull_id: int) -> _Held | None:
        """End the hold of ``pull_id``: its buffers are the caller's again at once, and a
        receiver that reads them later finds the hold revoked and discards what it read.
        Returns the hold (None if it had ended)."""
        held = self._held.pop(pull_id, None)
        if held is None:
            return None
        held.token[0] = 0         # first: the receiver checks it after reading the data
        if not held.sent.done():
            held.sent.cancel()    # not sent yet: the outbox drops the entry
        self._check_emptied()
        return held

    def _check_emptied(self) -> None:
        if not self._held and self._emptied is not None:
            self._emptied.set()

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every receiver read what we hold for it."""
        self._emptied = asyncio.Event()
        if self._held:
            try:
                async with asyncio.timeout(timeout):
                    await self._emptied.wait()
            except TimeoutError:
                log.warning("rlinf: closing before %s read what they were to pull; those sends fail",
                            sorted({h.dst for h in self._held.values()}))

    # -- receiving -------------------------------------------------------------------------
    def want(self, src: str, incarnation: str) -> None:
        """A message from ``src`` came through one of its slots: ask it for pulls (once
        per incarnation)."""
        if self._closed or not self.threshold:
            return
        peer = self.peer(src, incarnation)
        if peer.asked:
            return
        peer.asked = True
        self._notify(src, ["ask", self._incarnation])

    def open(self, src: str, incarnation: str, ref: descriptors.PullRef,
             sizes: Sequence[int]) -> tuple[list, asyncio.Future]:
        """Start reading a pulled entry's buffers (``sizes``, in order) into our memory:
        ``(buffers, future)``; the buffers hold the data once the future is done (it
        raises ``PeerLostError`` or ``DecodeError`` if they cannot be read). The sender
        is told when we are done with its buffers, whatever happens.

        Raises:
            ProtocolError: ``src`` never proved it can be read by us, or we cannot hold
                the bytes it announces (the sender is told at once).
        """
        self.pulled += 1
        peer = self.peers.get((src, incarnation))
        process = peer.source if peer is not None else None
        offsets, end = descriptors.slot_layout(list(sizes))
        try:
            if process is None:
                raise ProtocolError(f"{src} sent a pull descriptor, but no pull was agreed with it")
            try:
                dst = self._recycler.take(end)
            except (MemoryError, ValueError, OverflowError) as exc:
                raise ProtocolError(f"cannot hold the {end} bytes {src} announced: {exc!r}") from None
            pairs = [(dst[o:o + n], cma.Remote(a, n)) for o, n, a in zip(offsets, sizes, ref.addresses)]
            token = (ref.token_address, ref.token)
            future = None
            if end >= self._offload:
                try:
                    future = self._loop.run_in_executor(None, self._read, src, process, pairs, token)
                except RuntimeError as exc:    # the executor is shut down (interpreter exit)
                    raise ProtocolError(f"cannot read {src}'s message now: {exc}") from None
        except ProtocolError:
            self._notify(src, ["done", ref.pull_id])
            raise
        if future is not None:
            # runs before the receive that awaits the future resumes (callbacks go in order)
            future.add_done_callback(lambda f: self._finished(src, ref.pull_id, f))
        else:
            future = self._loop.create_future()
            try:
                self._read(src, process, pairs, token)
                future.set_result(None)
            except (PeerLostError, DecodeError) as exc:
                future.set_exception(exc)
            self._finished(src, ref.pull_id, future)     # now: the receive does not wait for it
        whole = memoryview(dst)
        return [whole[o:o + n] for o, n in zip(offsets, sizes)], future

    def _read(self, src: str, process: cma.Process, pairs: list, token: tuple[int, int]) -> None:
        """Read the data, then the sender's token (any thread): a token that changed
        means the sender revoked its hold meanwhile, so what we read may be anything."""
        address, value = token
        try:
            self._copier.copy(pairs, process.read)
            now = np.zeros(1, np.uint64)
            process.read([(now.view(np.uint8), cma.Remote(address, 8))])
        except ProcessLookupError:
            raise PeerLostError(f"{src} was lost before its message could be read", peer=src) from None
        except Exception as exc:   # refused by the kernel, or a descriptor that makes no sense
            raise DecodeError(f"message from {src} cannot be read from its memory: {exc!r}") from None
        if int(now[0]) != value:
            raise DecodeError(f"{src} withdrew the message before it was read (its send failed, timed out "
                              "or was cancelled)")

    def _finished(self, src: str, pull_id: int, future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()    # retrieved: a message never received must not warn
        self._notify(src, ["done", pull_id])

    # -- notices ---------------------------------------------------------------------------
    def on_notice(self, src: str, notice: Any) -> None:
        """A SYSTEM notice with tag ``"pull"`` from ``src``."""
        if not (isinstance(notice, list) and notice and isinstance(notice[0], str)):
            raise ProtocolError(f"malformed pull notice from {src}")
        what, args = notice[0], notice[1:]
        if what == "done" and len(args) == 1 and type(args[0]) is int:
            held = self._held.get(args[0])
            if held is not None and held.dst == src:
                del self._held[args[0]]
                if not held.future.done():
                    held.future.set_result(None)
                self._check_emptied()
        elif what == "ask" and len(args) == 1 and isinstance(args[0], str):
            if not self._closed and self.threshold:
                self.peer(src, args[0]).cookied = True
                self._notify(src, ["cookie", self._incarnation, os.getpid(), self._cookie.address,
                                   self._cookie.value])
        elif what == "cookie" and len(args) == 4:
            self._verify(src, *args)
        elif what == "ok" and len(args) == 1 and isinstance(args[0], str):
            peer = self.peers.get((src, args[0]))
            if peer is not None and peer.cookied and not self._closed:    # only a peer we offered to
                for other in self._others(src, args[0]):
                    other.cookied = other.agreed = False      # only the incarnation that agreed last
                peer.agreed = True
        else:
            raise ProtocolError(f"malformed pull notice from {src}: {what!r}")

    def _others(self, src: str, incarnation: str) -> list[PullPeer]:
        return [p for (a, i), p in self.peers.items() if a == src and i != incarnation]

    def _verify(self, src: str, incarnation: Any, pid: Any, address: Any, value: Any) -> None:
        peer = self.peers.get((src, incarnation)) if isinstance(incarnation, str) else None
        if self._closed or peer is None or not peer.asked:
            return
        if not (type(pid) is int and pid > 0 and type(address) is int and address > 0
                and type(value) is bytes and len(value) == len(self._cookie.value)):
            raise ProtocolError(f"malformed pull cookie from {src}")
        known = self._pid_of(src)
        if known is not None and known != pid:
            log.info("rlinf: %s reports pid %s, its registration %s: no pulls from it", src, pid, known)
            return
        try:
            process = cma.verify(pid, address, value)
        except OSError as exc:
            log.info("rlinf: cannot read %s's memory (%s): its messages keep coming through shared memory",
                     src, exc)
            return
        if peer.source is not None:
            peer.source.close()
        peer.source = process
        self._notify(src, ["ok", self._incarnation])

    def _notify(self, dst: str, obj: list) -> None:
        try:
            self._send_notice(dst, obj)
        except (PeerLostError, ClosedError):
            pass     # gone: nothing to tell it

    # -- membership ------------------------------------------------------------------------
    def close(self, error: BaseException) -> None:
        """Revoke every hold, failing its send with ``error``, and forget every process
        (idempotent)."""
        self._closed = True
        for pull_id in list(self._held):
            self.drop(pull_id, error)
        for peer in list(self.peers.values()):
            peer.close()
