"""The manager keeps serving whatever a member sends it: a bad request changes nothing,
gets no reply, and never stops the registry or its liveness checks."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq
import zmq.asyncio

from rlinf.control import client as control
from rlinf.control.manager import Manager
from rlinf.info import MAX_REASON
from rlinf.control.security import ClusterKeys

pytestmark = pytest.mark.multiproc


class Member:
    """A raw control connection, as a (buggy or hostile) member holding the token has."""

    def __init__(self, manager: Manager, identity: bytes) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.routing_id = identity
        ClusterKeys(manager.token).secure_client(self.sock)
        self.sock.connect(manager.address)
        self._ids = itertools.count(1)
        self.seen: list[dict] = []     # every message received

    def send(self, op: str, **fields) -> int:
        request_id = next(self._ids)
        self.sock.send(control.pack({"op": op, "id": request_id, **fields}))
        return request_id

    async def reply(self, request_id: int) -> dict:
        """The reply to ``request_id``; earlier requests were handled before it (in order)."""
        async with asyncio.timeout(10):
            while True:
                message = control.unpack(await self.sock.recv())
                self.seen.append(message)
                if message.get("op") == "reply" and message.get("id") == request_id:
                    return message

    async def request(self, op: str, **fields) -> dict:
        return await self.reply(self.send(op, **fields))

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()


def _info(address: str, incarnation: str = "i1", **fields) -> dict:
    info = {"address": address, "incarnation": incarnation, "node_id": "n", "host": "h", "pid": 4242,
            "endpoints": {}, "devices": [], "transports": ["zmq"], "start_time": 0.0,
            "meta": {"machine": "another-machine"}}
    return {**info, **fields}


def _deep(levels: int) -> list:
    root = node = []
    for _ in range(levels):
        node.append([])
        node = node[0]
    return root


@pytest.fixture
async def manager():
    async with asyncio.timeout(30):
        m = await Manager("tcp://127.0.0.1:0", peer_timeout=30).start()
    try:
        yield m
    finally:
        async with asyncio.timeout(30):
            await m.close()


@pytest.fixture
def member(manager):
    members = []

    def make(identity: bytes) -> Member:
        members.append(Member(manager, identity))
        return members[-1]

    yield make
    for m in members:
        m.close()


@pytest.mark.parametrize("bad", [
    {"meta": 5},                         # killed the liveness checker on its next pass
    {"pid": "abc"},                      # the same, through process_gone(pid)
    {"meta": {"d": _deep(700)}, "start_time": 1.0},   # kept as sent, then no roster could be
                                                      # encoded: no replies at all
    {"start_time": "yesterday"},         # snapshot() (rlinf top) failed
    {"endpoints": {"tcp": 5}},
    {"devices": [{"kind": "cuda", "index": "0"}]},
])
async def test_a_bad_worker_record_is_refused_and_the_manager_keeps_serving(manager, member, bad):
    m = member(b"bad")
    first = m.send("register", info=_info("bad:0", **bad))
    roster = await m.request("roster")
    assert roster["roster"] == []
    good = await member(b"good").request("register", info=_info("good:0"))
    assert good["ok"] and [w["address"] for w in good["roster"]] == ["good:0"]
    assert (await m.request("snapshot"))["snapshot"]["workers"][0]["address"] == "good:0"
    assert not manager._checker.done()
    assert first not in [message.get("id") for message in m.seen]   # no reply to the bad one


async def test_a_bad_heartbeat_or_deregister_changes_nothing(manager, member):
    a, b = member(b"a"), member(b"b")
    assert (await a.request("register", info=_info("a:0")))["ok"]
    assert (await b.request("register", info=_info("b:0")))["ok"]
    version = manager.version
    b.send("deregister", address="b:0", incarnation="i1", bye_to=5)   # was half applied
    b.send("heartbeat", address="b:0", incarnation="i1", stats={"deep": _deep(600)})   # stats dropped
    b.send("heartbeat", address=["b:0"], incarnation="i1")
    roster = await b.request("roster")
    assert sorted(w["address"] for w in roster["roster"]) == ["a:0", "b:0"] and manager.version == version
    assert (await b.request("snapshot"))["snapshot"]["version"] == version
    assert (await b.request("deregister", address="b:0", incarnation="i1", bye_to=["a:0"]))["ok"]
    assert [w.address for w in manager.roster()] == ["a:0"]


async def test_a_deregistration_that_says_why_is_announced_as_failed(manager, member):
    """A worker whose code raised says so as it deregisters: "failed" with the summary
    (cut to MAX_REASON); a summary that is not a str is refused like any bad field."""
    a, b, c = member(b"a"), member(b"b"), member(b"c")
    for m, address in ((a, "a:0"), (b, "b:0"), (c, "c:0")):
        assert (await m.request("register", info=_info(address)))["ok"]
    version = manager.version
    b.send("deregister", address="b:0", incarnation="i1", failure=["RuntimeError: boom"])
    assert sorted(w["address"] for w in (await b.request("roster"))["roster"]) == ["a:0", "b:0", "c:0"]
    assert manager.version == version
    assert (await b.request("deregister", address="b:0", incarnation="i1", failure="RuntimeError: boom"))["ok"]
    assert (await c.request("deregister", address="c:0", incarnation="i1", failure="E: " + "x" * 1000))["ok"]
    await a.request("roster")                  # the events were pushed before this reply
    events = [(m["kind"], m["address"], m["reason"]) for m in a.seen if m.get("op") == "event"]
    assert events[-2:] == [("failed", "b:0", "RuntimeError: boom"), ("failed", "c:0", ("E: " + "x" * 1000)[:MAX_REASON])]
    snapshot = (await a.request("snapshot"))["snapshot"]
    assert snapshot["events"][-2] == {"kind": "failed", "address": "b:0", "reason": "RuntimeError: boom"}
    assert (await a.request("deregister", address="a:0", incarnation="i1"))["ok"]
    assert manager.events[-1].kind == "left" and manager.events[-1].reason == ""


async def test_waiting_lookups_are_kept_once_per_asker_and_dropped_with_it(manager, member):
    asker = member(b"asker")
    assert (await asker.request("register", info=_info("asker:0")))["ok"]
    for _ in range(50):            # a communicator retries a lookup while its send waits
        asker.send("lookup", address="ghost:0", wait=True)
    await asker.request("roster")
    assert len(manager._lookups["ghost:0"]) == 1
    assert (await asker.request("deregister", address="asker:0", incarnation="i1"))["ok"]
    assert "ghost:0" not in manager._lookups


def test_a_communicator_refuses_meta_the_manager_would_refuse():
    import rlinf

    for meta, error in (({"f": object()}, TypeError), ({"d": _deep(40)}, ValueError)):
        with pytest.raises(error, match="meta"):
            rlinf.Communicator("a:0", manager="tcp://127.0.0.1:1", token="t", meta=meta)


def test_processes_in_another_pid_namespace_are_not_judged_by_pid():
    """A worker in another PID namespace of this host (a container with the host's name
    and machine id) was judged by its pid in the manager's namespace: lost at once, or
    kept alive by an unrelated process. Its machine identity differs now."""
    import shutil
    import subprocess
    import sys

    from rlinf.control.client import machine_id

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          "from rlinf.control.client import machine_id; print(machine_id())"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {out.stderr.strip()[-200:]}")
    assert out.stdout.strip() and out.stdout.strip() != machine_id()


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_a_peer_timeout_that_is_not_positive_is_refused(bad):
    """``rlinf manager --peer-timeout 0`` (or less) was taken: every remote worker would be
    declared lost at once."""
    with pytest.raises(ValueError, match="peer_timeout"):
        Manager("tcp://127.0.0.1:0", peer_timeout=bad)
