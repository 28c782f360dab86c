"""The channel server: one worker (``channel.<name>:0``) that owns a channel's queues.

:class:`ChannelServer` joins the cluster with its own :class:`~rlinf.core.communicator.CoreCommunicator`
(meta ``{"kind": "channel", "channel": name}``, so it shows in the roster and in
``rlinf top``; its :class:`~rlinf.channel.stats.ChannelStats` go with its heartbeats as
``"channel"``), receives the operations of every client handle, feeds them to the state
machine (:class:`~rlinf.channel._core.ChannelCore`) and sends the answers back, batched
per handle once per loop iteration. It ends once the channel is closed and drained.

:class:`ServerProcess` runs one in a child process (spawn context). The child exits when
the channel is drained, when asked to stop, or when its parent's pipe closes (the
parent died), so a channel process never outlives the worker that created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import re
import traceback
from typing import Any

from ..control import client as control
from ..control.cleanup import remove_socket_dirs
from ..core.communicator import CoreCommunicator
from ..errors import (AddressInUseError, ClosedError, CommTimeoutError, DecodeError, PeerLostError, ProtocolError,
                      RlinfError, WorkerFailedError)
from ..info import socket_dirs
from ..util.futures import retrieve
from ..util.pipe import MessagePipe
from ..core.routing import CUDA_IPC
from . import _ahead, _lost
from ._core import ChannelCore
from ._state import Handle
from ._wire import decode_ops, encode_ops
from .stats import ChannelStats

__all__ = ["ChannelServer", "ServerProcess", "server_address", "check_name", "REQUEST_TAG", "reply_tag"]

log = logging.getLogger("rlinf.channel")

#: Tag of client -> server messages (str tags never match a user's int tags).
REQUEST_TAG = "rlinf.channel"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
_STOP_GRACE = 3.0
#: Young-generation GC threshold in a channel process (Python's default is 700).
_GC_THRESHOLD = 50_000
#: How long the handles of a peer taken for lost (its process may live: another machine,
#: or stalled) keep what was sent to them, waiting for it to come back, before they are
#: forgotten and those items go to other consumers.
LOST_HOLD = 30.0


def reply_tag(hid: int) -> str:
    """Tag of server -> handle ``hid`` messages."""
    return f"rlinf.channel.{hid}"


def check_name(name: Any) -> str:
    """Validate a channel name.

    Raises:
        TypeError: not a str. ValueError: empty, too long, or not ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(name, str):
        raise TypeError(f"a channel name must be a str, got {type(name).__name__}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"a channel name is 1-100 characters from [A-Za-z0-9_.-], got {name!r}")
    return name


def server_address(name: str) -> str:
    """The worker address of channel ``name``'s server."""
    return f"channel.{check_name(name)}:0"


class ChannelServer:
    """Serves one channel from its own communicator (in this process, on this loop).

    Args:
        name: the channel's name.
        manager, token: the cluster to join.
        maxsize, policy, work_stealing, max_staleness, batch_size: see
            :func:`rlinf.channel.client.create_channel`.
    """

    def __init__(self, name: str, *, manager: str, token: str, maxsize: int = 0, policy: Any = "fifo",
                 work_stealing: bool | None = None, max_staleness: int | None = None,
                 batch_size: int | None = None) -> None:
        self.name = check_name(name)
        self.address = server_address(name)
        self.core = ChannelCore(name, maxsize=maxsize, policy=policy, work_stealing=work_stealing,
                                max_staleness=max_staleness, batch_size=batch_size, send=self._send)
        meta = {"kind": "channel", "channel": name, "policy": self.core.policy.name, "maxsize": maxsize}
        # exclusive: of two creators racing for one name, the second fails to join
        # The server holds items and never computes on them: GPU items reach it staged
        # through host memory (no CUDA context here, no producer's slots pinned by a queue),
        # and the items it forwards are never written here (their views go as they are).
        self.comm = CoreCommunicator(self.address, manager=manager, token=token, meta=meta, exclusive=True,
                                 disable=(CUDA_IPC,), forwards_unchanged=True)
        self._out: dict[tuple[str, int], list] = {}
        self._flush_scheduled = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Event | None = None
        self._closing = False
        self._close_task: asyncio.Future | None = None
        self._held: dict[tuple[str, int], list] = {}   # answers to a suspended handle: [ops, large]
        self._timer: asyncio.TimerHandle | None = None    # the core's next item to send ahead (_ahead)
        self._timer_due = 0.0

    def __repr__(self) -> str:
        return f"<ChannelServer {self.name} {self.core!r}>"

    async def start(self) -> ChannelServer:
        """Join the cluster and start serving.

        Raises:
            AuthenticationError, CommTimeoutError: from joining the cluster.
        """
        self._loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        await self.comm.start()
        self.comm.internal.on_peer_gone(self._on_gone)
        self.comm.internal.add_stats_provider("channel", lambda: ChannelStats.from_dict(self.core.stats()).to_dict())
        self._task = self._loop.create_task(self._serve(), name=f"rlinf-channel-{self.name}")
        return self

    async def _serve(self) -> None:
        internal, core = self.comm.internal, self.core
        try:
            while not core.finished:
                try:
                    message, src = await internal.recv_any(REQUEST_TAG)
                except DecodeError as exc:
                    log.warning("channel %s: dropped an undecodable request: %r", self.name, exc)
                    continue
                try:
                    if src == self.address:            # our own marker: a peer is gone
                        self._peer_gone(*message[1:])
                    else:
                        if self._held:
                            self._release_held(src, message[0])
                        core.handle_ops(src, message[0], decode_ops(message[1:]))
                    if core.timers:
                        self._arm()
                except (ProtocolError, ValueError, TypeError, KeyError, IndexError) as exc:
                    log.warning("channel %s: rejected a malformed request from %s: %r", self.name, src, exc)
        except ClosedError:
            return
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._flush()
            self.done.set()

    def _arm(self) -> None:
        """Wake up when the core has items to send ahead or recall (:mod:`._ahead`)."""
        due = _ahead.next_due(self.core)
        if due is None or (self._timer is not None and self._timer_due <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._loop.call_later(max(due - self.core.clock(), 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.core.finished:
            return
        try:
            _ahead.run_due(self.core)
        except Exception:    # (a bug: logged; the gets of those consumers are still answered)
            log.exception("channel %s: sending items ahead failed", self.name)
        self._arm()

    def _on_gone(self, address: str, incarnation: str) -> None:
        # Messages that peer sent before leaving may still wait in our mailbox: a marker
        # sent to ourselves is received after them, so its items are put back only once
        # its last "took"/"done" were applied.
        if self.core.has_source(address) and not self._closing:
            # Judged by what the roster knew of that incarnation, when the loss is learnt
            # (an answer cached at its first op may be another incarnation's, or none).
            departure = self.comm.internal.departed(address, incarnation)
            dead = departure is not None and (departure.kind == "left" or departure.info is not None
                                              and control.process_gone_here(departure.info))
            try:
                self.comm.internal.start_send(("gone", address, incarnation, dead), self.address, REQUEST_TAG)
            except RlinfError:
                pass

    def _peer_gone(self, address: str, incarnation: str, dead: bool) -> None:
        """``address`` left or was lost. A process known gone: its handles are forgotten.
        One that may live (on another machine, or stalled) and come back: its handles are
        suspended (:meth:`ChannelCore.suspend`: what was sent to them stays theirs, it
        may reach their application) for :data:`LOST_HOLD` seconds, then forgotten."""
        if dead:
            self._forget(address, incarnation)
            return
        for h in _lost.suspend(self.core, address, incarnation):
            self._loop.call_later(LOST_HOLD, self._expire, h, h.suspensions)

    def _forget(self, address: str, incarnation: str) -> None:
        self.core.gone(address, incarnation)
        for key in [k for k in self._held if k[0] == address]:
            del self._held[key]

    def _expire(self, h: Handle, suspension: int) -> None:
        """``h``'s hold for its ``suspension``-th loss ended: forget it if that loss
        lasts (not if it was back meanwhile, even if lost again since: a new hold runs)."""
        if h.lost and not h.dead and h.suspensions == suspension:
            log.warning("channel %s: %s was taken for lost %.0f s ago and is not back: its handle is forgotten, "
                        "its items go to other consumers", self.name, h.src, LOST_HOLD)
            self._held.pop((h.src, h.hid), None)
            _lost.expire(self.core, h)

    def _release_held(self, src: str, hid: int) -> None:
        """A handle that was suspended is back: what could not be sent to it goes first."""
        held = self._held.pop((src, hid), None)
        if held is None:
            return
        out = self._out.setdefault((src, hid), [[], False])
        out[0][:0] = held[0]
        out[1] = out[1] or held[1]
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _send(self, h: Handle, op: tuple) -> None:
        key = (h.src, h.hid)
        out = self._out.get(key)
        if out is None:
            out = self._out[key] = [[], False]
        ops = out[0]
        if op[0] == "ahead":       # items sent ahead (_ahead): large ones go out of band too
            if any(i[2] is not None and i[2][0] == 2 for i in op[2]):
                out[1] = True
        elif op[0] == "items":
            if any(i[2] is not None and i[2][0] == 2 for i in op[3]):
                out[1] = True
            last = ops[-1] if ops else None
            if op[1] == 0 and last is not None and last[0] == "items" and last[1] == 0 and last[2] == op[2]:
                last[3].extend(op[3])          # prefetched items for one key: one op
                return
        ops.append(op)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, {}
        for (src, hid), (ops, large) in out.items():
            try:
                message = encode_ops(ops, large)
            except Exception:     # (a bug) lost for that handle alone: the others' ops still go
                log.exception("channel %s: could not encode %d ops for %s", self.name, len(ops), src)
                continue
            try:
                future = self.comm.internal.start_send(message, src, reply_tag(hid))
            except PeerLostError:
                # taken for lost: kept in order for it in case it comes back (dropped
                # once its handle is forgotten)
                h = self.core.handles.get((src, hid))
                if h is not None and not self._closing:
                    held = self._held.setdefault((src, hid), [[], False])
                    held[0].extend(ops)
                    held[1] = held[1] or large
                continue
            except ClosedError:
                continue
            if not future.done():
                future.add_done_callback(retrieve)

    async def wait_done(self) -> None:
        """Wait until the channel is closed and drained (or the server stopped)."""
        await self.done.wait()

    async def aclose(self) -> None:
        """Stop serving and leave the cluster. Idempotent: every call waits for the one close."""
        if self._close_task is None:
            self._closing = True
            self._close_task = asyncio.ensure_future(self._aclose())
        await asyncio.shield(self._close_task)

    async def _aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.comm.aclose()


# -- a server in its own process ------------------------------------------------------------
def _tune_gc() -> None:
    """Set the garbage collector up for a process that only serves a channel.

    What it allocates are items in transit: a few tracked objects each, in no reference
    cycle, freed once delivered. With the default threshold every ~200 items of backlog
    growth trigger a young collection that walks them (with its older-generation
    follow-ups, ~2 us per item, 15-20% of the server's time at small items); with a high
    threshold most die before any collection sees them. What start-up created is moved
    out of the collector's way for good (``gc.freeze``). Cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_THRESHOLD, *gc.get_threshold()[1:])


async def _process_serve(name: str, manager: str, token: str, config: dict, pipe: MessagePipe) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_message(message: tuple) -> None:
        if message[0] == "stop":
            stop.set()

    server = ChannelServer(name, manager=manager, token=token, **config)
    await server.start()
    _tune_gc()
    pipe.start(loop, on_message, stop.set)   # EOF: the parent died, do not outlive it
    finished = loop.create_task(server.wait_done())
    stopped = loop.create_task(stop.wait())
    try:
        pipe.send(("ready", os.getpid(), socket_dirs(server.comm.info)))
        await asyncio.wait({finished, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished.cancel()
        stopped.cancel()
        pipe.stop()
        try:
            async with asyncio.timeout(_STOP_GRACE):
                await server.aclose()
        except TimeoutError:
            pass


def _process_main(name: str, manager: str, token: str, config: dict, conn) -> None:
    """Entry point of a channel process (module level so the spawn context imports it)."""
    pipe = MessagePipe(conn)
    try:
        control.run(_process_serve(name, manager, token, config, pipe))
    except AddressInUseError as exc:   # another creator won the name
        with contextlib.suppress(OSError):
            pipe.send_blocking(("taken", str(exc)))
    except BaseException:
        try:
            pipe.send_blocking(("failed", traceback.format_exc()))   # no loop any more
        except OSError:
            pass   # the parent is gone: nobody is left to tell
        raise
    finally:
        pipe.close()


class ServerProcess:
    """A channel server in a child process, owned by the worker that started it."""

    def __init__(self, name: str, *, manager: str, token: str, config: dict) -> None:
        self.name = name
        mp = multiprocessing.get_context("spawn")
        conn, child = mp.Pipe()
        self._pipe = MessagePipe(conn)
        self.process = mp.Process(target=_process_main, name=f"rlinf-channel-{name}", daemon=False,
                                  args=(name, manager, token, config, child))
        self.process.start()
        child.close()
        self._socket_dirs: list[str] = []

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} pid={self.process.pid} alive={self.process.is_alive()}>"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def wait_ready(self, timeout: float | None) -> None:
        """Wait for the child to serve.

        Raises:
            AddressInUseError: another channel of this name started first.
            WorkerFailedError: it failed to start (its traceback attached).
            CommTimeoutError: it was not ready within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def on_message(message: tuple) -> None:
            if ready.done():
                return
            if message[0] == "ready":
                self._socket_dirs = list(message[2]) if len(message) > 2 else []
                ready.set_result(None)
            elif message[0] == "taken":
                ready.set_exception(AddressInUseError(f"a channel named {self.name!r} already exists "
                                                      f"({message[1]})"))
            else:
                ready.set_exception(WorkerFailedError(f"channel {self.name!r} failed to start",
                                                      address=server_address(self.name),
                                                      remote_traceback=message[1]))

        def on_eof() -> None:
            on_message(("failed", f"channel process exited with code {self.process.exitcode}"))

        self._pipe.start(loop, on_message, on_eof)
        try:
            async with asyncio.timeout(timeout):
                await ready
        except TimeoutError:
            await self.stop()
            raise CommTimeoutError(f"channel {self.name!r} did not start within {timeout} s") from None
        except (WorkerFailedError, AddressInUseError):
            await self.stop()
            raise
        finally:
            self._pipe.stop()

    async def stop(self) -> None:
        """Ask the child to stop, then terminate, then kill it; reap it. Idempotent.
        Safe while :meth:`wait_ready` still watches the pipe (its timeout calls this)."""
        loop = asyncio.get_running_loop()
        self._pipe.stop()       # the one message below is written blocking
        if self.process.is_alive():
            try:
                # Blocking, but cannot block: a few bytes, and the only message we ever send.
                self._pipe.send_blocking(("stop",))
            except (OSError, ValueError):
                pass
            await loop.run_in_executor(None, self.process.join, _STOP_GRACE + 1.0)
        if self.process.is_alive():
            self.process.terminate()
            await loop.run_in_executor(None, self.process.join, 2.0)
        if self.process.is_alive():
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, 2.0)
        if not self.process.is_alive():
            # killed before it could remove them (its shared memory is the manager's to
            # sweep: it is a registered worker, and its pid may be reused from now on)
            remove_socket_dirs(self._socket_dirs)
        self._pipe.close()
