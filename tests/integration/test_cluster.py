"""The local launcher: spawn / call / join / kill, failures, and cleanup after crashes.

Worker targets are defined in this module (module level: the spawn context imports it).
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import rlinf
from rlinf.launch.base import wait_gone
from rlinf.info import socket_dirs

from .wait import reaped

pytestmark = pytest.mark.multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- worker targets ------------------------------------------------------------------
class Counter(rlinf.Worker):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    async def setup(self) -> None:
        self.value += 100 * self.rank

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    async def where(self) -> tuple[str, int, int, int]:
        return self.address, self.rank, self.world_size, os.getpid()

    async def hang(self) -> None:
        await asyncio.Event().wait()

    def unpicklable(self):
        return lambda: None

    async def fail_or_wait(self) -> None:
        """Rank 0 fails; the others wait for a message from it, which never comes."""
        if self.rank == 0:
            raise RuntimeError("rank 0 failed")
        await self.comm.recv(f"{self.address.split(':')[0]}:0")

    def unloadable(self):
        return Unloadable()

    async def share(self, nbytes: int = 1 << 20) -> list:
        """Send a large array to the driver, who keeps it: our slot stays in use."""
        await self.comm.send(np.ones(nbytes // 8), "driver:0", tag=5, timeout=30)
        return os.getpid()


class Runner(rlinf.Worker):
    """A Worker with run(): join() returns what run() returns; calls work meanwhile."""

    async def setup(self) -> None:
        self.release = asyncio.Event()

    def go(self) -> str:
        self.release.set()
        return "released"

    async def run(self) -> str:
        await self.release.wait()
        return f"ran {self.address}"


class BadSetup(rlinf.Worker):
    async def setup(self) -> None:
        if self.rank == 1:
            raise RuntimeError("setup exploded on rank 1")


async def send_then_raise(comm, n: int):
    """Send 0..n-1 to the driver, then raise (its messages are still delivered)."""
    for i in range(n):
        await comm.send(i, "driver:0", timeout=60)
    raise ValueError("bad batch 7\nthe rest of the message, on more lines")


class RunRaises(rlinf.Worker):
    async def run(self) -> None:
        raise KeyError("policy")


async def returns(comm, value):
    return {"address": comm.address, "value": value, "flag": os.environ.get("MY_FLAG"),
            "node": comm.info.node_id}


def _refuse(why: str):
    raise RuntimeError(why)


class Unloadable:
    """Pickles anywhere, unpickles nowhere (say, a class the other side cannot import)."""

    def __reduce__(self):
        return _refuse, ("no unpickling this",)


async def returns_unloadable(comm):
    return Unloadable()


async def fail_after_others_wait(comm):
    """Rank 0 raises once the other ranks told it they are blocked waiting for it."""
    rank = int(comm.address.split(":")[1])
    if rank == 0:
        for _ in range(2):
            await comm.recv_any(tag=1, timeout=60)
        raise ValueError("rank zero gave up")
    await comm.send("waiting", comm.address.split(":")[0] + ":0", tag=1, timeout=60)
    await asyncio.Event().wait()   # never returns: must be killed, not left hanging


async def send_weights(comm, versions: int):
    """Send ``versions`` nested weight sets to the driver, then one with a wrong shape."""
    for v in range(versions):
        await comm.send({"w": np.full((256, 512), float(v), dtype=np.float32),
                         "b": [np.full(3, v, dtype=np.int32)], "step": v}, "driver:0", timeout=30)
    await comm.send({"w": np.zeros((2, 2), dtype=np.float32), "b": [np.zeros(3, dtype=np.int32)], "step": -1},
                    "driver:0", timeout=30)
    return versions


async def raises(comm):
    raise RuntimeError("failing on purpose")


async def idle(comm):
    await asyncio.Event().wait()


async def ignores_cancel(comm):
    """Swallows the cancellation that "stop" and SIGTERM cause: needs SIGKILL."""
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            continue


async def blocks_loop(comm, driver: str):
    await comm.send("blocking", driver, tag=2, timeout=60)
    await comm.recv(driver, tag=3, timeout=60)   # our send has left once the ack is here
    threading.Event().wait()   # a stuck C call, never to return: the loop never runs again


def not_async(comm):
    return 1


def _orphan_driver(mode: str) -> None:
    """Run by a subprocess: start a worker, print what it is, then wait to be killed
    (``mode="kill"``) or return without closing the cluster (``"forget"``)."""
    async def main():
        cluster = await rlinf.Cluster().start()
        group = await cluster.spawn(Counter, "orphan", 1)
        comm = await cluster.connect("odriver:0").start()
        infos = await _infos(comm, group.addresses)
        print(json.dumps({"pids": group.pids, "ipc": [d for i in infos for d in _socket_dirs(i)],
                          "own": _socket_dirs(comm.info)}), flush=True)
        if mode == "kill":
            await asyncio.Event().wait()

    asyncio.run(main())


# -- helpers -------------------------------------------------------------------------
def _socket_dirs(info) -> list[str]:
    """Every directory of the worker's socket files (ipc:// and the stream's unix://)."""
    dirs = socket_dirs(info)
    assert len(dirs) == 2, info.endpoints          # both kinds: the checks below cover both
    return dirs


async def _infos(comm, addresses: list[str]):
    """WorkerInfo of each address (looked up through the manager; they are registered)."""
    await asyncio.gather(*(comm.send(None, a, tag=99) for a in addresses))   # resolves them
    roster = {p.address: p for p in await comm.peers()}
    return [roster[a] for a in addresses]


def _shm_of(pid: int) -> list[str]:
    """Shared-memory files of ``pid`` (the shm transport names them rlinf-<pid>-...)."""
    try:
        return [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"rlinf-{pid}-")]
    except FileNotFoundError:
        return []


# -- tests ---------------------------------------------------------------------------
async def test_spawn_call_join_round_trip(launcher, cluster):
    async with asyncio.timeout(90):
        group = await cluster.spawn(Counter, "ctr", 3, kwargs={"start": 1}, launcher=launcher)
        assert group.addresses == ["ctr:0", "ctr:1", "ctr:2"] and len(group) == 3
        assert "alive=3" in repr(group)
        assert await group.call("add", 1) == [2, 102, 202]
        assert await group.call("add", k=10, ranks=[2, 0]) == [212, 12]      # in the order asked
        where = await group.call("where")
        assert [w[:3] for w in where] == [("ctr:0", 0, 3), ("ctr:1", 1, 3), ("ctr:2", 2, 3)]
        assert [w[3] for w in where] == group.pids
        functions = await cluster.spawn(returns, "fn", 1, args=([1, 2],), launcher=launcher,
                                        env={"RLINF_NODE_ID": "node-x", "MY_FLAG": "on"})
        assert "MY_FLAG" not in os.environ                      # the driver's env is untouched
        runners = await cluster.spawn(Runner, "run", 2, launcher=launcher)
        assert await runners.call("go", ranks=[1]) == ["released"]
        assert await runners.join(ranks=[1]) == ["ran run:1"]
        await runners.call("go", ranks=[0])
        assert await runners.join() == ["ran run:0", "ran run:1"]

        with pytest.raises(TypeError, match="runs a function"):
            await functions.call("add", 1)
        with pytest.raises(ValueError, match="private"):
            await group.call("_secret")
        with pytest.raises(ValueError, match="not in 0..2"):
            await group.call("add", 1, ranks=[3])
        with pytest.raises(rlinf.WorkerFailedError, match="AttributeError") as info:
            await group.call("no_such_method")
        assert info.value.address == "ctr:0" and "no_such_method" in info.value.remote_traceback
        with pytest.raises(rlinf.WorkerFailedError, match="pickle"):
            await group.call("unpicklable", ranks=[1])
        with pytest.raises(rlinf.CommTimeoutError):
            await group.call("hang", timeout=0.3)
        # values one side cannot unpickle fail their call (they were lost: it waited forever)
        with pytest.raises(rlinf.WorkerFailedError, match="returned by the call on ctr:0 cannot be unpickled"):
            await group.call("unloadable", ranks=[0], timeout=20)
        with pytest.raises(rlinf.WorkerFailedError, match=r"arguments of add\(\) cannot be unpickled"):
            await group.call("add", Unloadable(), ranks=[2], timeout=20)
        with pytest.raises(TypeError, match=r"arguments of add\(\) cannot be pickled"):
            await group.call("add", lambda: None)                           # nothing is sent
        assert await group.call("add", 0) == [12, 102, 212]                 # still serving
        unloadables = await cluster.spawn(returns_unloadable, "unl", 1, launcher=launcher)
        with pytest.raises(rlinf.WorkerFailedError, match="returned by the worker unl:0 cannot be unpickled"):
            await unloadables.join(timeout=20)

        assert await functions.join() == [{"address": "fn:0", "value": [1, 2], "flag": "on", "node": "node-x"}]
        assert await group.join() == [None, None, None]                       # told to finish
        assert all(reaped(pid) for pid in group.pids + functions.pids + runners.pids)
        assert "alive=0" in repr(group)


async def test_kill_acts_without_await(cluster, driver):
    """``group.kill(rank)`` called as a plain function (the ``await`` forgotten) still
    kills: the signal goes out at call time; the task it returns only reaps."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(idle, "forgot", 2)
        pid = group.pids[0]
        reaping = group.kill(0)                                # no await
        assert isinstance(reaping, asyncio.Task)
        # the worker idles forever: only a kill makes it exit, and join then reports it
        with pytest.raises(rlinf.WorkerFailedError, match=r"forgot:0 .*killed by group.kill\(\)"):
            await group.join(ranks=[0], timeout=20)
        assert reaped(pid)
        await reaping                                          # awaiting it later is fine too
        assert reaping.result() is None
        await group.kill(1)                                    # the usual spelling
        assert "alive=0" in repr(group)


async def test_kill_one_rank(launcher, cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(Counter, "k", 3, launcher=launcher)
        infos = await _infos(driver, group.addresses)
        pid = group.pids[1]
        await group.call("share", ranks=[1])                   # k:1 now owns shared memory
        held = await driver.recv("k:1", tag=5)
        segments = _shm_of(pid)
        assert segments, "expected the 1 MiB message to travel through shared memory"
        await group.kill(1)
        assert reaped(pid)
        assert not any(map(os.path.exists, _socket_dirs(infos[1])))   # removed by the driver...
        assert [s for s in segments if os.path.exists(s)] == []   # ...and so is its shm
        del held
        with pytest.raises(rlinf.WorkerFailedError, match=r"k:1 .*killed by group.kill\(\)"):
            await group.call("add", 1, ranks=[1])
        with pytest.raises(rlinf.PeerLostError):                # its peers see it lost
            await driver.recv("k:1", timeout=10)
        assert await group.call("add", 1, ranks=[0, 2]) == [1, 201]
        assert await group.join(ranks=[0, 2]) == [None, None]
        with pytest.raises(rlinf.WorkerFailedError, match="killed"):
            await group.join()


async def test_finished_workers_leave_no_descriptors_behind(cluster):
    """A reaped worker's process object kept its two pipe fds until the cluster closed:
    a driver that keeps spawning ran out of descriptors."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async with asyncio.timeout(90):
        counts = []
        for i in range(3):
            group = await cluster.spawn(returns, f"fd{i}", 1, args=(i,))
            assert [r["value"] for r in await group.join()] == [i]
            counts.append(open_fds())
        assert counts[-1] <= counts[0], counts


async def test_finished_groups_and_closed_driver_comms_are_not_kept(cluster):
    """The cluster kept every group it ever spawned, and with it their results, and
    every driver communicator: a driver that keeps spawning short-lived workers grew
    without bound."""
    import gc
    import weakref

    async with asyncio.timeout(90):
        group = await cluster.spawn(returns, "short", 1, args=(1,))
        assert [r["value"] for r in await group.join()] == [1]
        async with cluster.connect("helper:0") as comm:
            pass
        assert comm.closed
        gone = [weakref.ref(group), weakref.ref(comm)]
        del group, comm
        live = await cluster.spawn(idle, "live", 1)          # the cluster forgets at its next spawn
        async with cluster.connect("helper:1"):
            gc.collect()
            assert [ref() for ref in gone] == [None, None]
        await live.kill()


async def test_a_group_still_launching_is_kept_with_its_resources(cluster):
    """A spawn that forgot finished groups also took one still launching, with no rank
    yet, for finished: with Ray, its placement group was removed under it."""
    entered, gate, released = asyncio.Event(), asyncio.Event(), []

    class Gated:   # a launcher that takes a resource, then waits before starting ranks
        async def launch(self, spec, group):
            group._on_release(lambda: released.append(spec.name))
            entered.set()
            await gate.wait()
            await cluster._local.launch(spec, group)

    async with asyncio.timeout(90):
        slow = asyncio.create_task(cluster.spawn(idle, "slow", 1, launcher=Gated()))
        await entered.wait()
        other = await cluster.spawn(returns, "other", 1, args=(0,))   # forgets finished groups
        assert released == []
        gate.set()
        group = await slow
        await other.join()
        await group.kill()
        assert released == ["slow"]


async def test_a_running_group_name_or_open_driver_address_is_refused(cluster, driver):
    """A second group under a running group's name was accepted: the two workers took
    each other's address in turn, twice a second, for good."""
    async with asyncio.timeout(60):
        first = await cluster.spawn(idle, "dup", 1)
        with pytest.raises(ValueError, match="still running"):
            await cluster.spawn(idle, "dup", 1)
        with pytest.raises(ValueError, match="already has a communicator"):
            cluster.connect("driver:0")
        await first.kill()
        again = await cluster.spawn(returns, "dup", 1, args=(2,))   # a finished group's name is free
        assert [r["value"] for r in await again.join()] == [2]


async def test_an_incarnation_replaced_while_taken_for_lost_closes_instead_of_evicting(cluster):
    """A worker the manager took for lost (a long stall) came back and re-registered over
    the incarnation that replaced it; that one did the same: they evicted each other for
    good. Now the replaced one is refused, and closes with a ClosedError that says so."""
    manager = cluster.manager
    async with asyncio.timeout(60):
        async with cluster.connect("twin:0") as old:
            waiting = asyncio.ensure_future(old.recv("nobody:0"))
            manager._remove(manager._roster["twin:0"], "lost")     # as after a stall
            async with rlinf.Communicator("twin:0", manager=cluster.manager_address, token=cluster.token) as new:
                with pytest.raises(rlinf.ClosedError, match="replaced"):
                    await waiting
                version = manager.version
                assert manager._roster["twin:0"].incarnation == new.incarnation
                await new.peers()          # a request round trip later, nothing has changed
                assert manager.version == version and not new.closed and old.closed


class PlainSetup(rlinf.Worker):
    def setup(self) -> None:      # not async: fine, as run() and calls may be plain too
        self.ready = "set up"

    def state(self) -> str:
        return self.ready


async def test_a_plain_setup_works_and_unpicklable_arguments_are_a_type_error(cluster):
    async with asyncio.timeout(60):
        group = await cluster.spawn(PlainSetup, "plain", 1)
        assert await group.call("state") == ["set up"]
        await group.join()
        with pytest.raises(rlinf.WorkerFailedError, match="after it returned"):   # not "without returning"
            await group.call("state")
        with pytest.raises(TypeError, match="cannot be sent"):
            await cluster.spawn(returns, "nope", 1, kwargs={"value": lambda: 1})


async def test_workers_killed_before_they_registered_leave_no_socket_directories():
    """Workers make their socket directories before they register, and reported them
    only after: workers killed by ready_timeout while registering left them in /tmp."""
    import glob
    import socket

    def orphans() -> set[str]:     # socket directories of processes that are gone
        from rlinf.util.procs import process_gone

        return {d for d in glob.glob("/tmp/rlinf-[0-9]*") if process_gone(int(os.path.basename(d).split("-")[1]))}

    before = orphans()
    silent = socket.socket()           # a "manager" that accepts and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        async with asyncio.timeout(60):
            async with rlinf.Cluster(f"tcp://127.0.0.1:{silent.getsockname()[1]}", token="t") as cluster:
                with pytest.raises(rlinf.CommTimeoutError):
                    await cluster.spawn(returns, "w", 2, args=(0,), ready_timeout=4)
    finally:
        silent.close()
    assert orphans() <= before


def test_a_target_from_a_program_without_a_file_is_a_type_error():
    """A target defined in a script read from stdin (or python -c, or a notebook) failed
    in the child's start-up, before rlinf ran: a bare WorkerFailedError, no traceback."""
    script = (
        "import asyncio, rlinf\n"
        "async def fn(comm):\n    return 1\n"
        "async def main():\n"
        "    async with rlinf.Cluster() as cluster:\n"
        "        try:\n            await cluster.spawn(fn, 'w', 1, ready_timeout=30)\n"
        "        except TypeError as exc:\n            print('TypeError:', exc)\n"
        "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert "TypeError:" in out.stdout and "has no file" in out.stdout, (out.stdout, out.stderr[-2000:])


async def test_a_failing_call_raises_while_another_rank_waits_on_it(cluster):
    """call() waited for every rank's call, and one waiting on the failed rank never ends."""
    async with asyncio.timeout(60):
        group = await cluster.spawn(Counter, "fw", 2)
        with pytest.raises(rlinf.WorkerFailedError, match="rank 0 failed"):
            await group.call("fail_or_wait")
        await group.kill()


async def test_recv_into_between_processes(launcher, cluster, driver):
    async with asyncio.timeout(60):
        group = await cluster.spawn(send_weights, "trainer", 1, args=(3,), launcher=launcher)
        target = {"w": np.empty((256, 512), dtype=np.float32), "b": [np.empty(3, dtype=np.int32)], "step": None}
        pointers = (target["w"].ctypes.data, target["b"][0].ctypes.data)
        for v in range(3):
            assert await driver.recv_into(target, "trainer:0") is target
            assert (target["w"] == v).all() and target["b"][0].tolist() == [v] * 3   # 512 KiB
            assert target["step"] is None                       # plain values: placeholders
        assert (target["w"].ctypes.data, target["b"][0].ctypes.data) == pointers   # in place
        with pytest.raises(ValueError, match=r"\$\['w'\].*\[256, 512\].*\[2, 2\]"):
            await driver.recv_into(target, "trainer:0")
        assert (target["w"] == 2).all()                         # left untouched
        last = await driver.recv("trainer:0", timeout=10)         # and the message is still next
        assert last["step"] == -1 and last["w"].shape == (2, 2)
        assert await group.join() == [3]


async def test_failure_raises_with_traceback_and_kills_the_rest(launcher, cluster):
    async with asyncio.timeout(60):
        group = await cluster.spawn(fail_after_others_wait, "f", 3, launcher=launcher)
        t0 = time.monotonic()
        with pytest.raises(rlinf.WorkerFailedError) as info:
            await group.join()
        assert info.value.address == "f:0"
        assert "rank zero gave up" in str(info.value) and "fail_after_others_wait" in info.value.remote_traceback
        assert time.monotonic() - t0 < 20
        assert all(reaped(pid) for pid in group.pids)            # the waiting ranks were killed

        with pytest.raises(rlinf.WorkerFailedError, match="setup exploded on rank 1") as info:
            await cluster.spawn(BadSetup, "bad", 2, launcher=launcher)
        assert info.value.address == "bad:1"
        assert all(reaped(pid) for pid in cluster._groups[-1].pids)   # rank 0 did not linger


async def _departures(events, addresses: set[str]) -> dict[str, rlinf.MembershipEvent]:
    """The departure event (any kind but "joined") of each of ``addresses``."""
    seen: dict[str, rlinf.MembershipEvent] = {}
    async for event in events:
        if event.address in addresses and event.kind != "joined":
            seen[event.address] = event
            if len(seen) == len(addresses):
                return seen
    raise AssertionError(f"events ended; seen {seen}")


async def test_peers_tell_a_worker_that_raised_from_one_that_returned_or_was_killed(launcher, cluster, driver):
    """Issue 28: a worker that raised showed as "left", like one that finished. Now its
    peers see "failed" with the exception's one-line summary; one that returned "left";
    one killed -9 "lost". One that failed still closed cleanly: what it sent first is
    delivered, then receives from it raise (it left)."""
    async with asyncio.timeout(90):
        events = driver.events()
        names = {"raiser:0", "runner:0", "returner:0", "victim:0"}
        departures = asyncio.ensure_future(_departures(events, names))
        await asyncio.sleep(0)                  # the iterator is subscribed from here on
        raiser = await cluster.spawn(send_then_raise, "raiser", 1, args=(5,), launcher=launcher)
        runner = await cluster.spawn(RunRaises, "runner", 1, launcher=launcher)
        returner = await cluster.spawn(returns, "returner", 1, args=(7,), launcher=launcher)
        victim = await cluster.spawn(Counter, "victim", 1, launcher=launcher)
        os.kill(victim.pids[0], signal.SIGKILL)
        assert [await driver.recv("raiser:0", timeout=30) for _ in range(5)] == list(range(5))
        with pytest.raises(rlinf.PeerLostError, match="raiser:0 left"):
            await driver.recv("raiser:0", timeout=30)
        seen = await departures
        assert {a: (e.kind, e.reason) for a, e in seen.items()} == {
            "raiser:0": ("failed", "ValueError: bad batch 7"),
            "runner:0": ("failed", "KeyError: 'policy'"),
            "returner:0": ("left", ""),
            "victim:0": ("lost", ""),
        }
        with pytest.raises(rlinf.WorkerFailedError, match="bad batch 7"):
            await raiser.join()
        with pytest.raises(rlinf.WorkerFailedError, match="policy"):
            await runner.join()
        assert (await returner.join())[0]["value"] == 7
        await events.aclose()


async def test_bad_arguments(launcher, cluster):
    async with asyncio.timeout(30):
        async def local(comm):
            return None

        with pytest.raises(TypeError, match="module level"):
            await cluster.spawn(local, "x", launcher=launcher)
        with pytest.raises(TypeError, match="async def"):
            await cluster.spawn(not_async, "x", launcher=launcher)
        with pytest.raises(ValueError, match="group name"):
            await cluster.spawn(idle, "a:b", launcher=launcher)
        with pytest.raises(ValueError, match="positive"):
            await cluster.spawn(idle, "x", 0, launcher=launcher)
        with pytest.raises(TypeError, match="env"):
            await cluster.spawn(idle, "x", env={"A": 1}, launcher=launcher)
    assert cluster._groups == []


async def test_close_after_crashes_leaves_nothing_behind(launcher):
    """SIGKILLed, failed, stuck and stubborn workers: close() removes every trace."""
    async with asyncio.timeout(90):
        cluster = await rlinf.Cluster(stop_timeout=1.0).start()
        try:
            driver = await cluster.connect("driver:0").start()
            killed = await cluster.spawn(Counter, "killed", 1, launcher=launcher)
            counters = await cluster.spawn(Counter, "ctr", 1, launcher=launcher)
            stubborn = await cluster.spawn(ignores_cancel, "stubborn", 1, launcher=launcher)
            stuck = await cluster.spawn(blocks_loop, "stuck", 1, args=("driver:0",), launcher=launcher)
            failing = await cluster.spawn(raises, "fail", 1, launcher=launcher)
            groups = [killed, counters, stubborn, stuck, failing]
            pids = [pid for g in groups for pid in g.pids]
            await driver.recv("stuck:0", tag=2)
            await driver.send("ack", "stuck:0", tag=3)
            dirs = [d for g in groups[:4] for i in await _infos(driver, g.addresses) for d in _socket_dirs(i)]
            dirs += _socket_dirs(driver.info)
            await killed.call("share")
            await counters.call("share")
            held = [await driver.recv(a, tag=5) for a in ("killed:0", "ctr:0")]
            segments = _shm_of(killed.pids[0]) + _shm_of(counters.pids[0])
            assert len(segments) >= 2
            os.kill(killed.pids[0], signal.SIGKILL)             # as the OOM killer would
            with pytest.raises(rlinf.WorkerFailedError, match="failing on purpose"):
                await failing.join()
        finally:
            t0 = time.monotonic()
            await cluster.aclose()
            closing = time.monotonic() - t0
        del held
        assert closing < 15
        assert [pid for pid in pids if not reaped(pid)] == []
        assert [d for d in dirs if os.path.exists(d)] == []
        assert [s for s in segments if os.path.exists(s)] == []
        await cluster.aclose()                                  # idempotent
        with pytest.raises(rlinf.ClosedError):
            await cluster.spawn(idle, "late")


@pytest.mark.parametrize("mode", ["kill", "forget"])
def test_orphaned_workers_exit_and_clean_up(mode):
    """The driver dies (SIGKILL) or exits without closing its cluster: its workers stop
    (they notice the pipe closing, or the driver's exit hook kills them) and clean up."""
    driver = subprocess.Popen(
        [sys.executable, "-c", f"from tests.integration.test_cluster import _orphan_driver; _orphan_driver({mode!r})"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([driver.stdout], [], [], 60)[0]
        assert ready, "the driver did not start its workers in time"
        started = json.loads(driver.stdout.readline())
        if mode == "kill":
            driver.kill()
        assert driver.wait(30) in (0, -signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait(10)
        driver.stdout.close()
    for pid in started["pids"]:
        assert wait_gone(pid, 30), f"worker {pid} outlived its driver"
    assert [d for d in started["ipc"] if os.path.exists(d)] == []
    if mode == "forget":     # the driver's own socket directories went with its exit hook
        assert [d for d in started["own"] if os.path.exists(d)] == []
    for d in started["own"]:     # a SIGKILLed driver cannot remove its own: this test does
        shutil.rmtree(d, ignore_errors=True)
