"""The CUDA IPC sender's pool and the session's notices, on the CPU: torch's CUDA calls
are replaced by a recording fake, so the bookkeeping (slots per receiver, reuse,
generations, window and cap, announcements, releases, a receiver's death) is checked
without a GPU. The device side itself is tested in tests/gpu/."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rlinf.transports.cuda import CudaIpcSession, ipc as cuda_ipc


class _Event:
    def __init__(self, interprocess: bool = False) -> None:
        self.records = 0
        self.done = True

    def record(self, stream=None) -> None:
        self.records += 1

    def ipc_handle(self) -> bytes:
        return b"e" * 64

    def query(self) -> bool:
        return self.done

    @classmethod
    def from_ipc_handle(cls, device, handle) -> _Event:
        return cls()


class _Stream:
    def __init__(self) -> None:
        self.waits: list = []
        self.idle = True

    def wait_event(self, event) -> None:
        self.waits.append(event)

    def query(self) -> bool:
        return self.idle


class _Storage:
    shares = 0

    def __init__(self, size: int) -> None:
        self.size = size

    def _share_cuda_(self):
        _Storage.shares += 1
        return (0, b"\x02c" + b"h" * 64, self.size, 0, b"/torch_1_2_3", _Storage.shares, b"e" * 64, True)


class _Tensor:
    """A device allocation: records the copies into it."""

    def __init__(self, size: int) -> None:
        self.data = np.zeros(size, np.uint8)
        self.storage = _Storage(size)

    def __getitem__(self, s: slice) -> _View:
        return _View(self.data[s])

    def untyped_storage(self) -> _Storage:
        return self.storage


class _View:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def copy_(self, src, non_blocking: bool = False) -> None:
        self.data[:] = src.data


class _Buf:
    """A device buffer as the codec gives it (flat uint8, on device 0)."""

    class device:
        index = 0

    def __init__(self, data: bytes) -> None:
        self.data = np.frombuffer(data, np.uint8)
        self.nbytes = len(data)

    __module__ = "torch"


class _Cuda:
    Event = _Event

    def __init__(self) -> None:
        self.stream = _Stream()
        self.collected = 0

    def current_stream(self, device=None) -> _Stream:
        return self.stream

    def device(self, index):
        import contextlib
        return contextlib.nullcontext()

    def ipc_collect(self) -> None:
        self.collected += 1


class _UntypedStorage:
    released: list = []

    @classmethod
    def _release_ipc_counter(cls, handle, offset, device=None) -> None:
        cls.released.append((handle, offset))


class _Torch:
    uint8 = "uint8"
    UntypedStorage = _UntypedStorage

    def __init__(self) -> None:
        self.cuda = _Cuda()

    def empty(self, size, dtype=None, device=None) -> _Tensor:
        return _Tensor(size)


# -- the receiving side's torch: opened slots, views that keep their lease -------------
class _Opened:
    """A slot opened from its share (``_new_shared_cuda``) and made a uint8 tensor."""

    def __init__(self, size: int) -> None:
        self.size = size

    def set_(self, storage) -> _Opened:
        self.size = storage.size
        return self

    def numel(self) -> int:
        return self.size

    def data_ptr(self) -> int:
        return 1 << 20

    def __getitem__(self, s: slice) -> _Region:
        return _Region(None, s.stop - s.start)


class _Region:
    """A tensor over a ``__cuda_array_interface__`` object: it keeps the object (the
    lease) alive, and so do its slices."""

    dtype = "uint8"

    def __init__(self, lease, n: int) -> None:
        self.lease = lease
        self.nbytes = n

    def numel(self) -> int:
        return self.nbytes

    def __getitem__(self, s: slice) -> _Region:
        return _Region(self.lease, s.stop - s.start)

    def copy_(self, src) -> None:
        assert src.nbytes == self.nbytes


class _ReaderTorch(_Torch):
    class UntypedStorage:
        opened: list = []

        @classmethod
        def _new_shared_cuda(cls, *share):
            cls.opened.append(share)
            storage = type("S", (), {})()
            storage.size, storage.device = share[2], f"cuda:{share[0]}"
            return storage

    def __init__(self) -> None:
        super().__init__()
        self.cuda.current_device = lambda: 0

    def empty(self, size, dtype=None, device=None):
        return _Opened(size) if size == 0 else _Region(None, size)

    def as_tensor(self, lease, device=None) -> _Region:
        return _Region(lease, lease.__cuda_array_interface__["shape"][0])


def _sender(cap: int = 64 << 20) -> cuda_ipc.CudaIpcSender:
    return cuda_ipc.CudaIpcSender(cap, torch=_Torch())


def test_a_message_is_copied_into_one_slot_announced_once():
    s = _sender()
    buffers = [memoryview(b"host"), _Buf(b"abc"), _Buf(b"defg")]
    gpu = s.export(buffers, [1, 2], "r:0", 0)
    slot_id, generation, device, share, handle, places = gpu
    assert (generation, device) == (1, 0) and share is not None and handle == b"e" * 64
    assert places == [[1, 0, 3], [2, cuda_ipc.ALIGN, 4]]
    slot = s._slots[slot_id]
    assert bytes(slot.tensor.data[:3]) == b"abc" and bytes(slot.tensor.data[256:260]) == b"defg"
    assert slot.ready.records == 1 and s.busy_bytes("r:0") == cuda_ipc.MIN_SLOT
    assert s.release("r:0", slot_id, generation, None, False)
    again = s.export([_Buf(b"xyz")], [0], "r:0", 0)
    assert again[0] == slot_id and again[1] == 2 and again[3] is None and again[4] is None   # reused, not re-announced


def test_releases_that_do_not_match_are_refused():
    s = _sender()
    slot_id, generation = s.export([_Buf(b"a")], [0], "r:0", 0)[:2]
    assert not s.release("other:0", slot_id, generation, None, False)      # not its slot
    assert not s.release("r:0", slot_id, generation + 1, None, False)      # an old or future use
    assert not s.release("r:0", 999, 1, None, False)                       # no such slot
    assert s.release("r:0", slot_id, generation, None, False)
    assert not s.release("r:0", slot_id, generation, None, False)          # twice


def test_a_free_event_is_waited_on_only_when_the_receiver_recorded_one():
    s = _sender()
    slot_id, gen = s.export([_Buf(b"a")], [0], "r:0", 0)[:2]
    s.release("r:0", slot_id, gen, b"f" * 64, True)
    slot = s._slots[slot_id]
    slot.free_event.done = False
    s.export([_Buf(b"b")], [0], "r:0", 0)
    assert s._torch.cuda.stream.waits == [slot.free_event]
    s.release("r:0", slot_id, gen + 1, None, False)                        # its stream was idle
    s.export([_Buf(b"c")], [0], "r:0", 0)
    assert s._torch.cuda.stream.waits == [slot.free_event]                 # no second wait


def test_window_and_cap_per_receiver():
    s = _sender(cap=4 * cuda_ipc.MIN_SLOT)
    held = [s.export([_Buf(b"a")], [0], "r:0", 0) for _ in range(2)]
    assert not s.behind("r:0")
    held.append(s.export([_Buf(b"a")], [0], "r:0", 0))
    assert s.behind("r:0") and not s.behind("q:0")                          # over half the cap
    held.append(s.export([_Buf(b"a")], [0], "r:0", 0))
    assert s.export([_Buf(b"a")], [0], "r:0", 0) is None                       # at the cap: staged
    assert s.export([_Buf(b"a")], [0], "q:0", 0) is not None                   # another receiver: its own
    assert s.export([_Buf(bytes(5 * cuda_ipc.MIN_SLOT))], [0], "z:0", 0) is None   # larger than the cap
    assert s.opening("r:0")
    s.release("r:0", held[0][0], held[0][1], None, False)
    assert s.export([_Buf(b"a")], [0], "r:0", 0)[0] == held[0][0]             # the freed slot, no growth


def test_a_discarded_announcement_is_announced_again():
    s = _sender()
    gpu = s.export([_Buf(b"a")], [0], "r:0", 0)
    s.discard(gpu)
    again = s.export([_Buf(b"b")], [0], "r:0", 0)
    assert again[0] == gpu[0] and again[3] is not None
    s.discard([again[0], again[1] + 5, 0, None, None, []])                 # not its generation: ignored
    assert s.busy_bytes("r:0") == cuda_ipc.MIN_SLOT


def test_a_dead_receivers_references_are_released_and_its_slots_dropped():
    _UntypedStorage.released.clear()
    s = _sender()
    gpu = s.export([_Buf(b"a")], [0], "r:0", 0)
    s.export([_Buf(b"b")], [0], "q:0", 0)
    s.reader_gone("r:0", process_gone=True)
    assert [h for h, _o in _UntypedStorage.released] == [b"/torch_1_2_3"]
    assert gpu[0] not in s._slots and s.busy_bytes("r:0") == 0 and s._torch.cuda.collected == 1
    assert len(s._slots) == 1                                              # q:0's slot stays
    s.reader_gone("q:0", process_gone=False)                               # alive: it drops its own
    assert len(_UntypedStorage.released) == 1 and not s._slots


class _Session(CudaIpcSession):
    def __init__(self, loop, sent) -> None:
        self.sender = _sender()
        self.incarnation = "me"
        self._loop = loop
        self._send_notice = lambda dst, items: sent.append((dst, items))
        self.peers, self._owing, self._flush_scheduled = {}, {}, False
        self.reader = _NoReader()


class _NoReader:
    def __init__(self) -> None:
        self.retired: list = []

    def peer_gone(self, address: str, incarnation: str | None = None) -> None:
        pass

    def retire(self, src: str, incarnation: str, slot: int) -> None:
        self.retired.append((src, incarnation, slot))


async def test_releases_ride_on_the_next_message_else_go_in_one_notice():
    sent: list = []
    session = _Session(asyncio.get_running_loop(), sent)
    session._owe("a:0", [1, 1, None, False])
    session._owe("a:0", [2, 1, None, False])
    session._owe("b:0", [3, 1, None, False])
    assert session.owed == 2 and session.take("a:0") == [[1, 1, None, False], [2, 1, None, False]]
    await asyncio.sleep(0)                  # the loop turn ends: what is left goes in one notice
    assert sent == [("b:0", [[3, 1, None, False]])] and session.owed == 0


async def test_notices_release_slots_and_wake_a_waiting_send(caplog):
    session = _Session(asyncio.get_running_loop(), [])
    slot_id, gen = session.sender.export([_Buf(b"a")], [0], "r:0", 0)[:2]
    waiting = asyncio.ensure_future(session.room("r:0"))
    await asyncio.sleep(0)
    session.on_notice("r:0", [[slot_id, gen, None, False, "me"], ["bad"], [slot_id, gen, None, False, "me"],
                              [slot_id, gen, None, False, "an earlier me"], ["retire", 5, "its"]])
    async with asyncio.timeout(5):
        await waiting
    assert session.sender.busy_bytes("r:0") == 0 and session.reader.retired == [("r:0", "its", 5)]
    assert "malformed CUDA IPC notice item" in caplog.text and "does not hold" in caplog.text
    assert caplog.text.count("does not hold") == 1     # the other incarnation's release: not ours
    session.on_notice("r:0", "not a list")
    assert "malformed CUDA IPC notice" in caplog.text


async def test_room_waits_long_only_while_new_slots_may_be_opening():
    session = _Session(asyncio.get_running_loop(), [])
    slot_id, gen = session.sender.export([_Buf(b"a")], [0], "r:0", 0)[:2]
    assert session.stall("r:0") == cuda_ipc.OPEN_STALL                   # sent, never given back
    session.sender.release("r:0", slot_id, gen, None, False)
    session.sender.export([_Buf(b"a")], [0], "r:0", 0)
    assert session.stall("r:0") == cuda_ipc.STALL                        # the same slot: opened already
    session.sender.export([_Buf(bytes(cuda_ipc.MIN_SLOT + 1))], [0], "r:0", 0)     # a new one
    assert session.stall("r:0") == cuda_ipc.OPEN_STALL
    waiting = asyncio.ensure_future(session.room("r:0"))
    await asyncio.sleep(0)
    assert not waiting.done()
    session.peer_gone("r:0", None, process_gone=False)      # the receiver left: the wait ends at once
    async with asyncio.timeout(5):
        await waiting


async def test_what_the_session_keeps_about_a_peer_goes_when_it_is_closed():
    """A peer's CudaPeer (a PeerState): closing it drops the notices owed to it, forgets
    our slots for it and ends a send waiting for room there; the next use starts afresh."""
    sent: list = []
    session = _Session(asyncio.get_running_loop(), sent)
    peer = session.peer("r:0")
    assert peer.address == "r:0" and not peer.closed and session.peer("r:0") is peer
    session.sender.export([_Buf(b"a")], [0], "r:0", 0)
    waiting = asyncio.ensure_future(session.room("r:0"))
    await asyncio.sleep(0)
    session._owe("r:0", [1, 1, None, False])                        # (flushed at the end of this turn)
    peer.close(process_gone=True)
    peer.close(process_gone=True)                                   # idempotent
    async with asyncio.timeout(5):
        await waiting
    await asyncio.sleep(0)                                          # the flush turn: nothing owed goes
    assert sent == [] and session.owed == 0 and session.sender.busy_bytes("r:0") == 0
    assert peer.closed and session.peer("r:0") is not peer and not session.peer("r:0").owed


async def test_free_slots_of_other_sizes_are_retired_to_make_room():
    session = _Session(asyncio.get_running_loop(), [])
    session.sender.cap = 4 * cuda_ipc.MIN_SLOT
    small = [session.export([_Buf(b"a")], [0], "r:0", 0) for _ in range(4)]
    for gpu in small:
        session.sender.release("r:0", gpu[0], gpu[1], None, False)
    big = session.export([_Buf(bytes(cuda_ipc.MIN_SLOT + 1))], [0], "r:0", 0)     # twice the size
    assert big is not None and big[3] is not None
    retired = [item for item in session.take("r:0") if item[0] == "retire"]
    assert len(retired) == 2 and all(item[2] == "me" for item in retired)
    assert {item[1] for item in retired} <= {gpu[0] for gpu in small}
    assert len(session.sender._slots) == 3 and session.sender._torch.cuda.collected == 1
    held = session.export([_Buf(bytes(2 * cuda_ipc.MIN_SLOT + 1))], [0], "r:0", 0)  # 4x: room only if busy ones went
    assert held is None                       # the 2x slot is busy: nothing to retire makes room


def test_the_share_names_the_receivers_device():
    s = _sender()
    gpu = s.export([_Buf(b"a")], [0], "r:0", 3)
    assert gpu[2] == 3 and gpu[3][0] == 3
    assert s._slots[gpu[0]].device == 0       # ours


SHARE = (0, b"\x02c" + b"h" * 64, cuda_ipc.MIN_SLOT, 0, b"/torch_1_2_3", 4, b"e" * 64, True)


def _ref(slot=1, generation=1, share=SHARE, places=((0, 0, 8),)):
    from rlinf.transports import descriptors
    return descriptors.GpuRef(slot, generation, 0, share, b"e" * 64 if share else None, places,
                       max(o + n for _i, o, n in places))


def _reader(views=True):
    released: list = []
    torch = _ReaderTorch()
    reader = cuda_ipc.CudaIpcReader(asyncio.get_running_loop(),
                                    lambda src, item: released.append((src, item)), views=views, torch=torch)
    return reader, released, torch


async def test_views_give_their_slot_back_when_the_last_one_dies():
    reader, released, torch = _reader()
    pairs, ready = reader.open("s:0", "inc1", _ref(places=((0, 0, 8), (2, 256, 4))))
    assert [i for i, _v in pairs] == [0, 2] and len(torch.UntypedStorage.opened) == 1
    first, second = pairs[0][1], pairs[1][1]
    del pairs
    ready()
    assert not released
    del first
    assert not released                      # one view still lives
    del second
    assert released == [("s:0", [1, 1, None, False, "inc1"])]     # its stream idle: no wait


async def test_a_busy_stream_records_the_free_event_once_announced():
    reader, released, torch = _reader()
    pairs, _ready = reader.open("s:0", "inc1", _ref())
    torch.cuda.stream.idle = False           # a kernel over the view is still queued
    del pairs
    [(_src, item)] = released
    assert item[2] == b"e" * 64 and item[3] is True
    again, _ready = reader.open("s:0", "inc1", _ref(generation=2, share=None))
    del again
    assert released[1][1][2] is None and released[1][1][3] is True   # the handle went once


async def test_a_slot_never_announced_is_rejected_and_the_message_fails():
    from rlinf.errors import ProtocolError

    reader, released, _torch = _reader()
    with pytest.raises(ProtocolError, match="never announced"):
        reader.open("s:0", "inc1", _ref(share=None))
    assert released == [("s:0", ["reject", 1, 1, "inc1"])]


async def test_a_view_of_a_restarted_senders_old_slot_frees_nothing_new():
    reader, released, _torch = _reader()
    old, _ready = reader.open("s:0", "inc1", _ref())
    reader.forget_others("s:0", "inc2")      # it restarted as inc2
    new, _ready = reader.open("s:0", "inc2", _ref())     # its slot 1, generation 1 again
    del old
    assert released == []                    # the old view's end says nothing to inc2
    del new
    assert released == [("s:0", [1, 1, None, False, "inc2"])]


async def test_an_entry_that_could_not_be_read_gives_its_slot_back():
    reader, released, _torch = _reader()
    pairs, _ready = reader.open("s:0", "inc1", _ref())
    del pairs
    released.clear()
    reader.refuse("s:0", "inc1", _ref(generation=2, share=None))        # mapped: a plain release
    reader.refuse("s:0", "inc1", _ref(slot=7, generation=1))            # its announcement: rejected
    assert released == [("s:0", [1, 2, None, False, "inc1"]), ("s:0", ["reject", 7, 1, "inc1"])]


async def test_owned_copies_give_the_slot_back_at_once():
    reader, released, torch = _reader(views=False)
    pairs, ready = reader.open("s:0", "inc1", _ref())
    assert len(released) == 1 and pairs[0][1].nbytes == 8
    ready()


async def test_retire_waits_for_the_last_recorded_reads():
    reader, _released, torch = _reader()
    pairs, _ready = reader.open("s:0", "inc1", _ref())
    torch.cuda.stream.idle = False
    del pairs
    free = reader._mapped[("s:0", "inc1", 1)].free_event
    free.done = False
    reader.retire("s:0", "inc1", 1)
    assert torch.cuda.stream.waits == [free] and not reader._mapped


def test_a_rejected_slot_is_dropped_and_its_reference_released():
    _UntypedStorage.released.clear()
    s = _sender()
    gpu = s.export([_Buf(b"a")], [0], "r:0", 0)
    assert s.reject("r:0", gpu[0], gpu[1])
    assert gpu[0] not in s._slots and s.busy_bytes("r:0") == 0 and len(_UntypedStorage.released) == 1
    again = s.export([_Buf(b"a")], [0], "r:0", 0)
    assert again[0] != gpu[0] and again[3] is not None          # a new slot, announced afresh


async def test_notices_to_a_peer_that_cannot_be_reached_wait_for_its_return():
    sent: list = []
    reachable = [False]

    def send(dst, items):
        if not reachable[0]:
            raise ConnectionError("taken for lost")
        sent.append((dst, items))

    session = _Session(asyncio.get_running_loop(), sent)
    session._send_notice = send
    session._owe("a:0", [1, 1, None, False, "x"])
    await asyncio.sleep(0)                   # the flush fails: kept
    assert session.take("a:0") == [[1, 1, None, False, "x"]]
    session._owe("a:0", [2, 1, None, False, "x"])
    await asyncio.sleep(0)
    reachable[0] = True
    session._owe("a:0", [3, 1, None, False, "x"])
    await asyncio.sleep(0)
    assert sent == [("a:0", [[2, 1, None, False, "x"], [3, 1, None, False, "x"]])]
    session._owe("b:0", [4, 1, None, False, "x"])
    session.peer_gone("b:0", None, process_gone=True)       # forgotten: nothing owed any more
    assert session.owed == 0


# -- the communicator's routing of GPU buffers (its glue to the session) ---------------
class _DeviceBuf(_Buf):
    """A CUDA tensor as far as the communicator's routing can tell, and what staging
    takes from it."""

    __module__ = "torch"
    is_cuda = True

    def cpu(self):
        data = self.data
        return type("Host", (), {"numpy": lambda _self: data})()


def _comm_with(peer_devices, peer_transports=("zmq", "cuda_ipc")):
    from rlinf import Communicator
    from rlinf.info import DeviceInfo, WorkerInfo

    comm = Communicator("me:0", manager="tcp://127.0.0.1:1", token="t")
    comm.info = WorkerInfo("me:0", "inc-me", "node", devices=(DeviceInfo("cuda", 0, "GPU-a"),),
                           transports=("zmq", "cuda_ipc"))
    comm._roster["peer:0"] = WorkerInfo("peer:0", "inc-1", "node", pid=1, devices=peer_devices,
                                        transports=peer_transports)
    comm._gpu.me = comm.info
    comm._gpu.session = _Session(asyncio.get_running_loop(), [])
    return comm


async def test_gpu_buffers_to_a_peer_go_by_cuda_ipc_named_in_its_device_numbering():
    from rlinf.info import DeviceInfo

    comm = _comm_with((DeviceInfo("cuda", 0, "GPU-b"), DeviceInfo("cuda", 1, "GPU-a")))
    host, gpu = comm._gpu.prepare([memoryview(b"hd"), _DeviceBuf(b"abc")], "peer:0")
    assert [bytes(b) for b in host] == [b"hd"]
    assert gpu[2] == 1 and gpu[3][0] == 1 and gpu[5] == [[1, 0, 3]]       # its cuda:1 is our cuda:0


async def test_gpu_buffers_are_staged_to_a_peer_that_cannot_map_them(caplog):
    from rlinf.info import DeviceInfo

    comm = _comm_with((DeviceInfo("cuda", 0, "GPU-b"),))                   # it does not see GPU-a
    host, gpu = comm._gpu.prepare([_DeviceBuf(b"abc")], "peer:0")
    assert gpu is None and [bytes(b) for b in host] == [b"abc"]
    assert "does not see the GPU" in caplog.text
    comm = _comm_with((DeviceInfo("cuda", 0, "GPU-a"),), peer_transports=("zmq",))
    host, gpu = comm._gpu.prepare([_DeviceBuf(b"abc")], "peer:0")
    assert gpu is None and "cuda_ipc unavailable on peer:0" in caplog.text


async def test_a_restarted_peer_starts_from_fresh_slots():
    import dataclasses

    from rlinf.info import DeviceInfo

    comm = _comm_with((DeviceInfo("cuda", 0, "GPU-a"),))
    _host, first = comm._gpu.prepare([_DeviceBuf(b"abc")], "peer:0")
    comm._gpu.session.sender.release("peer:0", first[0], first[1], None, False)
    comm._roster["peer:0"] = dataclasses.replace(comm._roster["peer:0"], incarnation="inc-2")
    _host, again = comm._gpu.prepare([_DeviceBuf(b"abc")], "peer:0")
    assert again[0] != first[0] and again[3] is not None       # the old incarnation's slot was dropped


async def test_a_gpu_message_is_queued_with_its_item_and_discards_its_slot_unsent():
    from rlinf.core import wire
    from rlinf.info import DeviceInfo
    from rlinf.core._outbox import Outbox
    from rlinf.core._peer import PeerSession

    from ..recording_link import RecordingLink

    comm = _comm_with((DeviceInfo("cuda", 0, "GPU-a"),))
    comm._send.start(asyncio.get_running_loop(), None, None)
    host, gpu = comm._gpu.prepare([memoryview(b"hd"), _DeviceBuf(b"abc")], "peer:0")
    link = RecordingLink()
    box = Outbox("peer:0", ("me:0", "inc-me"), comm._counters, clock=lambda: 1.0)
    box.attach(link, None)
    session = PeerSession("peer:0", box)
    assert comm._send._queue(session, wire.USER, 5, b"h", host, False, gpu) is None     # small, link idle: sent
    [frame_set] = link.sent
    _src, _inc, [entry], _packed = wire.unpack_header(frame_set[0], frame_set[1:])
    assert entry.tag == 5 and entry.gpu.places == ((1, 0, 3),) and entry.frame_counts == [2]
    assert comm.stats().transports["cuda_ipc"].msgs == 1
    held = comm._gpu.prepare([_DeviceBuf(b"x")], "peer:0")[1]
    box.queue.clear()
    future = comm._send._queue(session, wire.USER, 6, b"h", [], True, held)       # queued behind the in-flight send
    [msg] = box.queue
    assert future is not None and msg.transport == "cuda_ipc"
    msg.discard()                                                         # dropped unsent: its slot is free
    assert comm._gpu.session.sender.busy_bytes("peer:0") == cuda_ipc.MIN_SLOT      # only the first one's
