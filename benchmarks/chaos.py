"""Chaos soak (issue 23): numbered traffic between workers on emulated nodes while a
seeded injector kills, stalls, disconnects and throttles them; a ledger judges every
message, collective call and channel item.

    python benchmarks/chaos.py [--minutes 10] [--seed 1] [--kinds kill,stall,...] [--events FILE]
    python benchmarks/chaos.py --check FILE      # judge a run's events (--events) again

Needs root (network namespaces; see ``tests/multinode/netns.py``). Exits 1 on any
silent loss, duplicate, reordering, corrupt or wrong result, crashed worker, or end
that did not complete (an end marker or the channel's end missing); 2 when emulated
nodes cannot be built here. A failure's reproducer is its seed and ``--kinds`` (the
faults follow from the seed alone); ``--events`` keeps every event, fault and process
log for reading it.

**Cluster.** 3 emulated nodes; a standalone manager and the channel's owner (and with
it the channel process) on node 0, whose link and these processes are never faulted; 6 workers ``w:0`` .. ``w:5``, two per
node (``w:2i`` and ``w:2i+1`` on node ``i``), so every worker has a same-node peer
(shared memory) and four cross-node peers (TCP).

**Traffic**, all of it the whole time:

* *Point-to-point.* Every worker sends to every other one, each pair on its own task,
  about 4 numbered messages a second (``seq`` counts per sender incarnation and
  receiver); every 16th carries 1-4 MiB (cycling), the others are small. Each worker
  keeps a receive pending from every peer (``comm.recv(peer)``), so a loss is announced
  to it by the pending or next receive, as DESIGN.md §4 says.
* *Collectives.* The six workers run numbered rounds on one group, alternately an
  ``all_reduce`` of ``[epoch, round, rank + 1]`` and a ``broadcast`` from a rotating
  root (every fourth one 2 MiB); each result is checked against what the round must
  give. A group numbers its calls per communicator, so a restarted worker (numbering
  from 0) cannot join the others' group: every restart starts a new collective *epoch*,
  in which every worker uses a second communicator ``c<epoch>:<k>`` and a new group.
* *Channel.* Every worker puts a numbered item about 4 times a second into one channel
  (fifo) and consumes from it with ``get(ack=True)``, recording the item and then
  acknowledging it (``task_done``).

**Faults**, one at a time, each followed by 1-4 s of calm; kinds come in shuffled
rounds of four, so each kind occurs equally often:

* ``kill``: SIGKILL of a random worker; 4-6 s later (after its peers were told it is
  lost) it is started again under the same address as a new incarnation, and the
  collective epoch advances.
* ``stall``: SIGSTOP of a random worker for 1-6 s (the peer timeout is 2.5 s, so some
  stalls get it declared lost and back), then SIGCONT.
* ``link_down``: node 1 or 2 loses its link for 1-10 s (node 0 holds the manager).
* ``rate_limit``: node 1 or 2's link is limited to 20-100 Mbit/s for 5-15 s.

A worker that fails by itself (an exception, an exit) while faults run is a finding: it
is recorded (``crashed workers``) and started again like a killed one, so the soak goes
on. At the end every fault is healed, every worker sends an end marker to each peer after
its last message and waits for the markers of every peer's final incarnation (so what
was in flight is drained), producers flush, the channel is closed and drained.

**Ledger rules** (DESIGN.md §4: between two live incarnations every message is
delivered exactly once and in order per sender, receiver and tag; if that becomes
impossible, operations raise on both sides). An *incarnation* is one run of a worker
process; it starts at its ``started`` event and, if killed, dies at the SIGKILL.

Point-to-point, a message is (sender incarnation, receiver address, seq):

1. *Duplicate*: received more than once (by any incarnations of the receiver).
2. *Out of order*: one receiver incarnation gets the messages of one sender
   incarnation in other than increasing ``seq`` order.
3. *Corrupt*: its content is not the one its ``seq`` says.
4. *Phantom*: received, but the sender (not killed) never recorded sending it.
5. *Silent loss*: its ``send`` returned, it was never received, and the loss was not
   announced on each side that survived it. The receiving side is the incarnation of
   the receiver that had started when the send returned: if it was killed later, it
   is excused (it took the message with it); otherwise it must have had a receive from
   the sender raise ``PeerLostError`` after it received the sender incarnation's last
   message before this one and no later than it received the first one after it.
   The sending side: if the sender incarnation was killed, it is excused; otherwise
   one of its operations with the receiver (a send, or a receive from it) must have
   raised ``PeerLostError`` after the send returned.
   A send that raised may or may not have delivered its message (no rule but 1-4).

Collectives: a call that returns must return exactly what its round must give
(*wrong result* otherwise); a call may raise (counted). Calls interrupted by an epoch
change or by the end of the run are not counted.

Channel, an item is (producer incarnation, number):

6. *Silent loss*: its ``put`` returned and no consumer ever got it, unless its
   producer incarnation was killed at most 10 s after the put (a put completes when
   the item is on its way; a dead producer cannot resend what was not acknowledged yet;
   counted apart as *lost with a killed producer*).
7. *Duplicate*: got more than once, unless every earlier recipient was hit by a fault
   (killed, stalled, its node's link down) during [got - 1 s, acknowledged + 1 s]: then
   the channel rightly gave it out again (docs/channel.md: an unacknowledged item of a
   consumer that died or was declared lost goes back; counted apart as *redelivered*).
   Channel order across consumers is a policy matter and is not checked.

Fault to error: for each kill, stall and link fault, the time from its start to the
first ``PeerLostError`` that a worker not hit by it saw on a send to or a receive from a
worker hit by it, within the fault and 5 s after (a collective's error names no member,
so it is not used); faults that caused none (short stalls and outages) are counted
apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import queue
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import rlinf  # noqa: E402
from tests.multinode import netns  # noqa: E402
from tests.multinode.agents import MiB, intact, payload  # noqa: E402

WORKERS = 6
CHANNEL = "chaos"
#: Seconds between two messages of one pair, two channel puts, two collective rounds.
PAIR_PERIOD = 0.25
PUT_PERIOD = 0.25
ROUND_PERIOD = 0.4
BIG_EVERY = 16
BIG_SIZES = (1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB)
SEND_TIMEOUT = 15.0
COLLECTIVE_TIMEOUT = 10.0
FINISH_TIMEOUT = 60.0
LOST = "PeerLostError"
#: A channel item put this long (s) or less before its producer was killed may die with it.
KILLED_PRODUCER_WINDOW = 10.0
KINDS = ("kill", "stall", "link_down", "rate_limit")


def address(k: int) -> str:
    return f"w:{k}"


def node_of(k: int) -> int:
    return k // 2


# =========================================================================== the worker


class _Collectives:
    """Numbered collective rounds of one worker, on the communicator of the current epoch."""

    def __init__(self, ctl, index: int) -> None:
        self.ctl = ctl
        self.index = index
        self.epoch = -1
        self.comm = None
        self.task: asyncio.Task | None = None

    async def switch(self, epoch: int) -> None:
        await self.close()
        self.epoch = epoch
        async with asyncio.timeout(60):
            self.comm = await rlinf.connect(f"c{epoch}:{self.index}").start()
        group = self.comm.group([f"c{epoch}:{k}" for k in range(WORKERS)])
        self.task = asyncio.create_task(self._rounds(group, epoch))

    async def _rounds(self, group, epoch: int) -> None:
        members = list(group.members)
        me = members.index(self.comm.address)
        r = 0
        while True:
            op = "all_reduce" if r % 2 == 0 else "broadcast"
            try:
                if op == "all_reduce":
                    got = await group.all_reduce(np.array([epoch, r, me + 1], dtype=np.float64), op="sum",
                                                 timeout=COLLECTIVE_TIMEOUT)
                    correct = got.tolist() == [WORKERS * epoch, WORKERS * r, WORKERS * (WORKERS + 1) / 2]
                else:
                    root = members[(r // 2) % WORKERS]
                    size = 2 * MiB if r % 8 == 3 else 64
                    obj = {"e": epoch, "r": r, "data": payload(r, size)} if root == self.comm.address else None
                    got = await group.broadcast(obj, root=root, timeout=COLLECTIVE_TIMEOUT)
                    correct = got["e"] == epoch and got["r"] == r and intact(r, got["data"], size)
                self.ctl.emit("c", e=epoch, r=r, op=op, ok=True, correct=bool(correct))
                failed = False
            except (rlinf.RlinfError, ValueError) as exc:
                self.ctl.emit("c", e=epoch, r=r, op=op, ok=False, err=type(exc).__name__)
                failed = True
            r += 1
            await asyncio.sleep(ROUND_PERIOD + (0.2 if failed else 0.0))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        if self.comm is not None:
            comm, self.comm = self.comm, None
            try:
                async with asyncio.timeout(15):
                    await comm.aclose()
            except (rlinf.RlinfError, TimeoutError):
                pass          # what it had sent is the old epoch's; its calls were cancelled


async def worker(comm, ctl, index: int, inc: int, epoch: int, finish_timeout: float = FINISH_TIMEOUT):
    """One chaos worker (run by ``tests/multinode/agent.py`` as ``benchmarks.chaos:worker``):
    the traffic of the module docstring, every operation reported as an event, until
    the ``finish`` command; ``epoch`` commands move the collectives to a new epoch."""
    me = comm.address
    peers = [address(k) for k in range(WORKERS) if k != index]
    rng = random.Random(index * 1000 + inc)
    stopping = asyncio.Event()
    ends: dict[str, set[int]] = {p: set() for p in peers}
    ended = asyncio.Event()
    final: dict[str, int] = {}

    try:
        ch = await comm.channel(CHANNEL, timeout=60)
    except rlinf.RlinfError as exc:                   # the channel process is gone: no channel traffic
        ctl.emit("nochannel", err=f"{type(exc).__name__}: {exc}")
        ch = None
    coll = _Collectives(ctl, index)
    await coll.switch(epoch)

    async def pause(seconds: float) -> None:
        try:
            await asyncio.wait_for(stopping.wait(), seconds * (0.5 + rng.random()))
        except TimeoutError:
            pass

    async def sender(peer: str) -> None:
        seq = 0
        while not stopping.is_set():
            size = BIG_SIZES[(seq // BIG_EVERY) % len(BIG_SIZES)] if seq % BIG_EVERY == BIG_EVERY - 1 else 0
            msg = {"src": me, "inc": inc, "seq": seq, "n": size, "data": payload(seq, size) if size else None}
            try:
                await comm.send(msg, peer, timeout=SEND_TIMEOUT)
                ctl.emit("s", dst=peer, seq=seq, ok=True)
            except rlinf.RlinfError as exc:
                ctl.emit("s", dst=peer, seq=seq, ok=False, err=type(exc).__name__)
                await pause(0.1)
            seq += 1
            await pause(PAIR_PERIOD)
        while True:                                   # the end marker, until it goes
            try:
                await comm.send({"src": me, "inc": inc, "end": seq}, peer, timeout=SEND_TIMEOUT)
                return
            except rlinf.RlinfError:
                await asyncio.sleep(0.2)

    async def receiver(peer: str) -> None:
        while True:
            try:
                obj = await comm.recv(peer, timeout=120)
            except rlinf.RlinfError as exc:
                ctl.emit("re", src=peer, err=type(exc).__name__)
                await asyncio.sleep(0.1)
                continue
            if "end" in obj:
                ends[peer].add(obj["inc"])
                ctl.emit("end", src=peer, src_inc=obj["inc"], last=obj["end"])
                if final and all(final[p] in ends[p] for p in peers):
                    ended.set()
                if final.get(peer) == obj["inc"]:
                    return                            # its final incarnation is done
                continue
            ok = obj["data"] is None or intact(obj["seq"], obj["data"], obj["n"])
            ctl.emit("r", src=peer, src_inc=obj["inc"], seq=obj["seq"], ok=ok)

    async def producer() -> None:
        if ch is None:
            return
        i = 0
        while not stopping.is_set():
            try:
                await ch.put({"src": me, "inc": inc, "i": i}, timeout=SEND_TIMEOUT)
                ctl.emit("p", i=i, ok=True)
            except rlinf.RlinfError as exc:
                ctl.emit("p", i=i, ok=False, err=type(exc).__name__)
            i += 1
            await pause(PUT_PERIOD)

    async def consumer() -> None:
        if ch is None:
            return
        while True:
            try:
                item = await ch.get(timeout=120, ack=True)
            except rlinf.EndOfChannel:
                ctl.emit("eoc")
                return
            except rlinf.RlinfError as exc:
                ctl.emit("ge", err=type(exc).__name__)
                await asyncio.sleep(0.1)
                continue
            ctl.emit("g", src=item["src"], src_inc=item["inc"], i=item["i"])
            ch.task_done(item)
            ctl.emit("a", src=item["src"], src_inc=item["inc"], i=item["i"])

    senders = [asyncio.create_task(sender(p)) for p in peers]
    receivers = [asyncio.create_task(receiver(p)) for p in peers]
    making = asyncio.create_task(producer())
    taking = asyncio.create_task(consumer())
    ctl.emit("ready", inc=inc)
    try:
        while (cmd := await ctl.next(timeout=3600))["command"] != "finish":
            if cmd["command"] == "epoch":
                await coll.switch(cmd["epoch"])
        final.update(cmd["incs"])
        await coll.close()
        stopping.set()
        await asyncio.wait([*senders, making], timeout=finish_timeout)
        try:
            if ch is not None:
                await ch.flush(timeout=finish_timeout)
            ctl.emit("flushed", err=None if ch is not None else "no channel")
        except rlinf.RlinfError as exc:
            ctl.emit("flushed", err=f"{type(exc).__name__}: {exc}")
        if all(final[p] in ends[p] for p in peers):
            ended.set()
        try:
            await asyncio.wait_for(ended.wait(), finish_timeout)
        except TimeoutError:
            pass
        ctl.emit("ends", missing=[p for p in peers if final[p] not in ends[p]])
        await asyncio.wait([taking], timeout=finish_timeout)
        ctl.emit("drained", done=taking.done())
    finally:
        for t in [*senders, *receivers, making, taking]:
            t.cancel()
        await asyncio.gather(*senders, *receivers, making, taking, return_exceptions=True)
        await coll.close()
    return {}


# =========================================================================== the run


@dataclass
class Incarnation:
    """One run of worker ``k``: its process and everything it reported."""

    k: int
    inc: int
    proc: netns.NodeProcess
    events: list[dict] = field(default_factory=list)
    started: float | None = None
    killed: float | None = None

    @property
    def addr(self) -> str:
        return address(self.k)

    def drain(self) -> None:
        while True:
            try:
                event = self.proc.events.get_nowait()
            except queue.Empty:
                return
            if event["kind"] == "started" and self.started is None:
                self.started = event["now"]
            self.events.append(event)

    def has(self, kind: str) -> bool:
        return any(e["kind"] == kind for e in self.events)

    def crashed(self) -> str | None:
        return next((e["error"] for e in self.events if e["kind"] == "error"), None)


@dataclass
class Fault:
    kind: str
    target: str                 # "w:3" or "node1"
    hit: list[int]              # worker indexes it hits
    start: float
    end: float = 0.0
    detail: str = ""


class Soak:
    """The run: processes, the injector, the finish; ``check()`` judges afterwards."""

    def __init__(self, nodes: netns.Nodes, seed: int, log=print, kinds: tuple[str, ...] = KINDS,
                 finish_timeout: float = FINISH_TIMEOUT) -> None:
        self.nodes = nodes
        self.kinds = kinds
        self.finish_timeout = finish_timeout
        self.rng = random.Random(seed)
        self.log = log
        self.t0 = time.monotonic()
        self.epoch = 0
        self.incs: list[list[Incarnation]] = [[] for _ in range(WORKERS)]
        self.faults: list[Fault] = []
        self.owner: netns.NodeProcess | None = None
        self.running = True             # while faults run, a worker that fails is started again
        self.failures: list[str] = []

    # -- processes --------------------------------------------------------------------------
    def current(self, k: int) -> Incarnation:
        return self.incs[k][-1]

    def all_incs(self) -> list[Incarnation]:
        return [i for runs in self.incs for i in runs]

    def drain(self) -> None:
        for i in self.all_incs():
            i.drain()
            if self.running and i.killed is None and (i.crashed() is not None or i.proc.returncode is not None):
                # a worker that fails while faults run is a finding: noted, and started again
                i.killed = time.monotonic()
                self.failures.append(f"{i.addr}#{i.inc} failed at {i.killed - self.t0:.1f} s: "
                                     f"{(i.crashed() or f'exit {i.proc.returncode}').rstrip()[-700:]}")
                self.log(f"  {i.killed - self.t0:7.1f} s  {i.addr}#{i.inc} FAILED (started again)")

    def revive(self) -> None:
        """Start again every worker whose current incarnation failed (not by a fault)."""
        dead = [k for k in range(WORKERS) if self.current(k).killed is not None]
        if dead:
            self.epoch += 1
            fresh = [self.start(k) for k in dead]
            for j in range(WORKERS):
                if j not in dead:
                    self.current(j).proc.tell("epoch", epoch=self.epoch)
            self.wait_for(fresh, "ready", timeout=120, strict=False)

    def drain_quietly(self) -> None:
        self.running = False
        self.drain()

    def start(self, k: int) -> Incarnation:
        inc = len(self.incs[k])
        proc = self.nodes.agent(node_of(k), "benchmarks.chaos:worker", address(k), index=k, inc=inc,
                                epoch=self.epoch, finish_timeout=self.finish_timeout)
        run = Incarnation(k, inc, proc)
        self.incs[k].append(run)
        return run

    def wait_for(self, runs: list[Incarnation], kind: str, timeout: float, strict: bool = True) -> None:
        """Until each of ``runs`` reported ``kind``; raises if one ends first or after
        ``timeout`` s (not ``strict``: returns then; the failure is recorded by drain)."""
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            waiting = [r for r in runs if not r.has(kind) and not (not strict and r.killed is not None)]
            if not waiting:
                return
            if not strict and time.monotonic() > deadline:
                self.log(f"  no {kind!r} from {[r.addr for r in waiting]} in {timeout} s")
                return
            for r in waiting:
                if r.proc.returncode is not None:
                    r.proc.wait(timeout=5)
                    self.drain()
                    if not r.has(kind):
                        raise RuntimeError(f"{r.addr} ended before {kind!r}\n{r.proc.describe()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {kind!r} from {[r.addr for r in waiting]} in {timeout} s\n"
                                   + "\n".join(r.proc.describe() for r in waiting))
            time.sleep(0.1)

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass (a fault's duration, or pacing), reading events meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.drain()
            time.sleep(min(left, 0.25))

    def begin(self, seconds: float) -> None:
        self.nodes.start_manager(0)
        self.owner = self.nodes.agent(0, "channel_owner", "owner:0", name=CHANNEL,
                                      serve_for=seconds + 10 * self.finish_timeout + 600)
        self.owner.expect("created", timeout=120)
        runs = [self.start(k) for k in range(WORKERS)]
        self.wait_for(runs, "ready", timeout=180)

    # -- faults -------------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        rng = self.rng
        now = time.monotonic
        if kind in ("kill", "stall"):
            k = rng.randrange(WORKERS)
            run = self.current(k)
            fault = Fault(kind, run.addr, [k], now())
            self.faults.append(fault)
            if kind == "kill":
                delay = rng.uniform(4, 6)
                run.proc.kill()
                run.killed = fault.start
                fault.detail = f"restart after {delay:.1f} s"
                self.sleep(delay)
                self.epoch += 1
                fresh = self.start(k)
                for j in range(WORKERS):
                    if j != k:
                        self.current(j).proc.tell("epoch", epoch=self.epoch)
                fault.end = now()
                self.wait_for([fresh], "ready", timeout=120, strict=False)
            else:
                seconds = rng.uniform(1, 6)
                fault.detail = f"{seconds:.1f} s"
                run.proc.stop()
                self.sleep(seconds)
                run.proc.cont()
                fault.end = now()
        else:
            node = rng.choice([1, 2])
            fault = Fault(kind, f"node{node}", [2 * node, 2 * node + 1], now())
            self.faults.append(fault)
            if kind == "link_down":
                seconds = rng.uniform(1, 10)
                fault.detail = f"{seconds:.1f} s"
                self.nodes.link_down(node)
                self.sleep(seconds)
                self.nodes.link_up(node)
            else:
                seconds = rng.uniform(5, 15)
                rate = rng.choice(["20mbit", "50mbit", "100mbit"])
                fault.detail = f"{rate} for {seconds:.1f} s"
                self.nodes.rate_limit(node, rate)
                self.sleep(seconds)
                self.nodes.unlimit(node)
            fault.end = now()
        self.log(f"  {fault.start - self.t0:7.1f} s  {kind:<10} {fault.target:<6} {fault.detail}")

    def run_faults(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        deadline = self.t0 + seconds
        while time.monotonic() < deadline:
            kinds = list(self.kinds)
            self.rng.shuffle(kinds)
            for kind in kinds:
                if time.monotonic() >= deadline:
                    break
                self.inject(kind)
                self.sleep(self.rng.uniform(1, 4))
                self.revive()
        self.t_end = time.monotonic()

    # -- the end --------------------------------------------------------------------------------
    def finish(self) -> None:
        self.running = False            # from here on, check() reports failures
        runs = [self.current(k) for k in range(WORKERS)]
        incs = {r.addr: r.inc for r in runs}
        for r in runs:
            r.proc.tell("finish", incs=incs)
        self.wait_for(runs, "flushed", timeout=self.finish_timeout + 60)
        self.owner.tell("close")
        self.wait_for(runs, "drained", timeout=2 * self.finish_timeout + 60)
        for r in runs:
            r.proc.wait(timeout=60)       # it closes its communicator ("closed", or an error)
        self.owner.tell("exit")
        try:
            self.owner.expect("closed", timeout=60)
        except AssertionError as exc:      # it failed (its error is the channel's, a finding)
            self.failures.append(f"the channel's owner failed: {str(exc)[-700:]}")
        self.drain()


# =========================================================================== the ledger


@dataclass
class Report:
    totals: dict
    problems: list[str]
    notes: list[str]
    latencies: list[float]

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def check(soak: Soak) -> Report:
    """Judge every event by the rules of the module docstring."""
    runs = soak.all_incs()
    by_key = {(r.addr, r.inc): r for r in runs}
    problems: list[str] = []
    notes: list[str] = []
    counts = collections.Counter()

    def incarnation_at(addr: str, t: float) -> Incarnation | None:
        started = [r for r in soak.incs[int(addr.split(":")[1])] if r.started is not None and r.started <= t]
        return started[-1] if started else None

    def lost_errors(run: Incarnation, peer: str) -> list[float]:
        return sorted(e["now"] for e in run.events if e.get("err") == LOST
                      and (e["kind"] == "s" and e["dst"] == peer or e["kind"] == "re" and e["src"] == peer))

    # -- point-to-point -----------------------------------------------------------------------
    sends: dict[tuple, dict] = {}
    for r in runs:
        for e in r.events:
            if e["kind"] == "s":
                sends[(r.addr, r.inc, e["dst"], e["seq"])] = e
                counts["messages"] += 1
                counts["sends raised"] += not e["ok"]
            elif e["kind"] == "re":
                counts["receives raised"] += 1
    received: dict[tuple, list] = collections.defaultdict(list)     # message -> [(receiver run, t)]
    streams: dict[tuple, list] = collections.defaultdict(list)      # (receiver run, src, src_inc) -> [(seq, t)]
    for r in runs:
        last: dict[tuple, int] = {}
        for e in r.events:
            if e["kind"] != "r":
                continue
            key = (e["src"], e["src_inc"], r.addr, e["seq"])
            received[key].append((r, e["now"]))
            streams[(r.addr, r.inc, e["src"], e["src_inc"])].append((e["seq"], e["now"]))
            counts["messages delivered"] += 1
            s = (e["src"], e["src_inc"])
            if s in last and e["seq"] < last[s]:
                counts["out of order"] += 1
                problems.append(f"out of order: {r.addr}#{r.inc} got {e['src']}#{e['src_inc']} seq {e['seq']} "
                                f"after {last[s]} (at {e['now'] - soak.t0:.2f} s)")
            last[s] = max(last.get(s, -1), e["seq"])
            if not e["ok"]:
                counts["corrupt"] += 1
                problems.append(f"corrupt: {key}")
            sender = by_key.get((e["src"], e["src_inc"]))
            if key not in sends and (sender is None or sender.killed is None):
                counts["phantom"] += 1
                problems.append(f"phantom: {key} received by {r.addr}#{r.inc}, never sent")
    for key, got in received.items():
        if len(got) > 1:
            counts["duplicates"] += len(got) - 1
            problems.append(f"duplicate: {key} received {len(got)} times, by "
                            f"{[f'{r.addr}#{r.inc} at {t - soak.t0:.2f} s' for r, t in got]}")
    for key, e in sends.items():
        if not e["ok"] or key in received:
            continue
        src, src_inc, dst, seq = key
        t_ok = e["now"]
        sender = by_key[(src, src_inc)]
        receiver = incarnation_at(dst, t_ok)
        sender_told = sender.killed is not None or any(t >= t_ok for t in lost_errors(sender, dst))
        if receiver is None or receiver.killed is not None:
            receiver_told = True
        else:
            stream = streams.get((receiver.addr, receiver.inc, src, src_inc), [])
            before = max((t for s, t in stream if s < seq), default=float("-inf"))
            after = min((t for s, t in stream if s > seq), default=float("inf"))
            receiver_told = any(before < t <= after for t in lost_errors(receiver, src))
        if sender_told and receiver_told:
            counts["losses announced"] += 1
            continue
        counts["silent losses"] += 1
        untold = " and ".join(side for side, told in (("sender", sender_told), ("receiver", receiver_told))
                              if not told)
        problems.append(f"silent loss: {src}#{src_inc} -> {dst} seq {seq} (send returned at {t_ok - soak.t0:.2f} s, "
                        f"receiver incarnation {receiver.inc if receiver else None}); no PeerLostError to the "
                        f"{untold}; faults near: {_near(soak, t_ok)}")

    # -- collectives ------------------------------------------------------------------------
    for r in runs:
        for e in r.events:
            if e["kind"] != "c":
                continue
            if not e["ok"] and e["err"] in ("CancelledError", "ClosedError"):
                continue
            counts["collective calls"] += 1
            if e["ok"] and not e["correct"]:
                counts["wrong collective results"] += 1
                problems.append(f"wrong result: {r.addr}#{r.inc} epoch {e['e']} round {e['r']} {e['op']}")
            counts["collective calls raised"] += not e["ok"]
    rounds = {(e["e"], e["r"]) for r in runs for e in r.events if e["kind"] == "c" and e["ok"]}
    counts["collective rounds completed"] = len(rounds)

    # -- channel ------------------------------------------------------------------------------
    puts: dict[tuple, dict] = {}
    gots: dict[tuple, list] = collections.defaultdict(list)     # item -> [(consumer run, got, acked)]
    for r in runs:
        acked: dict[tuple, float] = {}
        for e in r.events:
            if e["kind"] == "p":
                puts[(r.addr, r.inc, e["i"])] = e
                counts["channel puts"] += 1
                counts["channel puts raised"] += not e["ok"]
            elif e["kind"] == "ge":
                counts["channel gets raised"] += 1
            elif e["kind"] == "a":
                acked[(e["src"], e["src_inc"], e["i"])] = e["now"]
        for e in r.events:
            if e["kind"] == "g":
                key = (e["src"], e["src_inc"], e["i"])
                gots[key].append((r, e["now"], acked.get(key)))
                counts["channel items got"] += 1
    for key, e in puts.items():
        if e["ok"] and key not in gots:
            producer = by_key[key[:2]]
            if producer.killed is not None and producer.killed - e["now"] <= KILLED_PRODUCER_WINDOW:
                counts["channel items lost with a killed producer"] += 1
                continue
            counts["silent losses"] += 1
            counts["channel silent losses"] += 1
            problems.append(f"silent loss: channel item {key} (put returned at {e['now'] - soak.t0:.2f} s) "
                            f"never got; faults near: {_near(soak, e['now'])}")
    for key, got in gots.items():
        if len(got) < 2:
            continue
        excused = all(_faulted(soak, r, t_got - 1.0, (t_ack if t_ack is not None else float("inf")) + 1.0)
                      for r, t_got, t_ack in got[:-1])
        if excused:
            counts["channel items redelivered"] += len(got) - 1
        else:
            counts["duplicates"] += len(got) - 1
            counts["channel duplicates"] += len(got) - 1
            problems.append(f"duplicate: channel item {key} got by "
                            f"{[f'{r.addr}#{r.inc} at {t - soak.t0:.2f} s (acked {a})' for r, t, a in got]}")

    # -- the end, and crashes -------------------------------------------------------------------
    for failure in soak.failures:
        counts["crashed workers"] += 1
        problems.append(f"crashed while faults ran: {failure}")
    for r in runs:
        if any(e["kind"] == "nochannel" for e in r.events):
            problems.append(f"{r.addr}#{r.inc} could not open the channel: "
                            f"{next(e['err'] for e in r.events if e['kind'] == 'nochannel')}")
    for r in runs:
        for e in r.events:
            if e["kind"] == "ends" and e["missing"]:
                problems.append(f"{r.addr}#{r.inc}: no end marker from {e['missing']} (delivery did not resume)")
            if e["kind"] == "drained" and not e["done"]:
                problems.append(f"{r.addr}#{r.inc}: the channel never ended for its consumer")
            if e["kind"] == "flushed" and e["err"]:
                problems.append(f"{r.addr}#{r.inc}: its channel flush at the end failed: {e['err']}")
        why = r.crashed() if r.killed is None else None
        if why and why.rstrip().splitlines()[-1].startswith("rlinf.errors.CommTimeoutError: communicator"):
            counts["closes raised"] += 1      # its aclose() at the end: allowed (DESIGN.md §4), noted
            notes.append(f"{r.addr}#{r.inc}: {why.rstrip().splitlines()[-1]}")
        elif why:
            counts["crashed workers"] += 1
            problems.append(f"{r.addr}#{r.inc} crashed: {why[-500:]}")

    # -- fault to error -----------------------------------------------------------------------
    latencies = []
    for i, f in enumerate(soak.faults):
        counts[f"faults: {f.kind}"] += 1
        if f.kind == "rate_limit":
            continue
        hit = {address(k) for k in f.hit}
        # an error counts for this fault until the next fault on the same workers began
        # (a short stall of w:4 followed by a cut of its node's link: the cut's error)
        later = [g.start for g in soak.faults[i + 1:] if g.kind != "rate_limit" and set(g.hit) & set(f.hit)]
        until = min([f.end + 5, *later])
        first = None
        for r in runs:
            if r.addr in hit or r.killed is not None and r.killed < f.start:
                continue
            for e in r.events:
                if e.get("err") != LOST or not f.start <= e["now"] <= until:
                    continue
                if e["kind"] == "s" and e["dst"] in hit or e["kind"] == "re" and e["src"] in hit:
                    first = e["now"] if first is None else min(first, e["now"])
        if first is None:
            counts["faults that caused no error"] += 1
        else:
            latencies.append(first - f.start)
    counts["faults"] = len(soak.faults)
    return Report(dict(counts), problems, notes, latencies)


def _faulted(soak: Soak, run: Incarnation, start: float, end: float) -> bool:
    """Whether a kill, stall or link fault hit ``run`` during [start, end]."""
    if run.killed is not None and run.killed <= end:
        return True
    return any(f.kind != "rate_limit" and run.k in f.hit and f.start <= end and f.end >= start
               for f in soak.faults)


def _near(soak: Soak, t: float) -> str:
    near = [f"{f.kind} {f.target} at {f.start - soak.t0:.1f}-{f.end - soak.t0:.1f} s" for f in soak.faults
            if f.start - 15 <= t <= f.end + 15]
    return "; ".join(near) or "none"


def format_report(report: Report, seconds: float) -> str:
    c = collections.Counter(report.totals)
    lat = report.latencies
    lines = [
        f"chaos soak: {seconds / 60:.1f} min of faults, 6 workers on 3 nodes",
        f"  messages          {c['messages']} sent ({c['sends raised']} raised), {c['messages delivered']} delivered; "
        f"receives raised {c['receives raised']}; losses announced {c['losses announced']}",
        f"  collectives       {c['collective calls']} calls ({c['collective calls raised']} raised), "
        f"{c['collective rounds completed']} rounds completed, wrong results {c['wrong collective results']}",
        f"  channel items     {c['channel puts']} put ({c['channel puts raised']} raised), {c['channel items got']} got "
        f"(gets raised {c['channel gets raised']}), redelivered {c['channel items redelivered']}, "
        f"lost with a killed producer {c['channel items lost with a killed producer']}",
        f"  faults            {c['faults']}: " + ", ".join(f"{k} {c['faults: ' + k]}" for k in KINDS)
        + f"; {c['faults that caused no error']} caused no error",
        "  fault to error    " + (f"p50 {statistics.median(lat):.2f} s, p99 {_percentile(lat, 0.99):.2f} s, "
                                  f"max {max(lat):.2f} s over {len(lat)} faults" if lat else "no errors"),
        f"  silent losses     {c['silent losses']} (channel {c['channel silent losses']})",
        f"  duplicates        {c['duplicates']} (channel {c['channel duplicates']})",
        f"  out of order      {c['out of order']}",
        f"  corrupt {c['corrupt']}, phantom {c['phantom']}, crashed workers {c['crashed workers']}, "
        f"closes that raised {c['closes raised']}",
        f"  verdict           {'FAIL' if report.failed else 'PASS'}",
    ]
    if report.notes:
        lines.append(f"  notes ({len(report.notes)}):")
        lines += [f"    {n}" for n in report.notes[:20]]
    if report.problems:
        lines.append(f"  problems ({len(report.problems)}):")
        lines += [f"    {p}" for p in report.problems[:40]]
    return "\n".join(lines)


def dump(soak: Soak, path: str) -> None:
    """Every fault, event and process log (its last lines) as JSON lines, times relative
    to the first fault, for reading a failure: ``{"w": "w:3", "inc": 0, "kind": ..., "t": ...}``.
    Times keep microseconds: :func:`check` orders events by them (a loss must be told
    after the delivery before it), and milliseconds tie."""
    import json

    with open(path, "w") as f:
        for fault in soak.faults:
            f.write(json.dumps({"fault": fault.kind, "target": fault.target, "t": round(fault.start - soak.t0, 6),
                                "end": round(fault.end - soak.t0, 6), "detail": fault.detail}) + "\n")
        if soak.owner is not None:
            f.write(json.dumps({"w": "owner:0", "log": list(soak.owner.log)}) + "\n")
        for r in soak.all_incs():
            f.write(json.dumps({"w": r.addr, "inc": r.inc, "log": list(r.proc.log)}) + "\n")
            for e in r.events:
                f.write(json.dumps({"w": r.addr, "inc": r.inc, "t": round(e["now"] - soak.t0, 6),
                                    **{k: v for k, v in e.items() if k != "now"}}) + "\n")


def soak(nodes: netns.Nodes, seconds: float, seed: int, log=print, events: str | None = None,
         kinds: tuple[str, ...] = KINDS, finish_timeout: float = FINISH_TIMEOUT) -> Report:
    """The whole soak on ``nodes`` (3 emulated nodes, fresh): its report; ``events``: a
    file to write every event to (see :func:`dump`); ``kinds``: the faults to inject;
    ``finish_timeout``: how long each step of the end (sending the end markers,
    flushing, draining) may take before it counts as failed."""
    run = Soak(nodes, seed, log, kinds, finish_timeout)
    run.begin(seconds)
    log(f"faults for {seconds:.0f} s (seed {seed}):")
    try:
        run.run_faults(seconds)
        run.finish()
    finally:
        if events:
            run.drain_quietly()
            dump(run, events)
    return check(run)


def load(path: str) -> Soak:
    """A finished soak as :func:`dump` wrote it, for :func:`check` to judge again
    (``--check FILE``): kills are taken from the faults, times stay relative."""
    import json

    soak = Soak.__new__(Soak)
    soak.t0, soak.faults, soak.failures, soak.incs = 0.0, [], [], [[] for _ in range(WORKERS)]
    runs: dict[tuple, Incarnation] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "fault" in row:
                target = row["target"]
                hit = [int(target[2:])] if target.startswith("w:") else [2 * int(target[4:]), 2 * int(target[4:]) + 1]
                soak.faults.append(Fault(row["fault"], target, hit, row["t"], row["end"], row["detail"]))
            elif "kind" in row and row["w"].startswith("w:"):
                key = (row["w"], row["inc"])
                if key not in runs:
                    runs[key] = Incarnation(int(row["w"][2:]), row["inc"], None)
                row["now"] = row.pop("t")
                runs[key].events.append(row)
                if row["kind"] == "started":
                    runs[key].started = row["now"]
    for run in sorted(runs.values(), key=lambda r: (r.k, r.inc)):
        soak.incs[run.k].append(run)
    for fault in soak.faults:
        if fault.kind == "kill":
            victim = [r for r in soak.incs[fault.hit[0]] if r.started is not None and r.started <= fault.start]
            if victim:
                victim[-1].killed = fault.start
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the faults to inject, comma-separated (default: all, {','.join(KINDS)})")
    parser.add_argument("--events", metavar="FILE", help="write every event to FILE (JSON lines)")
    parser.add_argument("--check", metavar="FILE", help="judge the events of an earlier run (--events FILE) again")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {','.join(KINDS)}")
    if args.check:
        loaded = load(args.check)
        report = check(loaded)
        print(format_report(report, max((f.end for f in loaded.faults), default=0.0)))
        return 1 if report.failed else 0
    reason = netns.probe()
    if reason is not None:
        print(f"chaos soak skipped: {reason}")
        return 2
    print(f"chaos soak on {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    started = time.monotonic()
    with netns.Nodes(3) as nodes:
        report = soak(nodes, args.minutes * 60, args.seed, events=args.events, kinds=kinds)
    print(format_report(report, args.minutes * 60))
    print(f"  wall time         {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
