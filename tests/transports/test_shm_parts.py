"""The shared-memory pieces in one process: pool, reader, recycler, wire descriptors."""

from __future__ import annotations

import gc
import mmap
import os

import numpy as np
import pytest

from rlinf.config import Settings
from rlinf.core import wire
from rlinf.transports import descriptors
from rlinf.errors import ProtocolError
from rlinf.transports import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs Linux and a writable /dev/shm")


@pytest.fixture
def pool():
    p = shm.ShmPool(cap=64 << 20)
    yield p
    p.close()


@pytest.fixture
def released():
    return []


@pytest.fixture
def reader(released):
    r = shm.ShmReader(lambda *args: released.append(args))
    yield r
    r.close()


def _export(pool, data: list[bytes], readers=None, private=False):
    sizes = [len(d) for d in data]
    offsets, end = descriptors.slot_layout(sizes)
    slot = pool.acquire(end, readers or {"r:0": 1}, private=private)
    pool.fill(slot, [memoryview(d) for d in data], offsets)
    return slot, sizes


def test_slot_layout_aligns_every_buffer():
    offsets, end = descriptors.slot_layout([1, 64, 65, 0, 7])
    assert offsets == [0, 64, 128, 256, 256] and end == 320
    assert all(o % descriptors.SLOT_ALIGN == 0 for o in offsets)


def test_size_classes_waste_at_most_an_eighth():
    for n in (1, 4095, 64 << 10, (64 << 10) + 1, 400 << 10, 1 << 20, (40 << 20) + 17, 3 << 30):
        size = shm._slot_size(n)
        assert size >= n and size % 4096 == 0
        assert size <= max(shm.MIN_SLOT, n * 1.125 + 4096)


def test_views_are_writable_zero_copy_and_released_when_collected(pool, reader, released):
    slot, sizes = _export(pool, [b"a" * 100, b"b" * 70_000])
    views = reader.open("s:0", slot.ref(), sizes, os.getpid())
    assert [bytes(v[:1]) for v in views] == [b"a", b"b"] and not views[1].readonly
    arr = np.frombuffer(views[1], np.uint8)
    arr[0] = ord("z")                          # shared mapping: the sender's slot sees it
    assert slot.array[128] == ord("z")
    del views
    assert released == []                      # arr still holds the slot
    del arr
    gc.collect()
    assert released == [("s:0", slot.name, slot.generation)]


def test_release_must_match_reader_and_generation(pool):
    slot, _ = _export(pool, [b"x" * 10], readers={"r:0": 1})
    assert not pool.release("intruder:0", slot.name, slot.generation)
    assert not pool.release("r:0", slot.name, slot.generation + 1)
    assert not pool.release("r:0", "rlinf-1-ff-ab-0", 1)
    assert pool.busy == 1
    assert pool.release("r:0", slot.name, slot.generation)
    assert pool.busy == 0 and not pool.release("r:0", slot.name, slot.generation)   # no double free


def test_a_slot_is_reused_only_after_every_reader_released(pool):
    slot, _ = _export(pool, [b"x" * 10], readers={"a:0": 1, "b:0": 2})
    again = pool.acquire(10, {"c:0": 1})
    assert again is not slot                   # busy: a new one
    pool.release("a:0", slot.name, slot.generation)
    pool.release("b:0", slot.name, slot.generation)
    assert pool.acquire(10, {"c:0": 1}) is not slot
    pool.release("b:0", slot.name, slot.generation)
    assert pool.acquire(10, {"c:0": 1}) is slot
    assert pool.created == 3


def test_cap_evicts_free_slots_then_refuses(pool):
    small = shm.ShmPool(cap=5 << 19)     # 2.5 MiB
    try:
        a = small.acquire(2 << 20, {"r:0": 1})
        assert a is not None
        assert small.acquire(2 << 20, {"r:0": 1}) is None and small.fallbacks == 1
        small.release("r:0", a.name, a.generation)
        assert small.acquire(1 << 20, {"r:0": 1}) is a   # a free slot up to twice the size serves
        small.release("r:0", a.name, a.generation)
        b = small.acquire(700 << 10, {"r:0": 1})    # too small for it: evicted, a new one made
        assert b is not None and b is not a and small.mapped <= small.cap
        assert not os.path.exists(a.path)
        assert small.acquire(10 << 20, {"r:0": 1}) is None    # larger than the cap
    finally:
        small.close()


def test_a_reader_unmaps_segments_its_sender_evicted(reader):
    """A sender at its cap drops free segments to make new ones; the reader's cached
    mappings of the dropped ones kept their memory in use (invisibly: the files were
    unlinked) for as long as the sender lived."""
    small = shm.ShmPool(cap=5 << 19)     # 2.5 MiB
    try:
        for n in [1 << 20, 2300 << 10] * 10:     # neither fits the other's slot: each evicts it
            slot, sizes = _export(small, [b"x" * n], readers={"r:0": 1})
            views = reader.open("s:0", slot.ref(), sizes, os.getpid())
            assert bytes(views[0][:1]) == b"x"
            del views
            gc.collect()
            small.release("r:0", slot.name, slot.generation)
        assert small.created == 20 and len(small.segment_names()) == 1
        assert slot.name in reader._shared and len(reader._shared) <= 4   # was: all 20 mapped
    finally:
        small.close()


def test_a_reader_unmaps_copy_on_write_segments_their_sender_retired(pool, reader):
    """A multicast slot is retired (unlinked) when one of its readers dies holding it:
    the other readers' cached copy-on-write mappings of it kept its memory in use for
    as long as the sender lived."""
    for i in range(12):
        slot, sizes = _export(pool, [b"x" * (1 << 20)], readers={"r:0": 1, f"dies:{i}": 1}, private=True)
        view = reader.open("s:0", slot.ref(), sizes, os.getpid())[0]
        assert bytes(view[:1]) == b"x"
        del view
        gc.collect()
        pool.release("r:0", slot.name, slot.generation)
        assert pool.reader_gone(f"dies:{i}") == set()        # retired: unlinked, never reused (r:0 gave it back)
    assert pool.created == 12
    gone = [n for n in reader._private if not os.path.exists(os.path.join(shm.SHM_DIR, n))]
    assert len(gone) <= 4                                        # was: all 12 kept mapped


def test_a_relayed_slot_is_made_copy_on_write_in_place(pool, reader):
    """Before its slot is relayed, the reader's shared mapping becomes private in place:
    its views keep their bytes, its later writes no longer reach the file."""
    slot, sizes = _export(pool, [b"\x01" * 8192])
    view = np.frombuffer(reader.open("s:0", slot.ref(), sizes, os.getpid())[0], np.uint8)
    address = view.ctypes.data
    assert reader.locate(address, 8192) is not None
    assert reader.privatize(slot.name, slot.path)
    assert view.ctypes.data == address and bytes(view[:2]) == b"\x01\x01"
    view[:] = 9
    assert slot.array[0] == 1                                    # the file kept the sent bytes
    assert reader.locate(address, 8192) is None                   # its views are no longer relayed
    assert reader._bases[slot.name] != address                    # a new shared mapping is cached


def test_reader_gone_retires_its_slots(pool):
    slot, _ = _export(pool, [b"x" * 10], readers={"gone:0": 1, "co:0": 1})
    assert pool.holding("co:0")
    assert pool.reader_gone("gone:0") == {"co:0"}                # a co-reader holds fewer now
    assert pool.busy == 0 and not os.path.exists(slot.path) and not pool.holding("co:0")
    assert pool.acquire(10, {"r:0": 1}) is not slot


def test_close_unlinks_every_segment(pool):
    slots = [_export(pool, [b"x" * n])[0] for n in (10, 300_000, 2 << 20)]
    pool.release("r:0", slots[0].name, slots[0].generation)
    names = pool.segment_names()
    assert len(names) == 3 and all(n.startswith(f"rlinf-{os.getpid()}-") for n in names)
    pool.close()
    assert not any(os.path.exists(s.path) for s in slots)
    assert pool.acquire(10, {"r:0": 1}) is None


def test_private_readers_do_not_see_each_other_and_reset_on_release(pool, released):
    readers = [shm.ShmReader(lambda *a: released.append(a)) for _ in range(2)]
    try:
        slot, sizes = _export(pool, [b"\x01" * 8192], readers={"a:0": 1, "b:0": 1}, private=True)
        va = readers[0].open("s:0", slot.ref(), sizes)[0]
        vb = readers[1].open("s:0", slot.ref(), sizes)[0]
        np.frombuffer(va, np.uint8)[:] = 7                 # a's copy-on-write pages
        assert bytes(vb[:2]) == b"\x01\x01" and slot.array[0] == 1
        del va, vb
        gc.collect()
        for r in ("a:0", "b:0"):
            assert pool.release(r, slot.name, slot.generation)
        slot2, _ = _export(pool, [b"\x02" * 8192], readers={"a:0": 1}, private=True)
        assert slot2 is slot                                # same slot, new data
        again = readers[0].open("s:0", slot2.ref(), sizes)[0]
        assert bytes(again[:2]) == b"\x02\x02"               # not a's old private writes
    finally:
        for r in readers:
            r.close()


@pytest.mark.parametrize("pagemap", [True, False], ids=["pagemap", "no-pagemap"])
def test_a_private_reader_drops_exactly_its_written_pages(pool, released, monkeypatch, pagemap):
    """Pages a multicast reader wrote are reset on release; pages it only read stay
    mapped (no re-fault on the next use) and show the next message's bytes."""
    from rlinf.transports.shm import _pagemap, _reader as _shm_reader

    if not pagemap:   # e.g. /proc unavailable: every page is dropped, still correct
        monkeypatch.setattr(_pagemap, "written_runs", lambda address, length: None)
        monkeypatch.setattr(_shm_reader, "written_runs", _pagemap.written_runs)
    page, pages = shm._PAGE, 32
    reader = shm.ShmReader(lambda *a: released.append(a))
    try:
        slot, sizes = _export(pool, [b"\x01" * (page * pages)], readers={"a:0": 1, "b:0": 1}, private=True)
        view = reader.open("s:0", slot.ref(), sizes)[0]
        arr = np.frombuffer(view, np.uint8)
        assert int(arr[::page].sum()) == pages               # read every page
        arr[3 * page] = 7                                    # write pages 3, 10 and 11
        arr[10 * page:12 * page] = 9
        base = arr.ctypes.data
        if pagemap:
            runs = _pagemap.written_runs(base, page * pages)
            if runs is None:
                pytest.skip("/proc/self/pagemap is not readable here")
            assert runs == [(3 * page, page), (10 * page, 2 * page)]
        del view, arr
        gc.collect()
        for r in ("a:0", "b:0"):
            assert pool.release(r, slot.name, slot.generation)
        slot2, _ = _export(pool, [b"\x02" * (page * pages)], readers={"a:0": 1}, private=True)
        assert slot2 is slot
        again = np.frombuffer(reader.open("s:0", slot2.ref(), sizes)[0], np.uint8)
        assert (again[::page] == 2).all() and (again[10 * page:12 * page] == 2).all()
        if pagemap:
            assert again.ctypes.data == base and _pagemap.written_runs(base, page * pages) == []
    finally:
        reader.close()


def test_reader_refuses_foreign_missing_or_short_segments(pool, reader):
    slot, sizes = _export(pool, [b"x" * 10])
    with pytest.raises(ProtocolError, match="another process"):
        reader.open("s:0", slot.ref(), sizes, pid=os.getpid() + 1)
    missing = descriptors.SlotRef(f"rlinf-{os.getpid()}-00-424242", os.getpid(), 0, 4096, 1, False)
    with pytest.raises(ProtocolError, match="cannot open"):
        reader.open("s:0", missing, [10])
    ref = slot.ref()
    beyond = descriptors.SlotRef(ref.segment, ref.pid, 0, ref.size + 4096, ref.generation, False)
    with pytest.raises(ProtocolError, match="beyond the end"):
        reader.open("t:0", beyond, [10])


@pytest.mark.parametrize("slot", [
    ["../../etc/passwd", 0, 4096, 1, False],
    ["rlinf-1-ff-ab-0/x", 0, 4096, 1, False],
    ["torch_1_2_3", 0, 4096, 1, False],
    ["rlinf-1-ff-ab-0", 100, 4096, 1, False],           # offset not page-aligned
    ["rlinf-1-ff-ab-0", 0, 0, 1, False],                # empty slot
    ["rlinf-1-ff-ab-0", 0, 1 << 41, 1, False],          # beyond MAX_SLOT
    ["rlinf-1-ff-ab-0", 0, 4096, -1, False],
    ["rlinf-1-ff-ab-0", 0, 4096, 1, 1],                 # private must be a bool
    ["rlinf-1-ff-ab-0", 0, 4096],
])
def test_bad_slot_descriptors_are_protocol_errors(slot):
    header = wire.pack_header("x:0", "i", [[0, 0, b"", [-10], slot]], True)
    with pytest.raises(ProtocolError):
        wire.unpack_header(header, [])


def test_layout_must_fit_its_slot_and_negative_counts_need_one():
    ok = ["rlinf-1-ff-ab-0", 0, 4096, 1, False]
    entries = wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [-10, 0, -4000], ok]], True), [])[2]
    assert entries[0].slot.pid == 1 and entries[0].frame_counts == [-10, 0, -4000]
    with pytest.raises(ProtocolError, match="cannot hold"):
        wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [-4000, -100], ok]], True), [])
    with pytest.raises(ProtocolError, match="layout"):
        wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [-10]]], True), [])
    with pytest.raises(ProtocolError, match="cannot hold"):      # a slot must carry something
        wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [], ok]], True), [])


def test_recycler_reuses_memory_once_arrays_die():
    recycler = shm.Recycler(1 << 30)
    data = np.arange(300_000, dtype=np.float64)
    first = recycler.copy([memoryview(data).cast("B"), b"", b"tail"])
    assert np.array_equal(np.frombuffer(first[0], np.float64), data) and bytes(first[2]) == b"tail"
    address = np.frombuffer(first[0], np.uint8).ctypes.data
    del first
    second = recycler.copy([memoryview(data).cast("B")])
    assert np.frombuffer(second[0], np.uint8).ctypes.data == address     # warm pages again


def test_recycled_memory_starts_on_a_page():
    """Copies into it must not land 16 bytes past a page-aligned source (np.empty's
    offset), which runs ~10x slower on our CPUs (rlinf.util.memory)."""
    recycler = shm.Recycler(1 << 30)
    for n in (1, 64 << 10, 400 << 10, 3 << 20):
        assert recycler.take(n).ctypes.data % mmap.PAGESIZE == 0
    copies = recycler.copy([b"x" * 5000, b"y" * 70000])
    assert np.frombuffer(copies[0], np.uint8).ctypes.data % mmap.PAGESIZE == 0


def test_cap_parsing(monkeypatch):
    assert Settings.from_env({"RLINF_SHM_CAP": "512M"}).shm_cap == 512 << 20
    assert Settings.from_env({"RLINF_SHM_CAP": "1.5GiB"}).shm_cap == 3 << 29
    with pytest.raises(ValueError, match="RLINF_SHM_CAP"):
        Settings.from_env({"RLINF_SHM_CAP": "lots"})
    assert Settings.from_env({}).shm_cap is None                   # unset: the rule below
    monkeypatch.setenv("RLINF_SHM_CAP", "512M")                     # not read by the pool
    assert 0 < shm.default_cap() <= 4 << 30
    default, given = shm.ShmPool(), shm.ShmPool(512 << 20)
    assert default.cap == shm.default_cap() == shm.Recycler().limit and given.cap == 512 << 20
    default.close()
    given.close()


async def test_a_dropped_multicast_message_releases_only_its_reader():
    import asyncio

    notices = []
    session = shm.ShmSession(asyncio.get_running_loop(), lambda dst, obj: notices.append((dst, obj)))
    try:
        data = [memoryview(b"x" * 1000)]
        slot, layout, copying = session.export(data, [1000], {"a:0": 1, "b:0": 1}, private=True)
        assert layout == [-1000] and copying is None and slot.private
        session.discard(slot, copying, "a:0")          # a's copy of the message was dropped
        assert session.pool.busy == 1                  # b still holds the slot
        assert session.pool.release("b:0", slot.name, slot.generation)
        assert session.pool.busy == 0
    finally:
        session.close()


def test_a_relay_link_outlives_the_owners_name_and_goes_when_released(released):
    """A relayed slot is named by a link of the relaying process: the owner's pool may
    close (unlinking its name) and the receiver still maps the bytes; the link goes
    once the receiver released it."""
    owner, relayer_pool = shm.ShmPool(cap=8 << 20), shm.ShmPool(cap=8 << 20)
    middle = shm.ShmReader(lambda *a: released.append(("middle", *a)))
    receiver = shm.ShmReader(lambda *a: released.append(("receiver", *a)))
    relay = shm.Relay(middle.locate, relayer_pool)
    try:
        slot, sizes = _export(owner, [b"\x05" * 5000, b"\x06" * 70_000])
        views = middle.open("owner:0", slot.ref(), sizes)
        assert middle.relayable
        planned = relay.plan(views, [v.nbytes for v in views], "receiver:0")
        assert planned is not None
        places, relays = planned
        assert sorted(places) == [0, 1] and len(relays) == 1
        assert relay.plan(views, [v.nbytes for v in views], "receiver:0") is None   # not twice at once
        owner.close()                                         # the owner's name is gone
        link_name = relays[0][0]
        assert link_name.startswith(f"rlinf-{os.getpid()}-") and os.path.exists(f"/dev/shm/{link_name}")
        ref = descriptors.SlotRef(link_name, os.getpid(), relays[0][1], relays[0][2], relays[0][3], True)
        got = receiver.open_at("middle:0", ref, [(p[1], p[2]) for p in places.values()])
        assert bytes(got[0][:3]) == b"\x05\x05\x05" and bytes(got[1][-2:]) == b"\x06\x06"
        del got
        gc.collect()
        assert ("receiver", "middle:0", link_name, relays[0][3]) in released
        assert relay.release("receiver:0", link_name, relays[0][3])
        assert not relay.release("receiver:0", link_name, relays[0][3])          # once only
        assert not os.path.exists(f"/dev/shm/{link_name}") and relay.holds == 0
        del views
        gc.collect()
        assert any(r[0] == "middle" for r in released)       # then the relay's own release
    finally:
        relay.close()
        for r in (middle, receiver):
            r.close()
        for p in (owner, relayer_pool):
            p.close()


def test_idle_relay_links_go_once_their_owner_drops_the_segment(released):
    """A relayer kept a link (a file of its own in /dev/shm) to every segment it ever
    relayed: at release the owner's name still existed, and nothing looked again."""
    owner, relayer_pool = shm.ShmPool(cap=5 << 19), shm.ShmPool(cap=8 << 20)   # 2.5 MiB owner cap
    middle = shm.ShmReader(lambda *a: released.append(a))
    relay = shm.Relay(middle.locate, relayer_pool)
    try:
        for n in [1 << 20, 2300 << 10] * 8:      # neither fits the other's slot: each evicts it
            slot, sizes = _export(owner, [b"\x07" * n], readers={"middle:0": 1})
            views = middle.open("owner:0", slot.ref(), sizes)
            _places, relays = relay.plan(views, [v.nbytes for v in views], "receiver:0")
            assert relay.release("receiver:0", relays[0][0], relays[0][3])
            del views, _places
            gc.collect()
            owner.release("middle:0", slot.name, slot.generation)
        assert owner.created == 16
        assert len(relayer_pool.links) <= 4       # was 16: one per segment the owner ever had
    finally:
        relay.close()
        middle.close()
        owner.close()
        relayer_pool.close()


def test_a_receiver_that_mapped_a_link_is_not_waited_for_again(released):
    """Each relay marked the receiver as not having mapped the link yet; it says so only
    the first time, so closing waited its whole drain timeout and warned of a loss."""
    owner, relayer_pool = shm.ShmPool(cap=8 << 20), shm.ShmPool(cap=8 << 20)
    middle = shm.ShmReader(lambda *a: released.append(a))
    relay = shm.Relay(middle.locate, relayer_pool)
    try:
        slot, sizes = _export(owner, [b"\x09" * 70_000], readers={"middle:0": 1})
        views = middle.open("owner:0", slot.ref(), sizes)
        _places, first = relay.plan(views, [v.nbytes for v in views], "receiver:0")
        assert relay.unconfirmed() == ["receiver:0"]
        relay.confirm("receiver:0", first[0][0])              # its "mapped" notice
        assert relay.release("receiver:0", first[0][0], first[0][3])
        _places, again = relay.plan(views, [v.nbytes for v in views], "receiver:0")
        assert again[0][0] == first[0][0] and relay.unconfirmed() == []
        del views, _places
    finally:
        relay.close()
        middle.close()
        owner.close()
        relayer_pool.close()


def test_relayed_places_are_validated_against_their_relays():
    relay = ["rlinf-7-ff-ab-3", 0, 8192, 5]
    entries = wire.unpack_header(
        wire.pack_header("x:0", "i", [[0, 0, b"", [[0, 64, 100], 0, [0, 4096, 4096]], None, [relay]]], True), [])[2]
    (entry,) = entries
    assert entry.slot is None and entry.relays[0].pid == 7 and entry.relays[0].generation == 5
    assert entry.relays[0].private                                  # relayed slots are mapped copy-on-write
    own = ["rlinf-7-ff-ab-0", 0, 4096, 1, False]
    both = wire.unpack_header(
        wire.pack_header("x:0", "i", [[0, 0, b"", [-10, [0, 0, 10]], own, [relay]]], True), [])[2][0]
    assert both.slot.segment == "rlinf-7-ff-ab-0" and both.relays[0].segment == "rlinf-7-ff-ab-3"
    bad = [
        [[0, 0, b"", [[0, 0, 10]]]],                                      # a place without relays
        [[0, 0, b"", [[1, 0, 10]], None, [relay]]],                       # no relay 1
        [[0, 0, b"", [[0, 8190, 10]], None, [relay]]],                    # beyond the relay
        [[0, 0, b"", [[0, 0, 0]], None, [relay]]],                        # empty place
        [[0, 0, b"", [[0, -1, 10]], None, [relay]]],
        [[0, 0, b"", [[0, 0]], None, [relay]]],
        [[0, 0, b"", [[0, 0, 10]], None, []]],                            # empty relay list
        [[0, 0, b"", [[0, 0, 10]], None, [["../x", 0, 8192, 5]]]],        # not a segment name
        [[0, 0, b"", [[0, 0, 10]], None, [["rlinf-7-ff-ab-3", 10, 8192, 5]]]],   # unaligned
        [[0, 0, b"", [[0, 0, 10]], None, [["rlinf-7-ff-ab-3", 0, 8192]]]],
    ]
    for entries in bad:
        with pytest.raises(ProtocolError):
            wire.unpack_header(wire.pack_header("x:0", "i", entries, True), [])


# -- torch tensors already in shared memory, by handle (_fdshare) ---------------------------
def _shared_tensor(n: int = 1 << 16):
    torch = pytest.importorskip("torch")
    t = torch.arange(n, dtype=torch.float32)
    t.share_memory_()
    return t


def _planned(t, dst: str = "r:0"):
    """Encode ``{"t": t}`` and plan it as the communicator does: (places, relays), fds."""
    from rlinf import codec
    from rlinf.transports.shm._fdshare import FdShares

    _, buffers = codec.encode({"t": t})
    fds = FdShares()
    relay = shm.Relay(lambda *a: None, None, live=lambda: False, fds=fds)
    return relay.plan(buffers, [b.nbytes for b in buffers], dst), fds, relay


def test_shared_storages_finds_only_fd_shared_tensors():
    torch = pytest.importorskip("torch")
    from rlinf import codec
    from rlinf.transports.shm._fdshare import shared_storages

    t = _shared_tensor()
    _, buffers = codec.encode({"shared": t[10:20], "plain": torch.ones(8), "np": np.ones(8)})
    found = shared_storages(buffers)
    assert [(s.start, s.end) for s in found] == [(t.data_ptr(), t.data_ptr() + t.nbytes)]
    assert shared_storages(codec.encode({"plain": torch.ones(8)})[1]) == []
    assert shared_storages(codec.encode(np.ones(8))[1]) == []


def test_a_shared_tensor_is_planned_by_handle_and_held_until_released():
    t = _shared_tensor()
    (places, relays), fds, relay = _planned(t[100:])
    (ref,) = relays
    st = os.fstat(ref[0])
    assert ref[1:4] == [st.st_dev, st.st_ino, st.st_size] and ref[3] >= t.nbytes
    assert places == {0: [0, 400, t.nbytes - 400]}        # the view's place in the file
    assert fds.holds == 1
    assert not relay.release("r:0", "fd", ref[4] + 1)     # not ours
    assert not relay.release("other:0", "fd", ref[4])     # not that reader's
    assert relay.release("r:0", "fd", ref[4]) and fds.holds == 0
    (_, relays), fds, relay = _planned(t)
    relay.reader_gone("r:0")
    assert fds.holds == 0


def test_fd_maps_map_once_share_writes_and_check_identity():
    from rlinf.transports.shm._fdshare import FdMaps

    t = _shared_tensor()
    (places, relays), fds, _ = _planned(t)
    ref = wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [[0, *places[0][1:]]], None, relays]],
                                              True), [])[2][0].relays[0]
    assert isinstance(ref, descriptors.FdRef)
    maps = FdMaps(cap=1 << 30)
    (view,) = maps.open("x:0", ref, [(4, 8)], os.getpid())
    assert np.frombuffer(view, np.float32).tolist() == [1.0, 2.0]
    np.frombuffer(view, np.float32)[0] = -5.0             # shared: the sender's tensor sees it
    assert float(t[1]) == -5.0
    (again,) = maps.open("x:0", ref, [(0, 4)], None)       # cached: no pid needed, same mapping
    assert np.frombuffer(again, np.uint8).ctypes.data + 4 == np.frombuffer(view, np.uint8).ctypes.data
    maps.peer_gone("x:0")
    with pytest.raises(ProtocolError, match="pid is unknown"):
        maps.open("x:0", ref, [(0, 4)], None)
    forged = descriptors.FdRef(ref.fd, ref.dev, ref.ino + 1, ref.size, 1)    # another file's identity
    with pytest.raises(ProtocolError, match="is not"):
        maps.open("x:0", forged, [(0, 4)], os.getpid())
    with pytest.raises(ProtocolError, match="cannot open"):
        maps.open("x:0", descriptors.FdRef(1 << 30, 1, 1, 4096, 1), [(0, 4)], os.getpid())
    small = FdMaps(cap=ref.size)                            # bounded: the oldest goes first
    small.open("x:0", ref, [(0, 4)], os.getpid())
    other = _shared_tensor(1 << 10)
    (_, relays2), _, _ = _planned(other)
    small.open("x:0", descriptors.FdRef(*relays2[0]), [(0, 4)], os.getpid())
    assert len(small._maps) == 1 and small._bytes <= small.cap


def test_fd_references_are_validated():
    good = [3, 27, 1234, 8192, 1]
    entry = wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [[0, 0, 10]], None, [good]]], True), [])
    assert entry[2][0].relays[0] == descriptors.FdRef(3, 27, 1234, 8192, 1)
    for bad in ([3, 27, 1234, 0, 1], [-1, 27, 1234, 8192, 1], [3, 27, 1234, 8192, "x"],
                [1 << 31, 27, 1234, 8192, 1], [3, 27, 1234, 1 << 41, 1]):
        with pytest.raises(ProtocolError):
            wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [[0, 0, 10]], None, [bad]]], True), [])
    with pytest.raises(ProtocolError):     # a place beyond the file
        wire.unpack_header(wire.pack_header("x:0", "i", [[0, 0, b"", [[0, 8190, 10]], None, [good]]], True), [])


def test_recycled_memory_is_not_reused_while_a_derived_array_lives():
    """A decoded array over recycled memory (built through memoryviews and reshapes,
    which numpy bases on the memory's owner) keeps that memory out of the next take."""
    from rlinf import codec

    recycler = shm.Recycler(64 << 20)
    header, buffers = codec.encode({"x": np.full(3 << 20, 7, np.uint8).reshape(3, -1)})
    view = memoryview(recycler.take(3 << 20))
    view[:] = buffers[0]
    obj = codec.decode(header, [view])
    del view
    gc.collect()
    again = recycler.take(3 << 20)
    again[:] = 1
    assert int(obj["x"][0, 0]) == 7 and int(obj["x"][-1, -1]) == 7
    del obj, again
    gc.collect()
    assert recycler._kept >= 3 << 20        # both came back for reuse


async def test_a_slot_the_receiver_cannot_open_goes_back_to_its_sender():
    """Issue 23, finding 5: a receiver that cannot see the sender's /dev/shm (equal node
    ids for processes that do not share it) got an error for the message, but the slot
    stayed busy in the sender's pool for as long as both lived."""
    import asyncio

    loop = asyncio.get_running_loop()
    sender = shm.ShmSession(loop, lambda dst, obj: None)
    receiver = shm.ShmSession(loop, lambda dst, obj: None)
    try:
        slot, layout, _ = sender.export([memoryview(b"x" * 1000)], [1000], {"b:0": 1})
        ref = slot.ref()
        os.unlink(os.path.join(shm.SHM_DIR, ref.segment))     # as if the receiver's /dev/shm were another
        with pytest.raises(ProtocolError, match="node ids"):
            receiver.open("a:0", ref, layout, os.getpid())
        assert sender.pool.busy == 1
        sender.on_notice("b:0", receiver.take("a:0"))
        assert sender.pool.busy == 0
    finally:
        receiver.close()
        sender.close()


async def test_closing_a_peer_retires_its_slots_and_notices_and_wakes_a_send_waiting_for_it(monkeypatch):
    """What a ShmSession keeps about one peer is one ShmPeer. Closing it (the peer is
    gone) retires the slots it held, drops the notices we owed it, and ends at once a
    send waiting for room in its window; the next peer(...) for that address is new."""
    import asyncio

    from rlinf.transports.shm._session import WINDOW_SLOTS

    monkeypatch.setattr("rlinf.transports.shm._session.STALL", 30.0)    # only the close can end the wait
    loop = asyncio.get_running_loop()
    sender = shm.ShmSession(loop, lambda dst, obj: None)
    receiver = shm.ShmSession(loop, lambda dst, obj: None)
    try:
        for _ in range(WINDOW_SLOTS):
            slot, layout, _ = sender.export([memoryview(b"x" * 1000)], [1000], {"b:0": 1})
        assert sender.behind("b:0") and sender.pool.held("b:0")[0] == WINDOW_SLOTS
        waiting = asyncio.ensure_future(sender.room("b:0"))
        views = receiver.open("a:0", slot.ref(), layout, os.getpid())     # b maps a's segment: owes a notice
        assert receiver.owed == 1 and receiver.ahead("a:0") is False
        await asyncio.sleep(0)
        assert not waiting.done()

        peer = sender.peer("b:0")
        peer.close(process_gone=False)
        async with asyncio.timeout(5):
            await waiting
        assert peer.closed and not peer.holding            # woken by the close, not by the stall
        assert sender.pool.held("b:0") == (0, 0) and not sender.behind("b:0")
        assert "b:0" not in sender.peers and sender.peer("b:0") is not peer

        receiver.peer("a:0").close()
        assert receiver.owed == 0 and receiver.take("a:0") is None
        del views
    finally:
        receiver.close()
        sender.close()


async def test_a_reader_taken_for_holding_is_waited_for_again_once_a_co_reader_left(monkeypatch):
    """A reader that kept its window full past the stall is not waited for while it holds
    our slots; when the other reader of those (multicast) slots leaves, they retire, it
    holds nothing, and a later burst waits for it again (the window is not skipped)."""
    import asyncio

    from rlinf.transports.shm import _session

    monkeypatch.setattr(_session, "STALL", 0.01)
    loop = asyncio.get_running_loop()
    sender = shm.ShmSession(loop, lambda dst, obj: None)
    try:
        n = 600_000
        sender.export([memoryview(bytes(n))], [n], {"y:0": 1, "x:0": 1})
        monkeypatch.setattr(_session, "WINDOW_BYTES", int(sender.pool.held("y:0")[1] * 1.5))
        sender.export([memoryview(bytes(n))], [n], {"y:0": 1, "x:0": 1})
        assert sender.behind("y:0")
        async with asyncio.timeout(5):
            await sender.room("y:0")                   # y never gives back: taken for holding
        assert sender.peer("y:0").holding and not sender.behind("y:0")
        sender.peer("x:0").close(process_gone=True)    # the co-reader goes: both slots retire
        assert sender.pool.held("y:0") == (0, 0) and not sender.peer("y:0").holding
        sender.export([memoryview(bytes(n))], [n], {"y:0": 1})
        sender.export([memoryview(bytes(n))], [n], {"y:0": 1})
        assert sender.behind("y:0")                    # its window counts again
    finally:
        sender.close()


async def test_a_message_whose_slot_its_sender_took_back_arrives_as_lost_not_malformed():
    """The sender took its receiver for lost (a stall) while a message in shared memory
    was on its way: it retired the slot (unlinked). When the receiver reads the message
    after all, the receive raises PeerLostError (lost on its way), not DecodeError."""
    import asyncio

    import rlinf
    from rlinf.core import wire
    from rlinf.core._inbound import FrameReader

    loop = asyncio.get_running_loop()
    sender = shm.ShmSession(loop, lambda dst, obj: None)
    receiver = shm.ShmSession(loop, lambda dst, obj: None)
    try:
        slot, layout, _ = sender.export([memoryview(b"x" * 100_000)], [100_000], {"b:0": 1})
        entry = wire.unpack_header(wire.pack_header("a:0", "i", [wire.slot_entry(
            wire.USER, 0, b"h", layout, slot.to_wire())]), [])[2][0]
        sender.peer("b:0").close(process_gone=False)          # taken for lost: its slots retire
        frames = FrameReader(receiver, shm.Recycler(), lambda src: None, lambda: None)
        [rebuilt] = list(frames.entries("a:0", [entry], [], True, "i"))
        assert isinstance(rebuilt.error, rlinf.PeerLostError) and "lost on its way" in str(rebuilt.error)
    finally:
        receiver.close()
        sender.close()
