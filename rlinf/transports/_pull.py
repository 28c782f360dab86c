"""Single-copy pulls: a copy-out receiver reads a same-node sender's buffers in place.

A receiver that asked for owned copies (``shm_views=False``) would get a large
same-node message with two copies: the sender's into a shared-memory slot, then its own
out of the slot. With a pull there is one: the sender sends only the addresses of its
buffers (a :class:`rlinf.wire.PullRef`), keeps them alive and unchanged, and the receiver
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

Failures: a sender that dies before a read ends makes the receive of that message raise
:class:`~rlinf.errors.PeerLostError` (its pidfd says so; a reused pid is never read);
any other failed read raises :class:`~rlinf.errors.DecodeError` there. A receiver that
leaves or dies fails the sends waiting on it with ``PeerLostError``; closing fails them
with ``ClosedError``.

Buffer lifetime: the sender holds a pulled message's buffers (they must not change)
until the receiver's ``done``, the receiver's departure or close; only then does the
send complete. The receiver's buffers are recycled private memory, owned by it (reused
once nothing references them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any, Callable, Sequence

from .. import wire
from ..copier import Copier
from ..errors import ClosedError, DecodeError, PeerLostError, ProtocolError
from . import cma
from ._shm_common import _parse_bytes
from ._shm_pool import Recycler

__all__ = ["PullSession", "pull_threshold", "DEFAULT_PULL"]

log = logging.getLogger("rlinf.transports.shm")

#: Payloads from this many bytes are pulled by a copy-out receiver (``RLINF_SHM_PULL``).
DEFAULT_PULL = 1 << 20
TAG = "pull"


def pull_threshold(environ: Any = None) -> int:
    """``RLINF_SHM_PULL`` in bytes (0: pulls off), else :data:`DEFAULT_PULL`."""
    env = os.environ if environ is None else environ
    raw = env.get("RLINF_SHM_PULL", "").strip()
    if raw.lower() in ("off", "no", "false"):
        return 0
    return _parse_bytes(raw, "RLINF_SHM_PULL") if raw else DEFAULT_PULL


class _Held:
    """A pulled message's buffers, held by the sender until the receiver is done."""

    __slots__ = ("dst", "buffers", "future")

    def __init__(self, dst: str, buffers: list, future: asyncio.Future) -> None:
        self.dst = dst
        self.buffers = buffers
        self.future = future


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
        self._agreed: dict[str, str] = {}           # receiver -> its incarnation that agreed
        self._held: dict[int, _Held] = {}           # pull_id -> what a receiver still reads
        self._asked: set[tuple[str, str]] = set()   # senders (address, incarnation) asked
        self._sources: dict[tuple[str, str], cma.Process] = {}
        self._closed = False

    def __repr__(self) -> str:
        return (f"<PullSession threshold={self.threshold} offered={self.offered} pulled={self.pulled} "
                f"agreed={len(self._agreed)} held={len(self._held)} sources={len(self._sources)}>")

    def report(self) -> dict:
        """Plain values for the stats a worker reports (``rlinf top``)."""
        return {"threshold": self.threshold, "offered": self.offered, "pulled": self.pulled,
                "agreed": len(self._agreed), "sources": len(self._sources), "held": len(self._held)}

    # -- sending ---------------------------------------------------------------------------
    def agreed(self, dst: str, incarnation: str) -> bool:
        """Whether ``dst`` (this incarnation) pulls our large messages (cheap: one lookup)."""
        return self._agreed.get(dst) == incarnation

    def offer(self, dst: str, buffers: Sequence[Any], sizes: Sequence[int]) -> tuple[list, list, asyncio.Future]:
        """Hold ``buffers`` for ``dst`` to pull: ``(layout, wire item, future)``; the
        future completes once ``dst`` has read them (see the module docstring)."""
        pull_id = next(self._ids)
        self.offered += 1
        addresses = [cma.address_of(b) for b, n in zip(buffers, sizes) if n]
        future = self._loop.create_future()
        self._held[pull_id] = _Held(dst, list(buffers), future)
        return [-n if n else 0 for n in sizes], [pull_id, addresses], future

    def drop(self, pull_id: int, error: BaseException | None) -> None:
        """The message of ``pull_id`` was dropped unsent: its send fails with ``error``."""
        held = self._held.pop(pull_id, None)
        if held is not None and not held.future.done():
            held.future.set_exception(error or ClosedError("the message was dropped unsent"))

    # -- receiving -------------------------------------------------------------------------
    def want(self, src: str, incarnation: str) -> None:
        """A message from ``src`` came through one of its slots: ask it for pulls (once
        per incarnation)."""
        key = (src, incarnation)
        if key in self._asked or self._closed or not self.threshold:
            return
        self._asked.add(key)
        self._notify(src, ["ask", self._incarnation])

    def open(self, src: str, incarnation: str, ref: wire.PullRef, sizes: Sequence[int]) -> tuple[list, asyncio.Future]:
        """Start reading a pulled entry's buffers (``sizes``, in order) into our memory:
        ``(buffers, future)``; the buffers hold the data once the future is done (it
        raises ``PeerLostError`` or ``DecodeError`` if they cannot be read).

        Raises:
            ProtocolError: ``src`` never proved it can be read by us.
        """
        process = self._sources.get((src, incarnation))
        if process is None:
            raise ProtocolError(f"{src} sent a pull descriptor, but no pull was agreed with it")
        self.pulled += 1
        offsets, end = wire.slot_layout(list(sizes))
        dst = self._recycler.take(end)
        pairs = [(dst[o:o + n], cma.Remote(a, n)) for o, n, a in zip(offsets, sizes, ref.addresses)]
        if end >= self._offload:
            future = self._loop.run_in_executor(None, self._read, src, process, pairs)
            # runs before the receive that awaits the future resumes (callbacks go in order)
            future.add_done_callback(lambda f: self._finished(src, ref.pull_id, f))
        else:
            future = self._loop.create_future()
            try:
                self._read(src, process, pairs)
                future.set_result(None)
            except (PeerLostError, DecodeError) as exc:
                future.set_exception(exc)
            self._finished(src, ref.pull_id, future)     # now: the receive does not wait for it
        whole = memoryview(dst)
        return [whole[o:o + n] for o, n in zip(offsets, sizes)], future

    def _read(self, src: str, process: cma.Process, pairs: list) -> None:
        try:
            self._copier.copy(pairs, process.read)
        except ProcessLookupError:
            raise PeerLostError(f"{src} was lost before its message could be read", peer=src) from None
        except OSError as exc:
            raise DecodeError(f"message from {src} cannot be read from its memory: {exc}") from None

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
        if what == "done" and len(args) == 1:
            held = self._held.get(args[0])
            if held is not None and held.dst == src:
                del self._held[args[0]]
                if not held.future.done():
                    held.future.set_result(None)
        elif what == "ask" and len(args) == 1 and isinstance(args[0], str):
            if not self._closed and self.threshold:
                self._notify(src, ["cookie", self._incarnation, os.getpid(), self._cookie.address,
                                   self._cookie.value])
        elif what == "cookie" and len(args) == 4:
            self._verify(src, *args)
        elif what == "ok" and len(args) == 1 and isinstance(args[0], str):
            self._agreed[src] = args[0]
        else:
            raise ProtocolError(f"malformed pull notice from {src}: {what!r}")

    def _verify(self, src: str, incarnation: Any, pid: Any, address: Any, value: Any) -> None:
        if self._closed or (src, incarnation) not in self._asked:
            return
        known = self._pid_of(src)
        if known is not None and known != pid:
            log.info("rlinf: %s reports pid %s, its registration %s: no pulls from it", src, pid, known)
            return
        try:
            process = cma.verify(pid, address, value)
        except (OSError, TypeError, ValueError) as exc:
            log.info("rlinf: cannot read %s's memory (%s): its messages keep coming through shared memory",
                     src, exc)
            return
        old = self._sources.pop((src, incarnation), None)
        if old is not None:
            old.close()
        self._sources[(src, incarnation)] = process
        self._notify(src, ["ok", self._incarnation])

    def _notify(self, dst: str, obj: list) -> None:
        try:
            self._send_notice(dst, obj)
        except (PeerLostError, ClosedError):
            pass     # gone: nothing to tell it

    # -- membership ------------------------------------------------------------------------
    def gone(self, address: str, incarnation: str) -> None:
        """``address`` (``incarnation``) left or died: fail the sends it still had to read,
        forget its agreement and its process."""
        if self._agreed.get(address) == incarnation:
            del self._agreed[address]
        error = PeerLostError(f"{address} left or was lost before it read the message", peer=address)
        for pull_id in [i for i, h in self._held.items() if h.dst == address]:
            self.drop(pull_id, error)
        self._asked.discard((address, incarnation))
        process = self._sources.pop((address, incarnation), None)
        if process is not None:
            process.close()

    def close(self, error: BaseException) -> None:
        """Fail every held send with ``error`` and forget every process (idempotent)."""
        self._closed = True
        self._agreed.clear()
        for pull_id in list(self._held):
            self.drop(pull_id, error)
        for process in self._sources.values():
            process.close()
        self._sources.clear()
