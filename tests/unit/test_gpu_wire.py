"""The CUDA IPC item of a data-plane entry (CPU only): validation, and the receive path
putting device buffers back in their places among the host buffers."""

from __future__ import annotations

import numpy as np
import pytest

from rlinf.config import Settings
from rlinf.core import routing, wire
from rlinf.transports import descriptors
from rlinf import Communicator
from rlinf.errors import DecodeError, ProtocolError
from rlinf.core._inbound import FrameReader
from rlinf.transports.cuda import ipc as cuda_ipc
from rlinf.transports.shm import Recycler

from ..recording_link import RecordingLink

SHARE = [0, b"\x02c" + b"h" * 64, 1 << 20, 0, b"/torch_41_2851_0", 7, b"e" * 64, True]


def _gpu(places, share=None, event=None):
    return [3, 1, 0, share, event, places]


def _unpack(entry, frames=()):
    return wire.unpack_header(wire.pack_header("a:0", "i", [entry]), list(frames))[2][0]


def test_entry_with_gpu_buffers_round_trips():
    entry = _unpack([wire.USER, 5, b"h", [1, 1], None, None, _gpu([[1, 0, 4096], [3, 4096, 8]], SHARE, b"e" * 64)],
                    [b"x", b"y"])
    assert entry.frame_counts == [1, 1] and entry.slot is None and entry.relays is None
    g = entry.gpu
    assert (g.slot, g.generation, g.device, g.event) == (3, 1, 0, b"e" * 64)
    assert g.share == tuple(SHARE) and g.places == ((1, 0, 4096), (3, 4096, 8)) and g.span == 4104


@pytest.mark.parametrize("gpu", [
    _gpu([]),                                        # no buffer
    _gpu([[0, 0, 8], [0, 8, 8]]),                    # one index twice
    _gpu([[2, 0, 8]]),                               # beyond the message's buffers
    _gpu([[0, -1, 8]]),                              # negative offset
    _gpu([[0, 0, 8]], SHARE[:-1], b"e"),             # short share
    _gpu([[0, 0, 8]], None, b"e"),                   # an event without its share
    _gpu([[0, 0, 8]], SHARE, None),                  # a share without its event
    _gpu([[0, 0, 8]], [1, *SHARE[1:]], b"e"),        # the share names another device
    _gpu([[0, 0, 8]], [*SHARE[:4], b"/etc/passwd", *SHARE[5:]], b"e"),   # not torch's counter file
    _gpu([[0, 0, 8]], [*SHARE[:5], 10_000, *SHARE[6:]], b"e"),           # a counter outside the file
    _gpu([[0, 0, 8]], [*SHARE[:3], -1, *SHARE[4:]], b"e"),                # before the allocation
    _gpu([[0, 1 << 20, 8]], SHARE, b"e"),            # beyond the slot
    _gpu([[0, 0, 8]], [SHARE[0], b"", *SHARE[2:]], b"e"),                 # no memory handle
    [3, 1, 0, None, None],                           # short descriptor
    [3, 1, -1, None, None, [[0, 0, 8]]],             # bad device
])
def test_bad_gpu_descriptors_are_protocol_errors(gpu):
    with pytest.raises(ProtocolError):
        _unpack([wire.USER, 0, b"h", [], None, None, gpu])


def _reader(open_gpu):
    return FrameReader(None, Recycler(), lambda src: None, lambda: None, open_gpu)


def test_frame_reader_puts_device_buffers_in_their_places():
    opened = []

    def open_gpu(src, incarnation, gpu):
        opened.append((src, incarnation, gpu.slot))
        return [(i, np.full(n, i, np.uint8)) for i, _off, n in gpu.places], lambda: None

    entry = _unpack([wire.USER, 0, b"h", [1, 1], None, None, _gpu([[3, 0, 4], [0, 256, 2]])],
                    [b"aa", b"bbb"])
    [(_entry, buffers, nbytes, in_shm, error, ready, _pulling)] = list(_reader(open_gpu).entries(
        "a:0", [entry], [memoryview(b"aa"), memoryview(b"bbb")], False, "inc"))
    assert error is None and not in_shm and opened == [("a:0", "inc", 3)] and ready is not None
    assert [bytes(b) for b in buffers] == [b"\x00\x00", b"aa", b"bbb", b"\x03\x03\x03\x03"]
    assert nbytes == 2 + 3 + 4 + 2


def test_frame_reader_without_cuda_ipc_reports_the_entry_unreadable():
    dropped = []
    reader = FrameReader(None, Recycler(), lambda src: None, lambda: dropped.append(1))
    entry = _unpack([wire.USER, 0, b"h", [], None, None, _gpu([[0, 0, 4]])])
    [(_entry, _buffers, _n, _shm, error, _ready, _pulling)] = list(reader.entries("a:0", [entry], [], False))
    assert isinstance(error, DecodeError) and dropped == [1]


def test_routing_config_without():
    cfg = routing.RoutingConfig().without(["cuda_ipc"])
    assert cfg.disabled == {"cuda_ipc"}
    assert cfg.without(("nccl",)).disabled == {"cuda_ipc", "nccl"}
    with pytest.raises(ValueError):
        cfg.without(["staged"])
    with pytest.raises(TypeError):
        cfg.without("cuda_ipc")


def test_communicator_refuses_unknown_disabled_transports():
    with pytest.raises(ValueError, match="unknown transport"):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t", disable=["carrier_pigeon"])


def test_slot_layout_and_sizes():
    assert descriptors.slot_layout([1, 256, 257, 0], cuda_ipc.ALIGN) == ([0, 256, 512, 1024], 1024)
    assert cuda_ipc._slot_size(1) == cuda_ipc.MIN_SLOT
    assert cuda_ipc._slot_size(cuda_ipc.MIN_SLOT + 1) == 2 * cuda_ipc.MIN_SLOT


def test_cap_from_environment(monkeypatch):
    assert Settings.from_env({"RLINF_CUDA_IPC_CAP": str(64 << 20)}).cuda_ipc_cap == 64 << 20
    assert Settings.from_env({"RLINF_CUDA_IPC_CAP": "64M"}).cuda_ipc_cap == 64 << 20
    assert Settings.from_env({}).cuda_ipc_cap == cuda_ipc.DEFAULT_CAP == 2 << 30
    with pytest.raises(ValueError, match="RLINF_CUDA_IPC_CAP"):
        Settings.from_env({"RLINF_CUDA_IPC_CAP": "lots"})
    with pytest.raises(ValueError, match="RLINF_CUDA_IPC_CAP"):
        Settings.from_env({"RLINF_CUDA_IPC_CAP": str(cuda_ipc.MIN_SLOT - 1)})
    # a bad value fails when the communicator is constructed, not on the first GPU message
    monkeypatch.setenv("RLINF_CUDA_IPC_CAP", "lots")
    with pytest.raises(ValueError, match="RLINF_CUDA_IPC_CAP='lots'"):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")


# -- GPU entries through a real outbox (the CUDA IPC item survives coalescing) ----------
async def test_small_gpu_messages_coalesce_with_others_and_keep_their_gpu_item():
    import asyncio

    from rlinf.core._outbox import OutMessage, Outbox
    from rlinf.core.stats import Counters

    loop = asyncio.get_running_loop()
    link = RecordingLink()
    now = [0.0]
    box = Outbox("peer:0", ("me:0", "inc0"), Counters("me:0"), clock=lambda: now[0])
    box.attach(link, None)
    gpu = _gpu([[0, 0, 8]])
    box.put(OutMessage([wire.USER, 1, b"h1", None], [b"ab"], 2, None, False), loop)          # alone, at once
    box.put(OutMessage([wire.USER, 2, b"h2", None, None, None, gpu], [b"cd"], 2, None, False,
                       transport="cuda_ipc"), loop)                                           # queued behind it
    box.put(OutMessage([wire.USER, 3, b"h3", None], [b"ef"], 2, None, False), loop)
    await asyncio.sleep(0)         # one loop turn: the flush scheduled for the burst ran
    assert len(link.sent) == 2
    frame_set = link.sent[1]
    src, _inc, entries, packed = wire.unpack_header(frame_set[0], frame_set[1:])
    assert packed and [e.tag for e in entries] == [2, 3]
    assert entries[0].gpu is not None and entries[0].gpu.places == ((0, 0, 8),)
    assert entries[0].frame_counts == [2] and entries[1].gpu is None

    opened = []

    def open_gpu(src, incarnation, ref):
        opened.append(ref.slot)
        return [(i, np.zeros(n, np.uint8)) for i, _off, n in ref.places], lambda: None

    rebuilt = list(_reader(open_gpu).entries(src, entries, [memoryview(f) for f in frame_set[1:]], True))
    assert [bytes(b) for b in rebuilt[0][1]] == [bytes(8), b"cd"] and [bytes(b) for b in rebuilt[1][1]] == [b"ef"]
    assert opened == [3]
    now[0] += 1.0                  # idle: a lone GPU message goes at once, its item intact
    box.put(OutMessage([wire.USER, 4, b"h4", None, None, None, gpu], [], 0, None, False, transport="cuda_ipc"), loop)
    _src, _inc, entries, _packed = wire.unpack_header(link.sent[2][0], link.sent[2][1:])
    assert entries[0].tag == 4 and entries[0].gpu is not None and entries[0].frame_counts == []
