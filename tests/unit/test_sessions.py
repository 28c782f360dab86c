"""The core's parts as promised: a peer session lives from its first message to one
close (peer gone, peer restarted, our close), its pending sends fail with
PeerLostError when the peer is lost, a restarted peer gets a new session; and the
SYSTEM tags the core uses cannot be taken over. No sockets: links record frame sets."""

from __future__ import annotations

import asyncio

import pytest

import rlinf
from rlinf.codec import Codec
from rlinf.core import routing, wire
from rlinf.core._gpu_paths import GpuPaths
from rlinf.core._mailbox import Mailbox
from rlinf.core._membership import Membership
from rlinf.core._peer import PeerSessions
from rlinf.core._send import SendPath
from rlinf.core.interface import SYSTEM_TAGS
from rlinf.core.stats import Counters
from rlinf.info import MAX_REASON, MembershipEvent, WorkerInfo, failure_summary
from rlinf.util.bounded import Recent

from ..recording_link import RecordingLink

ME = WorkerInfo("me:0", "inc-me", "node-a", endpoints={"tcp": "tcp://127.0.0.1:1"})


def _peer(incarnation: str) -> WorkerInfo:
    return WorkerInfo("peer:0", incarnation, "node-b", endpoints={"tcp": f"tcp://127.0.0.1:2/{incarnation}"})


class _Zmq:
    """Dials by handing out recording links (one per connection, by endpoint)."""

    def __init__(self) -> None:
        self.links: dict[str, RecordingLink] = {}

    def connect_now(self, endpoint: str, *, identity: bytes) -> RecordingLink:
        link = self.links[endpoint] = RecordingLink()
        return link


class _Control:
    """A manager that knows nobody yet: lookups wait until cancelled."""

    async def lookup(self, address: str, *, wait: bool, timeout: float | None) -> WorkerInfo | None:
        await asyncio.Event().wait()


class _Core:
    """The parts of one communicator, wired as the facade wires them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        config = routing.RoutingConfig()
        self.roster: dict[str, WorkerInfo] = {}
        self.mailbox = Mailbox()
        self.zmq = _Zmq()
        counters = Counters(ME.address)
        gpu = GpuPaths(ME.address, self.roster, config, lambda: None)
        self.sessions = PeerSessions(ME.address, ME.incarnation, wire.HeaderPacker(ME.address, ME.incarnation),
                                     counters, config, self.roster, self.mailbox, gpu)
        self.sessions.start(loop, ME, zmq=self.zmq, stream=None, bulk=None, control_client=_Control(), shm=None,
                            pull=None)
        self.send = SendPath(ME.address, ME.incarnation, Codec(), self.sessions, self.mailbox, gpu, config,
                             check_open=lambda: None)
        self.send.start(loop, None, None)
        self.membership = Membership(ME.address, self.roster, Recent(), self.mailbox, self.sessions,
                                     closed=lambda: False)
        self.membership.start(loop)

    def queue(self, obj: object) -> asyncio.Future:
        return self.send.enqueue(obj, "peer:0", 0, wire.USER, need_future=True)


def _count_closes(session) -> list:
    """The errors its queue is failed with from now on (a close fails it once)."""
    failures = []
    fail = session.outbox.fail

    def counted(error: BaseException) -> None:
        failures.append(error)
        fail(error)

    session.outbox.fail = counted
    return failures


async def test_a_session_is_opened_on_first_use_and_dialled_once_the_peer_is_known():
    core = _Core(asyncio.get_running_loop())
    assert core.sessions.get("peer:0") is None          # nothing is dialled before a message
    core.roster["peer:0"] = _peer("inc1")
    sent = core.queue("hello")
    session = core.sessions.get("peer:0")
    assert session.info.incarnation == "inc1" and session.task is None and session.outbox.link is not None
    await asyncio.wait_for(sent, 5)
    assert core.queue("again") is not None and core.sessions.get("peer:0") is session


async def test_a_peer_that_cannot_be_connected_to_fails_the_send_instead_of_leaving_it_waiting():
    """connect_now raises (no file descriptors left, a bad endpoint): the session fails
    with PeerLostError naming the cause, so no send waits for a link that never comes."""
    core = _Core(asyncio.get_running_loop())

    def refuse(endpoint: str, *, identity: bytes):
        raise rlinf.ClosedError("the context is gone")

    core.zmq.connect_now = refuse
    core.roster["peer:0"] = _peer("inc1")
    with pytest.raises(rlinf.PeerLostError, match="cannot connect to peer:0") as caught:
        await asyncio.wait_for(core.queue("hello"), 5)
    assert isinstance(caught.value.__cause__, rlinf.ClosedError)
    assert core.sessions.get("peer:0").task is None
    with pytest.raises(rlinf.PeerLostError):             # and the next send fails at once
        core.queue("again")


async def test_a_lost_peer_closes_its_session_once_and_fails_its_pending_sends():
    core = _Core(asyncio.get_running_loop())
    pending = [core.queue(i) for i in range(3)]         # the peer is not known yet: they wait
    session = core.sessions.get("peer:0")
    closes = _count_closes(session)
    lookup = session.task
    assert lookup is not None and not any(f.done() for f in pending)
    core.membership.on_event(MembershipEvent("lost", "peer:0", ""))
    core.membership.on_event(MembershipEvent("lost", "peer:0", ""))      # told twice: still one close
    core.sessions.close_all(0, rlinf.ClosedError("we closed"))           # and our close does not close it again
    assert len(closes) == 1 and session.closed
    for future in pending:
        with pytest.raises(rlinf.PeerLostError, match="peer:0 was lost"):
            await asyncio.wait_for(future, 5)
    await asyncio.sleep(0)
    assert lookup.cancelled() and session.task is None
    with pytest.raises(rlinf.PeerLostError):             # a later send fails at once
        core.queue("late")


@pytest.mark.parametrize("kind", ["left", "failed"])
async def test_a_failed_peer_departs_as_one_that_left_and_subscribers_see_why(kind):
    """"failed" (its code raised, it closed properly) is a clean departure: the same
    PeerLostError and departure record as "left"; only the event says more."""
    core = _Core(asyncio.get_running_loop())
    core.membership.on_event(MembershipEvent("joined", "peer:0", "inc1", _peer("inc1")))
    events = core.membership.subscribe()
    pending = core.queue("to it")
    core.sessions.get("peer:0").outbox._blocked = True
    waiting = core.queue("still queued")
    reason = "ValueError: bad batch" if kind == "failed" else ""
    core.membership.on_event(MembershipEvent(kind, "peer:0", "inc1", None, reason))
    assert core.membership.departed("peer:0", "inc1").kind == "left"
    event = events.get_nowait()
    assert (event.kind, event.reason) == (kind, reason)
    with pytest.raises(rlinf.PeerLostError, match="peer:0 left"):
        await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(pending, 5)


def test_failure_summary_is_one_line_and_bounded():
    assert failure_summary(ValueError("bad batch 7\nmore")) == "ValueError: bad batch 7"
    assert failure_summary(KeyError("policy")) == "KeyError: 'policy'"
    assert failure_summary(RuntimeError()) == "RuntimeError"
    long = failure_summary(RuntimeError("x" * 1000))
    assert len(long) == MAX_REASON and long.endswith("...")


async def test_a_restarted_peer_gets_a_new_session():
    core = _Core(asyncio.get_running_loop())
    first = _peer("inc1")
    core.membership.on_event(MembershipEvent("joined", "peer:0", "inc1", first))
    sent = core.queue("to the first")
    old = core.sessions.get("peer:0")
    closes = _count_closes(old)
    old.outbox._blocked = True                         # the link pushes back: the next send waits
    waiting = core.queue("still queued")
    second = _peer("inc2")
    core.membership.on_event(MembershipEvent("joined", "peer:0", "inc2", second))
    assert len(closes) == 1 and core.sessions.get("peer:0") is None
    with pytest.raises(rlinf.PeerLostError, match="restarted"):
        await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(sent, 5)                    # what went out before stays sent
    core.queue("to the second")
    new = core.sessions.get("peer:0")
    assert new is not old and new.info.incarnation == "inc2" and not new.closed
    assert len(core.zmq.links[second.endpoints["tcp"]].sent) == 1
    core.membership.on_event(MembershipEvent("lost", "peer:0", "inc1"))   # the old one's loss, reported late
    assert not new.closed and new.error is None


async def test_a_restart_seen_first_as_a_join_retires_the_slots_the_old_incarnation_held():
    """What shared memory kept about the old incarnation (its window of our slots) does not
    carry over to the new one: its slots retire, and the new session's state is new."""
    from rlinf.transports import shm

    core = _Core(asyncio.get_running_loop())
    session_shm = shm.ShmSession(asyncio.get_running_loop(), lambda dst, obj: None)
    core.sessions._shm = session_shm
    try:
        core.membership.on_event(MembershipEvent("joined", "peer:0", "inc1", _peer("inc1")))
        core.queue("to the first")
        old = core.sessions.get("peer:0").shm
        session_shm.export([memoryview(b"x" * 1000)], [1000], {"peer:0": 1})
        assert old is not None and session_shm.pool.held("peer:0")[0] == 1
        core.membership.on_event(MembershipEvent("joined", "peer:0", "inc2", _peer("inc2")))
        assert old.closed and session_shm.pool.held("peer:0") == (0, 0)
        core.queue("to the second")
        assert core.sessions.get("peer:0").shm is not old
    finally:
        session_shm.close()


async def test_our_close_closes_every_open_session():
    core = _Core(asyncio.get_running_loop())
    core.roster["peer:0"] = _peer("inc1")
    core.queue("hello")
    session = core.sessions.get("peer:0")
    session.outbox._blocked = True
    waiting = core.queue("queued")
    core.sessions.close_all(0, rlinf.ClosedError("we closed"))
    assert session.closed
    with pytest.raises(rlinf.ClosedError):
        await asyncio.wait_for(waiting, 5)


@pytest.mark.parametrize("tag", sorted(SYSTEM_TAGS))
def test_system_tags_of_the_core_cannot_be_taken(tag):
    comm = rlinf.Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")
    with pytest.raises(ValueError, match="used by rlinf"):
        comm.on_system(tag, lambda src, obj: None)
    with pytest.raises(ValueError, match="used by rlinf"):
        comm.internal.on_system(tag, lambda src, obj: None)


def test_a_system_tag_of_its_own_reaches_a_subsystems_handler():
    comm = rlinf.Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")
    got = []
    comm.internal.on_system("mine", lambda src, obj: got.append((src, obj)))
    comm._receive._handlers["mine"]("b:0", 42)
    assert got == [("b:0", 42)]


async def test_an_outbox_owns_its_tasks_and_a_send_they_still_await_fails_when_cancelled():
    """asyncio keeps only weak references to tasks: the outbox keeps its own, and the
    communicator cancels what is left once its transports let go (a send awaiting its
    release then fails instead of hanging)."""
    from rlinf.core._outbox import SMALL_MESSAGE, OutMessage, Outbox

    class Holding(RecordingLink):
        async def released(self, tracker) -> None:
            await asyncio.Event().wait()        # the transport never lets go

    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"))
    box.attach(Holding(), None)
    future = asyncio.get_running_loop().create_future()
    box.put(OutMessage([wire.USER, 0, b"h", [1]], [bytes(SMALL_MESSAGE)], SMALL_MESSAGE, future, True),
            asyncio.get_running_loop())
    await asyncio.sleep(0)
    assert len(box._tasks) == 1 and not future.done()
    box.close(0, rlinf.ClosedError("we closed"))
    box.cancel_tasks()
    with pytest.raises(rlinf.ClosedError):
        await asyncio.wait_for(future, 5)
    await asyncio.sleep(0)
    assert not box._tasks
