"""The control plane: a worker's connection to the manager, and shared helpers.

:class:`ControlClient` registers a worker, keeps it registered (heartbeats; it
re-registers by itself when a restarted manager does not know it), answers lookups,
and hands every membership event to a callback. Messages are msgpack maps with an
``op``; requests carry an ``id`` that the reply repeats.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Coroutine

import msgpack
import zmq
import zmq.utils.monitor

from ..config import DEFAULTS
from ..util.procs import process_gone
from ..errors import AddressInUseError, AuthenticationError, ClosedError, CommTimeoutError, ProtocolError
from ..info import MembershipEvent, WorkerInfo
from .clock import ClockSync
from .security import ClusterKeys

__all__ = ["ControlClient", "HANDSHAKE_FAILED", "pack", "unpack", "machine_id", "run"]

log = logging.getLogger("rlinf.control.client")

_MAX_CONTROL = 16 << 20


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """Decode a control message; raises ``ProtocolError`` on anything but a map with ``op``."""
    if len(data) > _MAX_CONTROL:
        raise ProtocolError("control message too large")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as exc:  # garbage input raises many msgpack types
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("control message is not a map with an 'op'")
    return message


@functools.cache
def machine_id() -> str:
    """The identity under which this process's pid means something: the machine and its
    PID namespace (not overridable). The manager judges the liveness of a worker with
    the same identity by its pid, and sweeps that pid's shared memory once it is gone.
    Containers of one host with one hostname and machine id but their own PID
    namespaces differ here: a pid of one is meaningless, or another process, in the
    other."""
    host = socket.gethostname()
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                value = f.read().strip()
            if value:
                host = f"{host}-{value[:12]}"
                break
        except OSError:
            continue
    try:
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return host
    return f"{host}-pidns{ns.st_dev}:{ns.st_ino}"


def process_gone_here(info: WorkerInfo) -> bool:
    """Whether ``info``'s process is known to be gone: only a process of this machine
    and PID namespace (same :func:`machine_id`) can be judged by its pid; False for
    the others."""
    return bool(info.pid) and info.meta.get("machine") == machine_id() and process_gone(info.pid)


def run(coro: Coroutine) -> Any:
    """Run ``coro`` on a fresh event loop, uvloop when installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


#: ZeroMQ monitor events that mean the CURVE handshake failed (a wrong token, mostly).
HANDSHAKE_FAILED = {
    getattr(zmq, name) for name in (
        "EVENT_HANDSHAKE_FAILED_AUTH", "EVENT_HANDSHAKE_FAILED_PROTOCOL", "EVENT_HANDSHAKE_FAILED_NO_DETAIL")
    if hasattr(zmq, name)
}


class ControlClient:
    """A worker's session with the manager.

    Args:
        context: the worker's ZeroMQ context (its ZAP handler lives there).
        keys: the cluster's derived keys.
        manager: the manager's request endpoint.
        info: this worker's registration.
        on_event: called on the loop thread as ``on_event(event, bye_sent)`` with each
            :class:`MembershipEvent`, including ones synthesised after a resync (a worker
            that vanished while we missed the manager's events is reported ``lost``);
            ``bye_sent`` is True when the leaving worker sent us an in-order "bye".
        stats: returns the stats dict sent with heartbeats.
        exclusive: the first registration fails if another incarnation holds the address.
        on_superseded: called (loop thread, with the manager's reason) when we are no
            longer registered and another incarnation has taken our address meanwhile: a
            re-registration never evicts it, so this incarnation should stop.
        manager_host: the address of the worker whose process also runs the manager (the
            facade's rank 0), if any.
        peer_timeout: seconds of manager silence after which this client judges peers
            alone (``RLINF_PEER_TIMEOUT``, the manager's timeout for remote peers).
        heartbeat_interval: seconds between heartbeats (``RLINF_HEARTBEAT_INTERVAL``).

    While the manager is silent (no heartbeat answered for the peer timeout: it died,
    or its machine is cut off), nobody reports lost peers, so this client judges what it
    can alone: a peer on its own machine (same ``machine_id``) whose process is gone,
    and ``manager_host``, are reported ``lost``. Other peers wait for the manager (a
    restarted one rebuilds the roster).
    """

    def __init__(self, context: zmq.Context, keys: ClusterKeys, manager: str, info: WorkerInfo,
                 on_event: Callable[[MembershipEvent], None],
                 stats: Callable[[], dict] | None = None, exclusive: bool = False,
                 on_superseded: Callable[[str], None] | None = None, manager_host: str | None = None,
                 peer_timeout: float = DEFAULTS.peer_timeout,
                 heartbeat_interval: float = DEFAULTS.heartbeat_interval) -> None:
        self.manager = manager
        self.manager_host = manager_host
        self.peer_timeout = peer_timeout
        self.heartbeat_interval = heartbeat_interval
        self.info = info
        self.exclusive = exclusive
        self._on_event = on_event
        self._on_superseded = on_superseded
        self._stats = stats
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, Callable | None]] = {}
        self._known: dict[str, WorkerInfo] = {}
        self._version = 0
        self._loop = asyncio.get_running_loop()
        self._auth_failed: asyncio.Future = self._loop.create_future()
        self._sock = context.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.sndhwm = 1000
        self._sock.routing_id = f"{info.address}|{info.incarnation}".encode()
        keys.secure_client(self._sock)
        self._monitor = self._sock.get_monitor_socket()
        self._sock.connect(manager)
        self._loop.add_reader(self._sock.FD, self._on_readable)
        self._loop.add_reader(self._monitor.FD, self._on_monitor)
        self._loop.call_soon(self._on_monitor)   # edge-triggered: drain what came before
        self._context = context
        self._keys = keys
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._stats_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()        # re-registrations and roster refreshes
        self._refresh_timer: asyncio.TimerHandle | None = None
        self._heard = time.monotonic()     # the last heartbeat answer (set by the heartbeat thread)
        self._reregistering = False
        self.latest_stats: dict | None = None
        #: our clock against the manager's, from the round trips of requests and heartbeats
        self.clock = ClockSync()
        self._closed = False
        self.manager_reachable = False

    # -- requests ----------------------------------------------------------------------
    async def request(self, op: str, *, timeout: float | None,
                      on_reply: Callable[[dict[str, Any]], None] | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for its reply.

        ``on_reply(reply)`` runs as the reply is read, before any message the manager
        sent after it: a roster in a reply is then applied exactly between the events
        that precede and follow it (applied later, when the waiting task resumes, a
        roster would be stale against the events read meanwhile, and a peer that joined
        in between would be reported lost).

        Raises:
            CommTimeoutError: no reply within ``timeout``.
            AuthenticationError: the manager refused our credentials.
        """
        if self._closed:
            raise ClosedError("control connection is closed")
        request_id = next(self._ids)
        fut = self._loop.create_future()
        self._pending[request_id] = (fut, on_reply)
        try:
            self._send(pack({"op": op, "id": request_id, **fields}))
            done, _ = await asyncio.wait({fut, self._auth_failed}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except zmq.Again as exc:
            raise CommTimeoutError(f"manager at {self.manager} is not accepting requests") from exc
        finally:
            self._pending.pop(request_id, None)
        if fut in done:
            return fut.result()
        if self._auth_failed in done:
            raise self._auth_failed.exception()
        fut.cancel()
        raise CommTimeoutError(f"no reply from the manager at {self.manager} to {op!r} within {timeout} s")

    async def register(self, timeout: float | None, *, rebuilding: bool = False) -> list[WorkerInfo]:
        """Register (or re-register) and return the roster.

        When ``rebuilding`` (a restarted manager forgot us, or it took us for lost), its
        roster is still filling up as the other workers re-register: report only joins
        now, and reconcile losses once every live worker has had time to come back. A
        re-registration is always exclusive: if another incarnation took our address
        meanwhile (a restart of us, say), it stays, and we are the one to go; else the
        two would evict each other for good.

        Raises:
            AddressInUseError: another incarnation holds our address.
        """
        sent = time.time()
        reply = await self.request("register", timeout=timeout, info=self.info.to_wire(),
                                   exclusive=self.exclusive or rebuilding,
                                   on_reply=lambda r: "taken" in r or self._resync_from(r, report_lost=not rebuilding))
        if "now" in reply:       # (a manager of an older version does not say)
            self.clock.sample(sent, reply["now"], time.time())
        if "taken" in reply:
            raise AddressInUseError(reply["taken"])
        self.manager_reachable = True
        roster = [WorkerInfo.from_wire(w) for w in reply["roster"]]
        if rebuilding:
            grace = 2 * self.peer_timeout + self.heartbeat_interval
            if self._refresh_timer is not None:
                self._refresh_timer.cancel()
            self._refresh_timer = self._loop.call_later(grace, lambda: self._closed or self._spawn(self._refresh()))
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_thread, name="rlinf-heartbeat",
                                               args=(self._context, self._keys, self._stop), daemon=True)
            self._heartbeat.start()
            self._watch_task = self._loop.create_task(self._watch_loop())
            if self._stats is not None:
                self._stats_task = self._loop.create_task(self._stats_loop())
        return roster

    async def _watch_loop(self) -> None:
        """While the manager is silent, report the peers we can judge alone (class doc)."""
        timeout, interval = self.peer_timeout, self.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._heard > timeout:
                self._judge_alone(timeout)

    def _judge_alone(self, silent: float) -> None:
        for address, info in list(self._known.items()):
            if address == self.info.address:
                continue
            if address == self.manager_host or process_gone_here(info):
                log.warning("rlinf %s: the manager has been silent for over %.1f s and %s is gone; "
                            "reporting it lost", self.info.address, silent, address)
                self._apply(MembershipEvent("lost", address, info.incarnation, info))

    async def _stats_loop(self) -> None:
        while True:
            self.latest_stats = self._stats()
            await asyncio.sleep(1.0)

    async def lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        reply = await self.request("lookup", timeout=timeout, address=address, wait=wait)
        return WorkerInfo.from_wire(reply["info"]) if reply.get("info") else None

    def _send(self, data: bytes) -> None:
        self._sock.send(data, zmq.NOBLOCK)
        # A send may consume the edge-triggered read notification: look again.
        self._loop.call_soon(self._on_readable)

    # -- incoming ----------------------------------------------------------------------
    def _on_readable(self) -> None:
        sock = self._sock
        while not self._closed and not sock.closed:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:   # context going away under us: stop reading for good
                self._stop_reading(exc)
                return
            try:
                self._dispatch(unpack(data))
            except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                log.warning("rlinf: bad message from the manager: %s", exc)

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "reply":
            fut, on_reply = self._pending.get(message.get("id"), (None, None))
            if fut is not None and not fut.done():
                if on_reply is not None:
                    on_reply(message)
                fut.set_result(message)
        elif op == "event":
            info = WorkerInfo.from_wire(message["info"]) if message.get("info") else None
            reason = message.get("reason", "")
            event = MembershipEvent(message["kind"], message["address"], message.get("incarnation", ""), info,
                                    reason if isinstance(reason, str) else "")
            self._version = max(self._version, message.get("version", 0))
            self._apply(event, self.info.address in message.get("bye_to", ()))
        elif op == "heartbeat":
            self._on_heartbeat_reply(message)

    def _apply(self, event: MembershipEvent, bye_sent: bool = False) -> None:
        if event.kind == "joined" and event.info is not None:
            self._known[event.address] = event.info
        elif self._known.get(event.address, None) is not None:
            if self._known[event.address].incarnation == event.incarnation or not event.incarnation:
                del self._known[event.address]
        self._on_event(event, bye_sent)

    def _resync_from(self, reply: dict[str, Any], *, report_lost: bool = True) -> None:
        """Apply the roster of a ``register`` or ``roster`` reply, as it is read."""
        try:
            roster = [WorkerInfo.from_wire(w) for w in reply["roster"]]
            version = reply["version"]
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("rlinf: bad roster from the manager: %s", exc)
            return
        self._resync(roster, version, report_lost=report_lost)

    def _resync(self, roster: list[WorkerInfo], version: int, *, report_lost: bool = True) -> None:
        """Reconcile our view with a full roster: synthesise the events we missed."""
        new = {w.address: w for w in roster}
        for address, old in list(self._known.items()):
            cur = new.get(address)
            if (cur is None and report_lost) or (cur is not None and cur.incarnation != old.incarnation):
                self._apply(MembershipEvent("lost", address, old.incarnation, old))
        for address, cur in new.items():
            old = self._known.get(address)
            if old is None or old.incarnation != cur.incarnation:
                self._apply(MembershipEvent("joined", address, cur.incarnation, cur))
        self._version = version

    def _stop_reading(self, exc: BaseException) -> None:
        log.debug("rlinf: control socket of %s stopped: %s", self.info.address, exc)
        for sock in (self._sock, self._monitor):
            try:
                self._loop.remove_reader(sock.FD)
            except (ValueError, OSError, RuntimeError, zmq.ZMQError):
                pass

    def _on_monitor(self) -> None:
        while not self._closed and not self._monitor.closed:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._stop_reading(exc)
                return
            if event["event"] in HANDSHAKE_FAILED and not self.manager_reachable and not self._auth_failed.done():
                self._auth_failed.set_exception(AuthenticationError(
                    f"the manager at {self.manager} refused the handshake: wrong or missing cluster token"))
                self._auth_failed.exception()  # retrieved here; re-raised by request()

    # -- background --------------------------------------------------------------------
    async def _reregister(self) -> None:
        try:
            await self.register(timeout=5.0, rebuilding=True)
            log.info("rlinf: %s re-registered with the manager", self.info.address)
        except AddressInUseError as exc:
            log.warning("rlinf: %s was replaced while the manager took it for lost (%s); this "
                        "incarnation stops", self.info.address, exc)
            if self._on_superseded is not None and not self._closed:
                self._on_superseded(str(exc))
        except (CommTimeoutError, ClosedError) as exc:
            log.debug("rlinf: re-registration failed: %s", exc)
        finally:
            self._reregistering = False

    async def _refresh(self) -> None:
        try:
            await self.request("roster", timeout=5.0, on_reply=self._resync_from)
        except (CommTimeoutError, ClosedError):
            pass

    def _heartbeat_thread(self, context: zmq.Context, keys: ClusterKeys, stop: threading.Event) -> None:
        """Heartbeats come from a thread with its own socket, so a busy event loop (a long
        import, a training step) does not make a live worker look dead. Replies that need
        action are handed to the loop."""
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 4
        sock.routing_id = f"{self.info.address}|{self.info.incarnation}|hb".encode()
        keys.secure_client(sock)
        sock.connect(self.manager)
        interval = self.heartbeat_interval
        ident = {"op": "heartbeat", "address": self.info.address, "incarnation": self.info.incarnation}
        last_stats = 0.0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not stop.is_set():
                now = time.monotonic()
                message = {**ident, "t": time.time()}     # echoed: a round trip for the clock
                if self.latest_stats is not None and now - last_stats >= 1.0:
                    message["stats"] = self.latest_stats
                    last_stats = now
                try:
                    sock.send(pack(message), zmq.NOBLOCK)
                except zmq.Again:
                    pass   # manager away; heartbeats are already queued
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0 and not stop.is_set():
                    # short slices so close() never waits long for this thread
                    if dict(poller.poll(min(left, 0.1) * 1000)).get(sock):
                        try:
                            reply = unpack(sock.recv(zmq.NOBLOCK))
                        except (zmq.Again, ProtocolError):
                            continue
                        self._heard = time.monotonic()   # here: a busy loop must not look like silence
                        if isinstance(reply.get("t"), float) and isinstance(reply.get("now"), float):
                            self.clock.sample(reply["t"], reply["now"], time.time())
                        self._loop.call_soon_threadsafe(self._on_heartbeat_reply, reply)
        except zmq.ContextTerminated:
            pass
        except RuntimeError:   # the loop closed under us: the communicator is going away
            pass
        finally:
            sock.close(0)

    def _on_heartbeat_reply(self, reply: dict[str, Any]) -> None:
        if self._closed:
            return
        self.manager_reachable = True
        if not reply.get("known"):
            if not self._reregistering:
                self._reregistering = True
                self._spawn(self._reregister())
        elif reply.get("version") != self._version:
            self._spawn(self._refresh())

    def _spawn(self, coro: Coroutine) -> None:
        """Run ``coro`` as a task of this client (kept until done, cancelled by :meth:`close`).
        Once closing, nothing new starts (a heartbeat reply queued before the close may
        still ask for a refresh)."""
        if self._stop.is_set():
            coro.close()
            return
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, *, deregister: bool = True, bye_to: list[str] = (), failure: str = "") -> None:
        """Deregister (best effort, bounded) and close. Idempotent.

        ``bye_to`` lists the peers that were sent an in-order "bye" on their data link.
        ``failure``: the one-line summary of the exception this worker closes because of
        (the manager then announces ``failed`` instead of ``left``).
        """
        if self._closed:
            return
        self._stop.set()
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in (self._stats_task, self._watch_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            if self._heartbeat is not None:
                await self._loop.run_in_executor(None, self._heartbeat.join, 2.0)
            if deregister and self.manager_reachable:
                try:
                    await self.request("deregister", timeout=1.0, address=self.info.address,
                                       incarnation=self.info.incarnation, bye_to=list(bye_to),
                                       **({"failure": failure} if failure else {}))
                except (CommTimeoutError, AuthenticationError, zmq.ZMQError):
                    pass   # best effort: the manager will notice us gone anyway
        finally:
            self._closed = True
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(ClosedError("control connection closed"))
                    fut.exception()   # the requester (if any) still sees it; nobody else must
            self._stop_reading(ClosedError("closed"))
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._sock.close(0)
