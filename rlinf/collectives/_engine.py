"""The machinery of one collective call, shared by :mod:`rlinf.collectives.group` and :mod:`rlinf.collectives.reshard`.

A :class:`Call` is one member's part in one collective call: its tag (namespace and
sequence number), its signature ``(kind, root, extra)``, its inbox and its sends.
:func:`execute` runs an algorithm as a call: deadline, member loss, aborts.

* Every message of a call is ``(kind, root, extra, phase, payload)`` under the call's
  internal str tag; a message with another signature raises ``ValueError``
  (mismatched calls), an abort message raises the error it carries.
* A receive names the members whose loss makes it hopeless (``needs``); when one of
  them is gone (``Core.on_peer_gone``), what is already queued is still taken, then
  the call fails with ``PeerLostError``. A member that finished and left owes nothing.
* Any failure of a call on one member (mismatch, bad argument, timeout, cancellation,
  loss) is sent to the other members as an abort, so no member is left waiting; late
  messages of a failed call are drained so none stays queued.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any, Awaitable, Callable, Collection, Sequence

from ..core.interface import Core
from ..errors import ClosedError, CommTimeoutError, PeerLostError, ProtocolError, RlinfError
from ..util.futures import retrieve

__all__ = ["Call", "execute", "calls_made"]

class _State:
    """Call numbering and pending calls of one communicator's core (no reference to it)."""

    __slots__ = ("seq", "pending", "__weakref__")

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.pending: set[Call] = set()

    def on_gone(self, address: str, incarnation: str) -> None:
        for call in list(self.pending):
            if address in call.member_set:
                call.lose(address)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(core: Core) -> _State:
    state = _states.get(core)
    if state is None:
        state = _states[core] = _State()
        core.on_peer_gone(state.on_gone)
    return state


def calls_made(core: Core, namespace: str) -> int:
    """How many calls this communicator has made in ``namespace`` (a group's)."""
    state = _states.get(core)
    return state.seq.get(namespace, 0) if state is not None else 0


_ABORT = "!"
_REMOTE = {"timeout": CommTimeoutError, "value": ValueError, "type": TypeError}


class Call:
    """One collective call on one member: its tag, signature, inbox and sends."""

    __slots__ = ("core", "state", "me", "members", "member_set", "index", "tag", "kind", "root", "extra",
                 "what", "stash", "sends", "error", "gone", "needs", "task", "baseline", "interrupted",
                 "finished", "remote", "arg_error")

    def __init__(self, core: Core, members: tuple[str, ...], member_set: frozenset, namespace: str, kind: str,
                 root: str | None, extra: Any, owner: str) -> None:
        core.check_open()
        self.core, self.state, self.me = core, _state(core), core.address
        self.members, self.member_set = members, member_set
        self.index = members.index(self.me)
        seq = self.state.seq.get(namespace, 0)
        self.state.seq[namespace] = seq + 1
        self.tag = f"{namespace}:{seq}"
        self.kind, self.root, self.extra = kind, root, extra
        self.what = f"{_describe(kind, root)} (call #{seq} of {owner})"
        self.stash: deque = deque()
        self.sends: list[asyncio.Future] = []
        self.error: BaseException | None = None      # fails the call at once (timeout)
        self.gone: dict[str, None] = {}               # members lost (or left) meanwhile, in that order
        self.needs: frozenset | set | None = None     # whom the pending receive waits for
        self.task: asyncio.Task | None = None
        self.baseline = 0                              # task.cancelling() when the call began
        self.finished = self.remote = self.interrupted = False
        self.arg_error: BaseException | None = None

    @property
    def others(self) -> list[str]:
        """The other members, starting after this one (spreads load when all send at once)."""
        n, i = len(self.members), self.index
        return [self.members[(i + k) % n] for k in range(1, n)]

    # sending -------------------------------------------------------------------------
    def send(self, phase: str, payload: Any, dst: str) -> None:
        """Queue ``payload`` to ``dst`` now; :meth:`drain` waits until its buffers are free."""
        fut = self.core.start_send((self.kind, self.root, self.extra, phase, payload), dst, self.tag)
        if fut.done():
            fut.result()
        else:
            self.sends.append(fut)

    async def fan_out(self, phase: str, payload: Any, dsts: Sequence[str]) -> None:
        """Send one payload to several members, encoding it (and writing same-node shared
        memory) once."""
        if len(dsts) > 1:
            await self.core.multicast((self.kind, self.root, self.extra, phase, payload), list(dsts), self.tag)
        else:
            for dst in dsts:
                self.send(phase, payload, dst)

    async def drain(self) -> None:
        """Wait until every send of this call released its buffers."""
        while self.sends:
            await self.sends.pop(0)

    # receiving -----------------------------------------------------------------------
    async def recv(self, phases: str | tuple[str, ...], src: str | Collection[str] | None = None, *,
                   needs: Collection[str] | None = None) -> tuple[str, str, Any]:
        """The oldest message of ``phases`` from ``src`` (an address, a set of them, or any
        member): ``(phase, sender, payload)``.

        ``needs`` are the members whose loss makes the wait hopeless (default: ``src``).
        Once one of them is gone, messages already queued are still taken (a member's
        last messages count); then the call fails with ``PeerLostError``.
        """
        if type(phases) is str:
            phases = (phases,)
        accept = (src,) if type(src) is str else src
        needs = (accept or ()) if needs is None else needs
        while True:
            for i, item in enumerate(self.stash):
                if item[0] in phases and (accept is None or item[1] in accept):
                    del self.stash[i]
                    return item
            # the first to go is named (a member that failed because of it may leave next)
            hopeless = next((m for m in self.gone if m in needs), None) if self.gone else None
            if hopeless is not None:
                try:   # take what is already queued first
                    obj, sender = await self.core.recv_any(self.tag, 0)
                except CommTimeoutError:
                    raise PeerLostError(f"{hopeless} was lost during {self.what}", peer=hopeless) from None
            else:
                self.needs = needs
                try:
                    obj, sender = await self.core.recv_any(self.tag)
                except asyncio.CancelledError:
                    if self.interrupted and self.error is None:   # woken by lose(): look again
                        self.interrupted = False
                        if self.task.uncancel() <= self.baseline:
                            continue
                    raise
                finally:
                    self.needs = None
            self._file(obj, sender)

    async def collect(self, phase: str, senders: Collection[str]) -> dict[str, Any]:
        """One message of ``phase`` from each of ``senders``, in arrival order: ``{sender: payload}``."""
        remaining, got = set(senders), {}
        while remaining:
            _, sender, payload = await self.recv(phase, remaining)
            remaining.discard(sender)
            got[sender] = payload
        return got

    def _file(self, obj: Any, sender: str) -> None:
        if type(obj) is not tuple or len(obj) != 5 or sender not in self.member_set:
            raise ProtocolError(f"{self.me}: malformed collective message from {sender} in {self.what}")
        kind, root, extra, phase, payload = obj
        if kind == _ABORT:
            self.remote = True
            text = f"{self.what} failed on {sender}: {payload[0]}"
            if phase == "lost":
                raise PeerLostError(text, peer=payload[1])
            raise _REMOTE.get(phase, RlinfError)(text)
        if (kind, root, extra) != (self.kind, self.root, self.extra):
            raise ValueError(f"mismatched collective calls: {sender} called {_describe(kind, root, extra)} "
                             f"while {self.me} called {self.what}; every member must make the same calls "
                             "on a group in the same order")
        self.stash.append((phase, sender, payload))

    # failure -------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Fail the call now from outside (its deadline): interrupt its task, raise ``exc``."""
        if not self.finished and self.error is None and self.task is not None:
            self.error = exc
            self._interrupt()

    def lose(self, address: str) -> None:
        """``address`` is gone: the call fails once it waits for a message that it owed."""
        if not self.finished:
            self.gone.setdefault(address)
            if self.needs is not None and address in self.needs:
                self._interrupt()

    def _interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.task.cancel()

    def abort_others(self, exc: BaseException) -> None:
        """Tell every other member this call failed here (fire and forget)."""
        if isinstance(exc, CommTimeoutError):
            code = "timeout"
        elif isinstance(exc, PeerLostError):
            code = "lost"
        elif isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, RlinfError):
            code = "value" if isinstance(exc, ValueError) else "type"
        else:
            code = "error"
        text = "cancelled" if isinstance(exc, asyncio.CancelledError) else f"{type(exc).__name__}: {exc}"
        message = (_ABORT, None, None, code, (text, getattr(exc, "peer", None)))
        for m in self.members:
            if m == self.me or m == getattr(exc, "peer", None):
                continue
            try:
                fut = self.core.start_send(message, m, self.tag)
            except RlinfError:
                continue
            fut.add_done_callback(retrieve)

    def check_aborted(self) -> None:
        """After the call succeeded here: raise an abort that is already queued (a member
        failed after it sent what this one needed, e.g. its timeout expired meanwhile),
        so the call fails on every member that can still tell."""
        self.core.take_queued(self.tag, self._file)     # raises for an abort

    def retire(self) -> None:
        """The call is over: its messages still queued or yet to come are dropped."""
        self.core.retire(self.tag)


def _queued_abort(call: Call) -> Exception | None:
    """The abort a member already sent, if one waits in the mailbox: when a member fails
    because of a third one and then leaves, its leaving may fail our sends to it before
    we heard of the third one's loss, but its abort, sent before it left, names that one."""
    try:
        call.check_aborted()
    except Exception as exc:
        return exc if call.remote else None     # an abort, not a malformed or mismatched message
    return None


def _describe(kind: str, root: Any, extra: Any = None) -> str:
    args = [f"root={root}"] if root is not None else []
    if kind == "all_reduce" and extra:
        args.append(f"op={extra[0]!r}, {extra[1]} {extra[2]} shape={tuple(extra[3])}")
    return f"{kind}({', '.join(args)})"


async def execute(call: Call, body: Callable[..., Awaitable[Any]], *args: Any, timeout: float | None) -> Any:
    """Run ``body(call, *args)`` as the call: deadline, member loss and aborts included.
    ``timeout``: seconds, or None for the communicator's default (``RLINF_TIMEOUT``;
    unset: none)."""
    try:
        timeout = call.core.timeout_of(timeout)
    except (TypeError, ValueError) as exc:     # raised inside the call: the others hear of it
        call.arg_error, timeout = exc, None
    trace = call.core.trace
    started = trace.now() if trace is not None else 0.0
    task = call.task = asyncio.current_task()
    call.baseline = task.cancelling()
    call.state.pending.add(call)
    call.gone.update((m, None) for m in call.members if call.core.is_lost(m))
    timer = None
    if timeout is not None and call.arg_error is None:
        timer = asyncio.get_running_loop().call_later(
            timeout, call.fail, CommTimeoutError(f"{call.what} did not complete within {timeout} s"))
    try:
        try:
            if call.arg_error is not None:
                raise call.arg_error
            result = await body(call, *args)
            call.check_aborted()
            return result
        except asyncio.CancelledError:
            if call.interrupted:
                call.interrupted = False
                if task.uncancel() <= call.baseline:
                    if call.error is None:     # woken for a lost member outside a receive
                        gone = next(iter(call.gone))     # the first to go
                        call.error = PeerLostError(f"{gone} was lost during {call.what}", peer=gone)
                    raise call.error from None
            raise
    except BaseException as exc:
        if isinstance(exc, PeerLostError) and not call.remote:
            cause = _queued_abort(call)
            if cause is not None:   # a member told us first why it failed: the root cause
                raise cause from exc
        if not call.remote and not isinstance(exc, ClosedError):
            call.abort_others(exc)
        raise
    finally:
        call.finished = True
        call.retire()
        if timer is not None:
            timer.cancel()
        call.state.pending.discard(call)
        if trace is not None:     # its messages are the sends and receives with its tag
            trace.span("collective", call.kind, started, tag=call.tag, root=call.root, members=len(call.members))
