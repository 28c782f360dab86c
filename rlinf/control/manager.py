"""The registry server: who is in the cluster, where they are, and who left.

The manager owns a ZeroMQ ROUTER (requests from workers, and membership events pushed
back on the same connection so no worker misses one) and a PUB socket (the same events
for observers such as ``rlinf top``). Both are CURVE-authenticated with the cluster
token. It keeps a roster ``address -> WorkerInfo`` plus the latest stats each worker
reported with its heartbeat, and announces ``joined`` / ``left`` / ``failed`` / ``lost``
(``failed``: a worker that deregistered saying its code raised, with the summary).

A worker is ``lost`` when it misses heartbeats for ``peer_timeout`` seconds, or at once
when it ran on this machine and its process is gone. The manager holds no state that
workers cannot rebuild: a restarted manager learns the roster again from the workers,
which re-register when a heartbeat reply says they are unknown.

Run it embedded (``async with Manager(...)``) or standalone::

    python -m rlinf.manager --bind tcp://0.0.0.0:5555 --token SECRET
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import time
from typing import Any

import zmq

from . import client as control
from ..config import Settings
from ..transports import leftovers
from ..util.procs import process_gone
from ..errors import ProtocolError
from ..info import MAX_REASON, MembershipEvent, WorkerInfo, check_plain
from .security import ClusterKeys, ZapHandler, generate_token

__all__ = ["Manager", "main"]

log = logging.getLogger("rlinf.manager")

#: Seconds between the manager's liveness checks (``Manager(check_interval=...)``).
CHECK_INTERVAL = 0.1


def detection_time(settings: Settings) -> float:
    """The failure-detection time: the longest a worker judged by its heartbeats (one on
    another machine that was killed, stalled or cut off) goes from its failure to being
    declared ``lost``, in seconds. Its last heartbeat arrived at most when it failed;
    ``settings.peer_timeout`` of silence later, the next liveness check (every
    :data:`CHECK_INTERVAL`) declares it lost. Pending operations on it fail as the
    event reaches their worker, one message (milliseconds) later. The docs state this
    figure for the defaults (a test checks that they agree)."""
    return settings.peer_timeout + CHECK_INTERVAL


def local_backstop(peer_timeout: float) -> float:
    """Seconds of silence after which a live process on the manager's own machine counts
    as lost: its liveness is observable, so silence means busy; a dead one is lost at
    its first liveness check."""
    return max(10.0, 4 * peer_timeout)

#: Lookups of one address that wait for it to register (see ``Manager._wait_lookup``).
MAX_LOOKUP_WAITERS = 1024


def _expect_str(req: dict[str, Any], field: str) -> None:
    if not isinstance(req[field], str):
        raise TypeError(f"request field {field!r} must be a str")


class Manager:
    """The cluster registry (see the module docstring).

    Args:
        bind: ZeroMQ endpoint for requests, e.g. ``"tcp://127.0.0.1:0"`` (port 0 picks one).
        token: the cluster secret (generated when None; read it from ``.token``).
        peer_timeout: seconds without a heartbeat before a worker is declared lost
            (default: ``settings.peer_timeout``).
        check_interval: how often liveness is checked.
        settings: where ``peer_timeout`` comes from when not given (default
            ``Settings.from_env()``, read here: ``RLINF_PEER_TIMEOUT``).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, token: str | None = None,
                 peer_timeout: float | None = None, check_interval: float = CHECK_INTERVAL,
                 settings: Settings | None = None) -> None:
        if peer_timeout is None:
            peer_timeout = (settings if settings is not None else Settings.from_env()).peer_timeout
        self.token = token or generate_token()
        self._keys = ClusterKeys(self.token)
        self._bind = bind
        self.peer_timeout = peer_timeout
        if not self.peer_timeout > 0 or not check_interval > 0:   # also refuses NaN
            raise ValueError(f"peer_timeout and check_interval must be > 0 seconds, got "
                             f"{self.peer_timeout!r} and {check_interval!r}")
        #: Silence after which a live process on the manager's own machine counts as lost.
        self.local_backstop = local_backstop(self.peer_timeout)
        self._check_interval = check_interval
        self._roster: dict[str, WorkerInfo] = {}
        self._identity: dict[str, bytes] = {}       # address -> ROUTER identity
        self._last_seen: dict[str, float] = {}
        self._stats: dict[str, Any] = {}
        self._lookups: dict[str, list[tuple[bytes, int]]] = collections.defaultdict(list)
        self.events: collections.deque[MembershipEvent] = collections.deque(maxlen=200)
        self.version = 0
        self.address = ""
        self.events_address = ""
        self._context: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._checker: asyncio.Task | None = None
        self._machine = control.machine_id()
        self._recheck = False
        self._sweep: set[int] = set()    # pids of departed local workers (see _sweep_gone)

    def __repr__(self) -> str:
        return f"<Manager {self.address or 'unbound'} workers={len(self._roster)}>"

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> Manager:
        """Bind and start serving. Returns self."""
        self._loop = asyncio.get_running_loop()
        leftovers.remove_orphans()     # of a job that died here with its manager
        self._context = zmq.Context()
        self._zap = ZapHandler(self._context, self._keys)
        self._zap.attach(self._loop)
        router = self._context.socket(zmq.ROUTER)
        router.linger = 0
        router.router_mandatory = False
        router.sndhwm = 100_000
        self._keys.secure_server(router)
        pub = self._context.socket(zmq.PUB)
        pub.linger = 0
        self._keys.secure_server(pub)
        try:
            router.bind(self._bind)
            host = self._bind.rsplit(":", 1)[0] if self._bind.startswith("tcp://") else None
            if host:
                pub.bind(f"{host}:0")
            else:
                pub.bind(self._bind + ".events")
        except zmq.ZMQError as exc:
            router.close(0)
            pub.close(0)
            self._zap.close()
            self._context.term()
            raise OSError(f"manager cannot bind {self._bind}: {exc}") from exc
        self._router, self._pub = router, pub
        self.address = router.last_endpoint.decode()
        self.events_address = pub.last_endpoint.decode()
        self._loop.add_reader(router.FD, self._on_readable)
        self._loop.call_soon(self._on_readable)
        self._checker = self._loop.create_task(self._check_loop())
        return self

    async def close(self) -> None:
        """Stop serving and release the sockets. Idempotent."""
        if self._router is None:
            return
        if self._checker is not None:
            self._checker.cancel()
            try:
                await self._checker
            except asyncio.CancelledError:
                pass
        try:
            self._loop.remove_reader(self._router.FD)
        except (ValueError, OSError, RuntimeError):
            pass
        self._router.close(0)
        self._pub.close(0)
        self._zap.close()
        self._context.term()
        self._router = None

    async def __aenter__(self) -> Manager:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- state -------------------------------------------------------------------------
    def roster(self) -> list[WorkerInfo]:
        """A snapshot of the registered workers."""
        return list(self._roster.values())

    def snapshot(self) -> dict[str, Any]:
        """Roster, latest stats per worker and recent events (for ``rlinf top``)."""
        now, mono = time.time(), time.monotonic()
        return {
            "manager": self.address,
            "time": now,
            "version": self.version,            # +1 per event: tells observers how many are new
            "peer_timeout": self.peer_timeout,
            "workers": [
                {**info.to_wire(), "age": now - info.start_time, "stats": self._stats.get(info.address, {}),
                 "silence": mono - self._last_seen.get(info.address, mono)}   # since its last heartbeat
                for info in self._roster.values()
            ],
            "events": [{"kind": e.kind, "address": e.address, **({"reason": e.reason} if e.reason else {})}
                       for e in self.events],
        }

    # -- socket handling ---------------------------------------------------------------
    def _on_readable(self) -> None:
        self._recheck = False
        router = self._router
        if router is None:
            return
        for _ in range(1024):
            try:
                identity, payload = router.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:
                log.warning("rlinf manager: dropped a request with no payload")
                continue
            try:
                request = control.unpack(payload)
                self._handle(identity, request)
            except (ProtocolError, ValueError, TypeError, KeyError) as exc:
                log.warning("rlinf manager: rejected a malformed request: %s", ProtocolError(str(exc)))
            except Exception:   # a bug of ours on one request must not stop the registry
                log.exception("rlinf manager: a request from %r failed", identity)
        self._loop.call_soon(self._on_readable)

    def _send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            self._router.send_multipart([identity, control.pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or too slow: it will re-sync by heartbeat
            log.debug("rlinf manager: could not reach %r: %s", identity, exc)
        # A send may consume the edge-triggered read notification: look again soon.
        if not self._recheck:
            self._recheck = True
            self._loop.call_soon(self._on_readable)

    def _reply(self, identity: bytes, request: dict, **fields: Any) -> None:
        self._send(identity, {"op": "reply", "id": request.get("id"), **fields})

    def _handle(self, identity: bytes, req: dict[str, Any]) -> None:
        """One request. Each checks all of its fields before it changes anything: a bad
        one raises (``ValueError`` / ``TypeError`` / ``KeyError``) with the state intact."""
        op = req["op"]
        if op in ("heartbeat", "deregister", "lookup"):
            _expect_str(req, "address")
        if op == "register":
            info = WorkerInfo.from_wire(req["info"])
            old = self._roster.get(info.address)
            if req.get("exclusive") and old is not None and old.incarnation != info.incarnation:
                self._reply(identity, req, ok=False, taken=f"{info.address} is held by a live worker "
                                                           f"(pid {old.pid} on {old.host})")
                return
            self._register(identity, info)
            self._reply(identity, req, ok=True, version=self.version,
                        roster=[w.to_wire() for w in self._roster.values()],
                        events=self.events_address, now=time.time())   # (now: for the worker's clock)
        elif op == "heartbeat":
            address = req["address"]
            info = self._roster.get(address)
            known = info is not None and info.incarnation == req.get("incarnation")
            if known:
                self._last_seen[address] = time.monotonic()
                if "stats" in req:
                    self._keep_stats(address, req["stats"])
            # ``t`` echoed and ``now``: a round trip that measures the worker's clock against ours
            self._send(identity, {"op": "heartbeat", "known": known, "version": self.version,
                                  "t": req.get("t"), "now": time.time()})
        elif op == "deregister":
            bye_to = req.get("bye_to", [])
            if not isinstance(bye_to, list) or not all(isinstance(a, str) for a in bye_to):
                raise TypeError("deregister 'bye_to' must be a list of addresses")
            failure = req.get("failure", "")     # why it closed, when its code raised
            if not isinstance(failure, str):
                raise TypeError("deregister 'failure' must be a str")
            info = self._roster.get(req["address"])
            if info is not None and info.incarnation == req.get("incarnation"):
                self._remove(info, "failed" if failure else "left", bye_to=bye_to, reason=failure[:MAX_REASON])
            self._reply(identity, req, ok=True)
        elif op == "lookup":
            info = self._roster.get(req["address"])
            if info is not None or not req.get("wait", False):
                self._reply(identity, req, info=info.to_wire() if info else None)
            else:
                self._wait_lookup(identity, req["address"], req.get("id"))
        elif op == "roster":
            self._reply(identity, req, version=self.version, roster=[w.to_wire() for w in self._roster.values()])
        elif op == "snapshot":
            self._reply(identity, req, snapshot=self.snapshot())
        else:
            raise ValueError(f"unknown op {op!r}")

    def _keep_stats(self, address: str, stats: Any) -> None:
        """Keep what a heartbeat reported for ``rlinf top``; stats that could not be
        re-encoded (or nest too deep) are dropped, the heartbeat still counts."""
        try:
            if not isinstance(stats, dict):
                raise TypeError("heartbeat 'stats' must be a map")
            check_plain(stats, "heartbeat 'stats'")
        except (TypeError, ValueError) as exc:
            log.debug("rlinf manager: dropped the stats of %s: %s", address, exc)
            return
        self._stats[address] = stats

    def _wait_lookup(self, identity: bytes, address: str, request_id: Any) -> None:
        """Answer ``identity``'s lookup of ``address`` once it registers. One waiter per
        asker and address (a client retries a pending lookup: the newest request id
        wins), at most :data:`MAX_LOOKUP_WAITERS` per address (the oldest is dropped;
        its asker retries)."""
        waiters = self._lookups[address]
        waiters[:] = [w for w in waiters if w[0] != identity]
        waiters.append((identity, request_id))
        if len(waiters) > MAX_LOOKUP_WAITERS:
            del waiters[0]

    def _forget_lookups(self, identity: bytes) -> None:
        for address in list(self._lookups):
            kept = [w for w in self._lookups[address] if w[0] != identity]
            if kept:
                self._lookups[address] = kept
            else:
                del self._lookups[address]

    def _register(self, identity: bytes, info: WorkerInfo) -> None:
        old = self._roster.get(info.address)
        if old is not None and old.incarnation != info.incarnation:
            self._remove(old, "lost")   # a restart under the same address replaces the old one
        if info.start_time == 0.0:
            info = WorkerInfo.from_wire({**info.to_wire(), "start_time": time.time()})
        self._roster[info.address] = info
        self._identity[info.address] = identity
        self._last_seen[info.address] = time.monotonic()
        if old is None or old.incarnation != info.incarnation:
            self._announce(MembershipEvent("joined", info.address, info.incarnation, info))
        for waiter_identity, request_id in self._lookups.pop(info.address, ()):
            self._send(waiter_identity, {"op": "reply", "id": request_id, "info": info.to_wire()})

    def _remove(self, info: WorkerInfo, kind: str, bye_to: list[str] = (), reason: str = "") -> None:
        self._roster.pop(info.address, None)
        identity = self._identity.pop(info.address, None)
        if identity is not None:   # nobody is left to answer: forget what it waits for
            self._forget_lookups(identity)
        self._last_seen.pop(info.address, None)
        self._stats.pop(info.address, None)
        if info.pid and info.meta.get("machine") == self._machine and len(self._sweep) < 100_000:
            self._sweep.add(info.pid)
            self._sweep_gone()
        self._announce(MembershipEvent(kind, info.address, info.incarnation, info, reason), bye_to)

    def _sweep_gone(self) -> None:
        """Unlink the shared memory of departed local workers whose process is gone (a
        ``kill -9`` leaves its ``/dev/shm/rlinf-<pid>-*`` segments behind)."""
        from ..transports.shm import sweep   # the manager never needs numpy otherwise

        for pid in [p for p in self._sweep if process_gone(p)]:
            self._sweep.discard(pid)
            if sweep(pid):
                log.info("rlinf manager: removed the shared memory of lost process %d", pid)

    def _announce(self, event: MembershipEvent, bye_to: list[str] = ()) -> None:
        self.version += 1
        self.events.append(event)
        message = {"op": "event", "kind": event.kind, "address": event.address,
                   "incarnation": event.incarnation, "version": self.version,
                   "info": event.info.to_wire() if event.info else None, "bye_to": list(bye_to),
                   "reason": event.reason}
        log.info("rlinf manager: %s %s%s", event.kind, event.address, f" ({event.reason})" if event.reason else "")
        for identity in list(self._identity.values()):
            self._send(identity, message)
        try:
            self._pub.send(control.pack(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def _check_loop(self) -> None:
        while True:   # a bug in one pass must not end liveness checking for good
            try:
                await self._check_passes()
            except Exception:
                log.exception("rlinf manager: a liveness check failed")

    async def _check_passes(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self._check_interval)
            now = time.monotonic()
            stall = now - last - self._check_interval
            last = now
            if stall > 0.2:
                # Our own loop was stalled (an embedded manager shares the driver's loop):
                # the workers were not silent, we were deaf. Credit them the stall.
                for address in self._last_seen:
                    self._last_seen[address] += stall
            self._on_readable()   # judge silence only after reading the heartbeats that queued up
            for address, info in list(self._roster.items()):
                silent = now - self._last_seen.get(address, now)
                if info.meta.get("machine") == self._machine and info.pid:
                    # On our machine liveness is observable: a dead process is lost at once,
                    # while silence from a live one means it is busy (e.g. a C extension
                    # holding the GIL), judged only after a long backstop.
                    lost = process_gone(info.pid) or silent > self.local_backstop
                else:
                    lost = silent > self.peer_timeout
                if lost:
                    self._remove(info, "lost")
            if self._sweep:
                self._sweep_gone()


async def _serve(bind: str, token: str | None, settings: Settings) -> None:
    async with Manager(bind, token=token, settings=settings) as manager:
        print(f"rlinf manager listening on {manager.address}", flush=True)
        if token is None:
            print(f"token: {manager.token}", flush=True)
        print(f"workers join with: RLINF_MANAGER={manager.address} RLINF_TOKEN=<token>", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m rlinf.manager`` / ``rlinf manager``."""
    parser = argparse.ArgumentParser(prog="rlinf manager", description="Run a standalone rlinf manager.")
    parser.add_argument("--bind", default="tcp://0.0.0.0:5555", help="ZeroMQ endpoint to bind (default %(default)s)")
    parser.add_argument("--token", default=None,
                        help="cluster token (default $RLINF_TOKEN, else a new one is printed)")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except ValueError as exc:     # a bad RLINF_* variable: say which, without a traceback
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    control.run(_serve(args.bind, args.token or settings.token, settings))


if __name__ == "__main__":
    main()
