"""The weight store's pure parts: the bucket layout and copies, and the directory's
bookkeeping (visibility, readers holding versions, holders leaving)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from rlinf.errors import PeerLostError
from rlinf.util.copier import Copier
from rlinf.weights._buckets import Buckets, read_stamp
from rlinf.weights._directory import PENDING_KEPT, Directory, ShardRef
from rlinf.weights._holder import Holder, spans

from ..integration.wait import until
from rlinf.weights._layout import Layout, flatten, fresh, match, pack, unpack, unpack_range
from rlinf.weights._relay import Stream, Streams
from rlinf.weights.store import WeightStore


def _ref(holder: str = "weights.w:0") -> ShardRef:
    return ShardRef(holder, "node", "seg", 64, "key", [])


def test_layout_round_trip_through_a_bucket():
    tree = {"a": torch.randn(5, 3).t(), "b": [np.arange(7, dtype=np.int16), torch.tensor(2.5, dtype=torch.bfloat16)],
            "c": (torch.ones(0),), 1: torch.tensor([True, False])}
    layout, leaves = Layout.of(tree)
    assert all(o % 64 == 0 for o in layout.offsets)
    again = Layout.from_wire(layout.to_wire())
    assert again.key == layout.key and again.paths == layout.paths
    bucket = np.zeros(layout.total, np.uint8)
    copier = Copier(1)
    pack(layout, leaves, bucket, copier)
    out, per_layout = fresh([again])
    unpack(again, bucket, per_layout[0], list(range(len(per_layout[0]))), copier)
    assert torch.equal(out["a"], tree["a"]) and out["a"].is_contiguous()
    assert isinstance(out["b"][0], np.ndarray) and np.array_equal(out["b"][0], tree["b"][0])
    assert out["b"][1].dtype == torch.bfloat16 and float(out["b"][1]) == 2.5
    assert isinstance(out["c"], tuple) and out["c"][0].shape == (0,)
    assert torch.equal(out[1], tree[1])


def test_a_pull_into_parameters_moves_their_versions_as_copy_does():
    """Copied as bytes (contiguous CPU targets), a pull still tells autograd: a backward
    through a graph that saved the old weights is refused, whole or landed in chunks."""
    tree = {"w": torch.randn(3 << 19), "b": torch.randn(8)}          # 6 MiB: streamed where built
    layout, leaves = Layout.of(tree)
    bucket = np.zeros(layout.total, np.uint8)
    pack(layout, leaves, bucket, Copier(2))
    for whole in (True, False):
        into = {"w": torch.zeros(3 << 19, requires_grad=True), "b": torch.zeros(8, requires_grad=True)}
        loss = (into["w"] * into["w"]).sum() + (into["b"] * into["b"]).sum()
        [(targets, order)] = match([layout], flatten(into)[1])
        with torch.no_grad():
            if whole:
                unpack(layout, bucket, targets, order, Copier(2))
            else:
                unpack_range(layout, bucket, 0, layout.total, dict(zip(order, targets)), Copier(2))
        assert torch.equal(into["w"], tree["w"]) and torch.equal(into["b"], tree["b"])
        assert into["w"]._version > 0 and into["b"]._version > 0
        with pytest.raises(RuntimeError, match="inplace operation"):
            loss.backward()


def test_match_checks_everything_before_anything_is_copied():
    layout, _ = Layout.of({"x": torch.zeros(2, 2), "y": {"z": torch.zeros(3)}})
    _, targets = flatten({"y": {"z": torch.zeros(3)}, "x": torch.zeros(2, 2)})
    [(got, order)] = match([layout], targets)
    assert [layout.paths[i] for i in order] == [("y", "z"), ("x",)]
    for bad, message in [({"x": torch.zeros(2, 2)}, "y/z: published, but not"),
                         ({"x": torch.zeros(2, 2), "y": {"z": torch.zeros(3, dtype=torch.int32)}}, "y/z: the target is int32"),
                         ({"x": torch.zeros(4), "y": {"z": torch.zeros(3)}}, r"x: the target is float32\[4\]")]:
        with pytest.raises(ValueError, match=message):
            match([layout], flatten(bad)[1])
    with pytest.raises(TypeError, match="not str"):
        Layout.of({"x": "str"})


def test_chunks_cut_through_tensors_and_land_into_any_target_in_order():
    assert spans(10, 4) == [(0, 4), (4, 8), (8, 10)] and spans(0, 4) == []
    tree = {"big": torch.arange(3000, dtype=torch.float32), "t": torch.randn(40, 30).t(),
            "n": np.arange(777, dtype=np.int16), "z": torch.zeros(0)}
    layout, leaves = Layout.of(tree)
    bucket = np.zeros(layout.total, np.uint8)
    pack(layout, leaves, bucket, Copier(1))
    into = {"big": torch.zeros(3000), "t": torch.zeros(30, 40), "n": np.zeros(777, np.int16), "z": torch.zeros(0)}
    targets = dict(zip(*match([layout], flatten(into)[1])[0][::-1]))
    landing = np.zeros_like(bucket)
    cuts = [0, 5, 4000, 4001, 9000, layout.total]           # through tensors, of any size
    for lo, hi in zip(cuts, cuts[1:]):
        landing[lo:hi] = bucket[lo:hi]
        unpack_range(layout, landing, lo, hi, targets, Copier(1))
        t_end = layout.offsets[1] + layout.sizes[1]
        # the non-contiguous target gets its leaf whole, once the range that ends it landed
        assert bool(into["t"].any()) == (hi >= t_end)
    assert torch.equal(into["big"], tree["big"]) and torch.equal(into["t"], tree["t"])
    assert np.array_equal(into["n"], tree["n"])


def test_a_relay_serves_a_chunk_only_once_it_landed_in_order_and_fails_its_subscribers():
    layout, _ = Layout.of({"a": np.zeros(5 << 20, np.uint8)})          # 5 MiB: chunks of 1 MiB
    stream = Stream(7, 0, np.arange(layout.total, dtype=np.uint64).view(np.uint8)[:layout.total], layout)
    streams = Streams("r:0")
    streams.add(stream)
    assert streams.handle("d:0", ("fetch", 1, 7, 1 << 20, 2, 0)) == []        # nothing landed yet
    assert streams.handle("f:0", ("follow", 2, 7, 0)) == []
    out = stream.land((1 << 20) + 5)                                          # one chunk and a bit
    assert [(dst, m[0], m[2]) for dst, m, _ in out] == [("d:0", "chunk", 0), ("f:0", "landed", (1 << 20) + 5)]
    out = stream.land(4 << 20)
    assert [m[2] for _, m, _ in out if m[0] == "chunk"] == [1 << 20]          # window 2: one more
    assert [m[2] for _, m, _ in streams.handle("d:0", ("more", 1, 2))] == [2 << 20, 3 << 20]   # in order
    assert np.array_equal(out[0][1][3], stream.array[1 << 20:2 << 20])
    [(dst, error, _)] = [o for o in streams.handle("x:0", ("fetch", 3, 8, 1 << 20, 2, 0))]   # no such version
    assert dst == "x:0" and error[0] == "error" and error[2] == "PeerLostError"
    failed = streams.fail(7, RuntimeError("upstream gone"))
    assert sorted((dst, m[0], m[1]) for dst, m, _ in failed) == [("d:0", "error", 1), ("f:0", "error", 2)]
    assert streams.handle("d:0", ("fetch", 4, 7, 1 << 20, 2, 0))[0][1][0] == "error"     # failed: gone


def test_a_version_is_visible_when_its_last_shard_is_in_and_waiters_get_it():
    d = Directory("w")
    assert d.acquire("r:0", 1, None) is None                  # nothing yet: waits
    grants, freed = d.add_shard(1, 0, 2, _ref("weights.w:0"))
    assert (grants, freed, d.latest) == ([], [], None)
    grants, freed = d.add_shard(1, 1, 2, _ref("weights.w:1"))
    assert [g.src for g in grants] == ["r:0"] and d.latest == 1
    with pytest.raises(ValueError, match="not newer"):
        d.add_shard(1, 0, 2, _ref())
    with pytest.raises(ValueError, match="has 2 shard"):
        d.add_shard(2, 0, 3, _ref())


def test_a_read_version_is_kept_until_released():
    d = Directory("w")
    d.add_shard(1, 0, 1, _ref())
    assert d.acquire("r:0", 1, None).version.number == 1
    _, freed = d.add_shard(2, 0, 1, _ref())
    assert freed == [] and sorted(d.versions) == [1, 2]       # r:0 still reads 1
    assert [v.number for v in d.release("r:0", 1, "shm", 64)] == [1]
    assert d.release("r:0", 1) == []                          # a second release is ignored
    assert d.acquire("r:1", 2, 2) is None                     # waits for a newer one
    assert d.cancel("r:1", 2) and not d.cancel("r:1", 2)
    d.acquire("r:2", 3, None)                                 # holds 2
    assert d.add_shard(3, 0, 1, _ref())[1] == []
    assert [v.number for v in d.reader_gone("r:2")[1]] == [2]
    assert d.bytes_by_path == {"shm": 64}


def test_a_holder_gone_takes_its_versions_and_fails_the_waiting():
    d = Directory("w")
    d.add_shard(1, 0, 2, _ref("weights.w:0"))
    d.add_shard(1, 1, 2, _ref("weights.w:1"))
    assert d.acquire("r:0", 1, 1) is None
    dropped, failed = d.holder_gone("weights.w:1")
    assert [v.number for v in dropped] == [1] and failed == [("r:0", 1)] and d.latest is None
    with pytest.raises(LookupError, match="weights.w:1"):
        d.acquire("r:0", 2, None)


async def test_buckets_are_reused_kept_few_and_unlinked(tmp_path):
    buckets = Buckets(str(tmp_path))
    a = await buckets.take(100_000)
    b = await buckets.take(100_000)
    assert a.name != b.name and a.size >= 100_000 and a.array.size == a.size
    buckets.give(a)
    assert (await buckets.take(90_000)) is a                  # a free one that fits
    c = await buckets.take(100_000)
    for bucket in (a, b, c):
        buckets.give(bucket)
    assert len(buckets) == 2                                  # two kept free, the third unlinked
    assert (await buckets.take(10 << 20)).size >= 10 << 20   # another size: the free ones go
    assert len(os.listdir(tmp_path)) == 1
    buckets.close()
    assert os.listdir(tmp_path) == []


async def test_a_bucket_made_for_a_cancelled_publish_is_kept(tmp_path):
    buckets = Buckets(str(tmp_path))
    task = asyncio.create_task(buckets.take(64 << 20))
    await asyncio.sleep(0)                                    # started in its thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    made = await buckets.take(64 << 20)                       # the one made meanwhile, or a new one
    assert made.size >= 64 << 20 and len(buckets) in (1, 2)
    buckets.close()
    # the cancelled one's file is unlinked once its thread is done
    await until(lambda: not os.listdir(tmp_path), what="the cancelled bucket's file to go")


def _far(holder: str = "weights.w:0") -> ShardRef:
    return ShardRef(holder, "node-a", "seg", 64, "key", [])


def test_the_first_puller_of_a_node_relays_and_the_others_read_its_copy():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    assert not d.acquire("a:0", 1, None, "node-a").relay          # the holder's node: direct
    first = d.acquire("b:0", 1, None, "node-b")
    assert first.relay and first.via is None
    assert d.acquire("b:1", 2, None, "node-b") is None             # waits for the relay
    assert d.versions[1].readers["b:1"] == 1                       # ... holding the version
    [grant] = d.relayed("b:0", 1, {0: ("relay-seg", 64)})
    assert (grant.src, grant.req, grant.via.segments) == ("b:1", 2, {0: ("relay-seg", 64)})
    assert d.acquire("b:2", 3, None, "node-b").via is grant.via    # ready: read it at once
    assert d.relayed("b:0", 1, {0: ("x", 1)}) == []                 # once only


def test_a_failed_or_departed_relay_lets_its_node_fetch_for_itself():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    d.acquire("b:1", 2, None, "node-b")
    [grant] = d.relayed("b:0", 1, None)
    assert grant.src == "b:1" and not grant.relay and grant.via is None
    assert d.acquire("b:2", 3, None, "node-b").relay               # a new relay is chosen
    d.acquire("b:3", 4, None, "node-b")
    grants, _ = d.reader_gone("b:2")
    assert [(g.src, g.via) for g in grants] == [("b:3", None)]
    d.acquire("b:4", 5, None, "node-b")                            # relay again: b:4
    d.acquire("b:5", 6, None, "node-b")
    assert d.cancel("b:5", 6) and d.versions[1].readers["b:5"] == 0


def test_relays_form_a_chain_each_streaming_from_the_one_before_once_it_started():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    first = d.acquire("b:0", 1, None, "node-b")
    assert first.relay and first.source is None                     # from the holder
    assert d.acquire("c:0", 2, None, "node-c") is None              # waits for b:0 to start
    assert d.acquire("d:0", 3, None, "node-d") is None              # waits for c:0
    assert d.acquire("b:1", 4, None, "node-b") is None              # waits for its node's relay
    grants = d.relay_started("b:0", 1, {0: ("b-seg", 64, 5)})
    assert [(g.src, g.relay, g.source and g.source.address, g.via and g.via.address) for g in grants] == [
        ("b:1", False, None, "b:0"), ("c:0", True, "b:0", None)]   # streams, before b:0 is ready
    [grant] = d.relay_started("c:0", 1, {0: ("c-seg", 64, 6)})
    assert (grant.src, grant.source.address) == ("d:0", "c:0")
    assert d.acquire("c:1", 5, None, "node-c").via.address == "c:0"  # started: read it at once
    assert d.relayed("b:0", 1, {0: ("b-seg", 64, 5)}) == []          # ready
    assert all(d.versions[1].readers[a] == 1 for a in ("b:0", "b:1", "c:0", "c:1", "d:0"))


def test_a_failed_relay_leaves_the_chain_and_those_downstream_are_routed_around_it():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    d.acquire("c:0", 2, None, "node-c")
    d.relay_started("b:0", 1, {0: ("b-seg", 64, 5)})                # c:0 streams from b:0
    assert d.acquire("d:0", 3, None, "node-d") is None              # deferred on c:0
    assert d.acquire("b:1", 4, None, "node-b").via.address == "b:0"
    # b:1 found b:0 gone (before the directory did): it asks again naming it (and its acquire)
    assert d.relay_lost("b:0", 1, 1) == []
    assert d.versions[1].relays["node-c"].doomed                   # c:0 streams from it: will fail
    d.release("b:1", 1)
    again = d.acquire("b:1", 5, None, "node-b")
    assert again.relay and again.source is None                     # c:0 doomed: from the holder
    [grant] = d.relayed("c:0", 1, None)                              # c:0 fails: d:0 is routed anew,
    assert (grant.src, grant.relay, grant.source) == ("d:0", True, None)   # to the relays before it
    assert d.relayed("b:0", 1, {0: ("b-seg", 64, 5)}) is None        # out of the chain: its copy is not needed


def test_a_relay_that_has_it_all_stays_a_source_when_its_upstream_fails():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    d.acquire("c:0", 2, None, "node-c")
    d.relay_started("b:0", 1, {0: ("b-seg", 64, 5)})
    d.relayed("c:0", 1, {0: ("c-seg", 64, 6)})                       # c:0 got it all from b:0
    d.relay_lost("b:0", 1, 1)
    assert not d.versions[1].relays["node-c"].doomed
    assert d.acquire("d:0", 3, None, "node-d").source.address == "c:0"


def test_a_relay_waiting_for_its_upstream_can_cancel():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    assert d.acquire("c:0", 2, None, "node-c") is None
    assert d.cancel("c:0", 2) and "c:0" not in d.versions[1].readers
    assert d.relay_started("b:0", 1, {0: ("b-seg", 64, 5)}) == []     # nobody deferred any more
    assert d.acquire("c:1", 3, None, "node-c").source.address == "b:0"


def test_a_holder_gone_keeps_a_version_still_read_but_grants_it_no_more():
    d = Directory("w")
    d.add_shard(1, 0, 2, _ref("weights.w:0"))
    d.add_shard(1, 1, 2, _ref("weights.w:1"))
    assert d.acquire("r:0", 1, None).version.number == 1          # r:0 copies shard 0 from weights.w:0
    freed, failed = d.holder_gone("weights.w:1")
    assert freed == [] and failed == [] and d.latest is None       # shard 0's bucket stays while read
    assert d.versions[1].lost and d.snapshot()["versions"][1]["lost"]
    with pytest.raises(LookupError, match="weights.w:1"):
        d.acquire("r:1", 2, None)                                   # no new grants of it
    with pytest.raises(ValueError, match="lost"):
        d.add_shard(1, 1, 2, _ref("weights.w:1"))                  # a restarted shard 1 publishes anew
    assert [v.number for v in d.release("r:0", 1, "shm", 64)] == [1]     # freed when read no more


def test_a_holder_gone_fails_the_pullers_waiting_for_a_relay_of_its_version():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far("weights.w:0"))
    d.add_shard(2, 0, 1, _far("weights.w:0"))
    d.acquire("b:0", 1, None, "node-b")                             # relays 2
    assert d.acquire("b:1", 2, None, "node-b") is None              # waits for it
    freed, failed = d.holder_gone("weights.w:0")
    assert failed == [("b:1", 2)] and freed == []                   # b:0 still reads (and relays) 2
    assert dict(d.versions[2].readers) == {"b:0": 1}
    assert [v.number for v in d.reader_gone("b:0")[1]] == [2]


def test_incomplete_versions_are_bounded_while_a_shard_is_missing():
    d = Directory("w")
    freed = []
    for n in range(1, 20):                                          # shard 1 publishes nothing
        freed += d.add_shard(n, 0, 2, _ref("weights.w:0"))[1]
    assert sorted(d.versions) == list(range(20 - PENDING_KEPT, 20))
    assert [v.number for v in freed] == list(range(1, 20 - PENDING_KEPT))
    # shard 1 resumes at 18: the versions it skipped can never be complete
    grants, freed = d.add_shard(18, 1, 2, _ref("weights.w:1"))
    assert d.latest == 18 and sorted(d.versions) == [18, 19]
    assert sorted(v.number for v in freed) == list(range(20 - PENDING_KEPT, 18))
    _, freed = d.add_shard(21, 1, 2, _ref("weights.w:1"))           # 19 lacks shard 1, which is at 21
    assert [v.number for v in freed] == [19] and sorted(d.versions) == [18, 21]
    _, freed = d.add_shard(20, 0, 2, _ref("weights.w:0"))           # so does 20: freed at once
    assert [v.number for v in freed] == [20] and sorted(d.versions) == [18, 21]


async def test_every_fill_of_a_bucket_has_a_new_stamp_at_its_end(tmp_path):
    buckets = Buckets(str(tmp_path))
    a = await buckets.take(4096)                                   # room for the stamp after the data
    assert a.size >= 4096 + 8 and read_stamp(a.array) == a.stamp != 0
    first = a.stamp
    buckets.give(a)
    assert (await buckets.take(4096)) is a and a.stamp != first and read_stamp(a.array) == a.stamp
    buckets.close()


class _Core:
    """Just enough of a core for a handle that talks to nothing."""

    address = "p:0"
    info = None
    manager_address = "tcp://127.0.0.1:1"
    token = "unit-test"

    def start_send(self, *args, **kwargs):
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def check_open(self):
        pass

    def timeout_of(self, timeout):
        return timeout


async def test_grants_of_more_shards_than_layouts_kept_are_read_every_time():
    ws = WeightStore(_Core(), "big")
    layouts = [Layout.of({f"s{k}": torch.zeros(4)})[0] for k in range(20)]
    asked, evict = [], []

    async def found():
        return None

    def start(dst, op, newer_than, known, node, lost):
        asked.append(len(known))
        answer = asyncio.get_running_loop().create_future()
        answer.set_result((1, [[f"weights.big:{k}", "", f"seg{k}", layout.total, layout.key,
                                None if layout.key in known else layout.to_wire(), 0, 0]
                               for k, layout in enumerate(layouts)], "", "token"))
        if evict:                                                  # another pull evicts one meanwhile
            ws._layouts.pop(evict.pop())
        return len(asked), answer

    ws._find, ws._calls.start = found, start
    for _ in range(3):
        _, refs, _, _, _ = await ws._acquire(None)
        assert [ref[1].key for ref in refs] == [layout.key for layout in layouts]
    assert asked == [0, 20, 20]                                    # layouts sent once, then known
    evict.append(layouts[3].key)
    _, refs, _, _, _ = await ws._acquire(None)                       # asks again, taking none as known
    assert [ref[1].key for ref in refs] == [layout.key for layout in layouts] and asked[-2:] == [20, 0]


def test_releases_and_relay_reports_from_an_earlier_directory_are_ignored():
    holder = Holder(_Core(), "w", 0, 1)                            # the directory's side, not started
    d = holder.directory
    d.add_shard(1, 0, 1, _ref(holder.address))
    assert d.acquire("r:0", 1, None) is not None
    d.add_shard(2, 0, 1, _ref(holder.address))
    holder._handle("r:0", ("release", 1, "shm", 64, "an earlier directory's token"))
    assert sorted(d.versions) == [1, 2] and d.versions[1].readers["r:0"] == 1   # not its grant
    holder._handle("r:0", ("release", 1, "shm", 64, d.token))
    assert sorted(d.versions) == [2]


async def test_a_bucket_given_back_while_sent_from_is_reused_only_once_the_sends_are_done(tmp_path):
    buckets = Buckets(str(tmp_path))
    a = await buckets.take(4096)
    loop = asyncio.get_running_loop()
    sends = [loop.create_future(), loop.create_future()]      # messages holding views of a, on their way
    for send in sends:
        buckets.reading(a, send)
    buckets.give(a)
    assert (await buckets.take(4096)) is not a                 # still read: a new one
    sends[0].set_result(None)
    await asyncio.sleep(0)                                     # (done callbacks run on the next tick)
    b = await buckets.take(4096)
    assert b is not a
    sends[1].set_exception(ConnectionError("failed sends are done too"))
    sends[1].exception()
    await asyncio.sleep(0)
    assert (await buckets.take(4096)) is a                     # free once the last send is done
    buckets.close()


def test_a_relay_names_its_bucket_with_each_chunk_and_fails_those_still_attached_when_freed():
    layout, _ = Layout.of({"a": np.zeros(3 << 20, np.uint8)})
    bucket = object()
    streams = Streams("r:0")
    streams.add(Stream(7, 0, np.zeros(layout.total, np.uint8), layout, bucket))
    streams.add(Stream(8, 0, np.zeros(layout.total, np.uint8), layout))
    streams.handle("d:0", ("fetch", 1, 7, 1 << 20, 4, 0))
    streams.handle("f:0", ("follow", 2, 7, 0))
    streams.handle("e:0", ("fetch", 3, 8, 1 << 20, 4, 0))
    out = streams._by_key[7, 0].land(2 << 20)
    assert [(m[0], reads is bucket) for _, m, reads in out] == [("chunk", True), ("chunk", True), ("landed", False)]
    failed = streams.free(7, RuntimeError("the directory left"))    # a free with readers attached
    assert sorted((dst, m[0], m[1], m[2]) for dst, m, _ in failed) == [("d:0", "error", 1, "PeerLostError"),
                                                                      ("f:0", "error", 2, "PeerLostError")]
    assert [dst for dst, _, _ in streams.free(None, RuntimeError("gone"))] == ["e:0"] and not len(streams)


def test_a_report_of_a_lost_relay_names_its_acquire_and_spares_a_later_relay_at_that_address():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    d.relay_started("b:0", 1, {0: ("b-seg1", 64, 5)})
    assert d.acquire("b:1", 2, None, "node-b").via.req == 1
    d.relayed("b:0", 1, None)                                       # b:0's relay fails
    d.release("b:0", 1)
    assert d.acquire("b:0", 3, None, "node-b").relay                # and asks again first: relay again
    d.relay_started("b:0", 1, {0: ("b-seg2", 64, 6)})
    assert d.acquire("c:0", 4, None, "node-c").source.address == "b:0"
    d.release("b:1", 1)                                             # b:1 got the first one's error late
    assert d.relay_lost("b:0", 1, 1) == []                          # ... and names it
    again = d.acquire("b:1", 5, None, "node-b")
    assert again.via is not None and again.via.req == 3             # the healthy relay stays
    assert not d.versions[1].relays["node-c"].doomed
    assert d.relayed("b:0", 1, {0: ("b-seg2", 64, 6)}) == []        # its copy is kept, not freed
    d.relay_lost("b:0", 1, 3)                                       # a report of this one counts
    assert "node-b" not in d.versions[1].relays


def test_a_ready_relay_taken_out_of_the_chain_is_told_to_free_its_copy_with_the_version():
    holder = Holder(_Core(), "w", 0, 1)                            # the directory's side, not started
    sent = []
    holder._send = lambda dst, message: sent.append((dst, message))
    d = holder.directory
    d.add_shard(1, 0, 1, _far(holder.address))
    d.acquire("b:0", 1, None, "node-b")
    d.acquire("b:1", 2, None, "node-b")
    d.relayed("b:0", 1, {0: ("b-seg", 64, 5)})                      # b:0 has it all: ready
    d.release("b:0", 1)
    d.release("b:1", 1)
    d.relay_lost("b:0", 1, 1)                                       # b:1 could not read it
    _, freed = d.add_shard(2, 0, 1, _far(holder.address))
    holder._free(freed)
    assert [v.number for v in freed] == [1] and ("b:0", ("free", 1)) in sent


def test_a_relay_routed_anew_around_a_failed_upstream_is_a_source_again():
    d = Directory("w")
    d.add_shard(1, 0, 1, _far())
    d.acquire("b:0", 1, None, "node-b")
    assert d.acquire("c:0", 2, None, "node-c") is None              # deferred on b:0
    assert d.acquire("x:0", 3, None, "node-x") is None              # deferred on c:0
    [grant] = d.relayed("b:0", 1, None)                             # b:0 fails before it started
    assert (grant.src, grant.source) == ("c:0", None)               # c:0 streams from the holder now
    relays = d.versions[1].relays
    assert not relays["node-c"].doomed and not relays["node-x"].doomed
    [grant] = d.relay_started("c:0", 1, {0: ("c-seg", 64, 6)})
    assert (grant.src, grant.source.address) == ("x:0", "c:0")
    d.relay_started("x:0", 1, {0: ("x-seg", 64, 7)})
    assert d.acquire("e:0", 4, None, "node-e").source.address == "x:0"   # the chain goes on


async def test_a_pull_tells_the_directory_of_each_lost_relay_once_naming_its_acquire():
    ws = WeightStore(_Core(), "lost")
    layout = Layout.of({"w": torch.zeros(4)})[0]
    told, attempts = [], []

    async def acquire(newer_than, lost=None):
        told.append(list(lost or []))
        relay_req = 10 + len(told)                                 # a new relay at b:0 every time
        return 1, [("b:0", layout, "node-b", "seg", layout.total, 5, relay_req)], 0, "", "token"

    async def copy(number, refs, plans, epoch, role, token):
        attempts.append(refs[0][6])
        if len(attempts) < 3:
            raise PeerLostError("b:0, the relay, stopped", peer="b:0")

    ws._acquire, ws._copy = acquire, copy
    assert (await ws.get(timeout=10))[1] == 1
    assert told == [[], [(1, "b:0", 11)], [(1, "b:0", 12)]]
