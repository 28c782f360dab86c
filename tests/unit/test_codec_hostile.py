"""rlinf.codec: every decode failure is a DecodeError (fast, bounded); encode errors name paths."""

from __future__ import annotations

import dataclasses
import random
import struct
import sys
import time
import tracemalloc
import types
import typing

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlinf.codec import Codec, Limits, TypeRegistry, decode, encode
from rlinf.errors import DecodeError, EncodeError

PREFIX = b"\xc1RL\x01"
SAFE = Codec(allow_pickle=False)  # hostile input never reaches pickle or import


def sample() -> typing.Any:
    from tests.unit.test_codec import Batch, Color, Point

    return {
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4), "bf": torch.ones(3, dtype=torch.bfloat16),
        "a": np.arange(6, dtype=">i4").reshape(2, 3), "s": np.float32(2.5), "big": 2**90,
        "tup": (1, (2.5, "x")), "nt": Point(1, 2), "dc": Batch(obs=[1, 2]), "e": Color.RED,
        "blob": b"b" * 2000, "keys": {(1, 2): 3, frozenset({1}): 4}, "set": {1, 2},
    }


def ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


def expect_decode_error(header: typing.Any, buffers: typing.Any, codec: Codec = SAFE,
                        match: str | None = None) -> DecodeError:
    with pytest.raises(DecodeError, match=match) as ei:
        codec.decode(header, buffers)
    assert isinstance(ei.value, ValueError)
    return ei.value


# --------------------------------------------------------------------------------------
# decode: malformed frames


def test_truncated_headers():
    header, bufs = encode(sample())
    for n in range(len(header)):
        expect_decode_error(header[:n], bufs)


def test_wrong_version_and_not_a_header():
    header, bufs = encode([1, 2])
    expect_decode_error(b"\xc1RL\x02" + header[4:], bufs, match="version 2")
    expect_decode_error(msgpack.packb([1, 2]), [], match="not an rlinf codec header")
    expect_decode_error(b"", [], match="not an rlinf")


@pytest.mark.parametrize("header", ["a str", None, 42, [b"\xc1RL\x01"], object()])
def test_wrong_types(header):
    expect_decode_error(header, [])
    expect_decode_error(encode(1)[0], None)  # buffers must be a sequence


def test_buffer_count_mismatch():
    header, bufs = encode({"a": np.arange(3), "b": torch.zeros(2)})
    expect_decode_error(header, bufs[:1], match="more than the 1 buffers")
    expect_decode_error(header, [], match="more than the 0 buffers")
    expect_decode_error(header, bufs + [b"extra"], match="uses 2 buffers but 3")


def test_buffer_size_mismatch():
    header, bufs = encode({"a": np.arange(3, dtype=np.int64), "t": torch.zeros(4)})
    expect_decode_error(header, [bytes(23), bufs[1]], match="holds 23 bytes but its header declares 24")
    expect_decode_error(header, [bufs[0], bytes(17)], match="declares 16")
    expect_decode_error(header, [bufs[0], memoryview(bytearray(15))], match="declares 16")
    expect_decode_error(header, [bufs[0], b""])
    h2, b2 = encode(np.zeros(0))
    expect_decode_error(h2, [b"x"], match="declares 0")


def test_non_contiguous_or_odd_buffers():
    header, bufs = encode(np.arange(4, dtype=np.uint8))
    expect_decode_error(header, [memoryview(bytes(8))[::2]], match="not contiguous")
    expect_decode_error(header, [12345])


def test_deep_nesting_bomb_fails_fast():
    for body in (b"\x91" * 200_000 + b"\xc0", b"\x81\xa1a" * 100_000 + b"\xc0",
                 (b"\x92" + ext(32, b"")) * 5000 + b"\xc0"):
        t0 = time.perf_counter()
        expect_decode_error(PREFIX + body, [])
        assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("body", [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
], ids=["array", "map", "str", "bin", "ext"])
def test_huge_declared_lengths_fail_without_allocating(body):
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        expect_decode_error(PREFIX + body, [])
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20


def test_huge_declared_shapes_fail_without_allocating():
    big = struct.pack("<BBbB2Q", 7, 0, -1, 2, 2**40, 2**40)  # float32 (2^40, 2^40)
    nd = struct.pack("<BB2Q", 0, 2, 2**31, 2**31) + b"<f8"
    overflow = struct.pack("<BBbB3Q", 7, 0, -1, 3, 2**63, 2**63, 2**63)
    tracemalloc.start()
    try:
        for header in (PREFIX + ext(5, big), PREFIX + ext(4, nd), PREFIX + ext(5, overflow)):
            expect_decode_error(header, [b"\x00" * 16], match="exceed Limits.max_buffer_bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    zero_but_huge = struct.pack("<BB2Q", 0, 2, 0, 2**62) + b"<f8"
    expect_decode_error(PREFIX + ext(4, zero_but_huge), [b""])


def test_limits_are_enforced_on_decode():
    header, bufs = encode({"a": list(range(100)), "arrs": [np.zeros(10)] * 3})
    codec = Codec(limits=Limits(max_items=40))     # 100 > 2 * 40 + 1 msgpack elements
    expect_decode_error(header, bufs, codec=codec)
    expect_decode_error(header, bufs, codec=Codec(limits=Limits(max_buffers=2)), match="max_buffers")
    expect_decode_error(header, bufs, codec=Codec(limits=Limits(max_header_bytes=100)),
                        match="max_header_bytes")
    expect_decode_error(header, bufs, codec=Codec(limits=Limits(max_buffer_bytes=79)),
                        match="max_buffer_bytes")
    h5, b5 = encode(np.zeros((1,) * 5))
    expect_decode_error(h5, b5, codec=Codec(limits=Limits(max_ndim=4)), match="max_ndim")
    blob_h, blob_b = encode(b"x" * 5000)
    expect_decode_error(blob_h, blob_b, codec=Codec(limits=Limits(max_buffer_bytes=4000)))
    expect_decode_error(blob_h, [bytes(5000)], codec=Codec(limits=Limits(max_buffer_bytes=4000)))


def test_what_one_side_accepts_the_other_accepts_under_the_same_limits():
    """The docs promise a sender fails before a receiver with its limits would refuse."""
    for limits, obj in [(Limits(max_items=10), tuple(range(10))), (Limits(max_items=10), {(i,): i for i in range(10)}),
                        (Limits(max_ndim=4), np.zeros((1,) * 4)), (Limits(max_buffer_bytes=5000), b"x" * 5000)]:
        codec = Codec(limits=limits)
        codec.decode(*codec.encode(obj))
    for limits, obj in [(Limits(max_items=10), tuple(range(11))), (Limits(max_ndim=4), np.zeros((1,) * 5)),
                        (Limits(max_ndim=4), torch.zeros((1,) * 5)), (Limits(max_buffer_bytes=4000), b"x" * 5000),
                        (Limits(max_buffer_bytes=4000), bytearray(5000)),
                        (Limits(max_buffer_bytes=4000), memoryview(b"x" * 5000))]:
        with pytest.raises(EncodeError):
            Codec(limits=limits).encode(obj)


def test_pickle_node_is_refused_without_pickle():
    class_header, bufs = encode({"obj": types.SimpleNamespace(a=1)})
    expect_decode_error(class_header, bufs, match="allow_pickle=False")
    # a malicious stream is never run
    evil = b"cos\nsystem\n(S'echo pwned'\ntR."
    expect_decode_error(PREFIX + ext(15, struct.pack("<IB", 0, 0) + evil), [], match="allow_pickle")


def test_no_import_without_pickle():
    fake = "rlinf_codec_test_not_loaded"
    assert fake not in sys.modules
    for code in (33, 34, 40):
        expect_decode_error(PREFIX + b"\x92" + ext(code, f"{fake}:Thing".encode()) + b"\x01", [],
                            match="not loaded")
    expect_decode_error(PREFIX + ext(14, f"{fake}:E\x00A".encode()), [], match="not loaded")
    assert fake not in sys.modules


def test_class_paths_must_name_the_right_kind_of_class():
    for path in (b"os:system", b"builtins:dict", b"collections:OrderedDict", b"rlinf.codec:Codec"):
        for code in (33, 34, 40):
            expect_decode_error(PREFIX + b"\x92" + ext(code, path) + b"\x01", [], match="is not a")
    expect_decode_error(PREFIX + b"\x92" + ext(34, b"tests.unit.test_codec:Nope") + b"\x01", [],
                        match="not found")
    expect_decode_error(PREFIX + b"\x92" + ext(34, b"no-colon") + b"\x01", [], match="bad class path")


def test_dataclass_fields_must_match():
    header, bufs = encode(sample()["dc"])
    assert b"obs" in header
    expect_decode_error(header.replace(b"obs", b"xyz"), bufs, match="do not match")
    expect_decode_error(header.replace(b"\xa5extra", b"\xa3obs"), bufs, match="do not match")


def test_registered_name_unknown_to_receiver():
    class Thing:
        pass

    reg = TypeRegistry()
    reg.register(Thing, lambda t: 1, lambda v: Thing(), name="thing")
    header, bufs = Codec(registry=reg).encode(Thing())
    expect_decode_error(header, bufs, match="not in this codec's TypeRegistry")


@pytest.mark.parametrize("payload", [
    ext(99, b""),  # unknown code
    b"\xd4\xfbx",  # negative extension code (fixext 1, type -5)
    ext(32, b""),  # a tag outside a list
    b"\x92\x01" + ext(32, b""),  # a tag not in first position
    b"\x81" + ext(32, b"") + b"\x01",  # a tag as a key
    b"\x91" + ext(32, b"junk"),  # a simple tag with a payload
    b"\x92" + ext(35, b"") + b"\x01",  # dict pairs with an odd count
    b"\x93" + ext(37, b"") + b"\x90\x90",  # unhashable set items
    b"\x93" + ext(39, b"x") + b"\x01\x02",  # registered with two payloads
    ext(2, b"\x07"),  # bad out-of-band bytes kind
    ext(4, b"\x00\x01"),  # ndarray descriptor cut short
    ext(4, struct.pack("<BBQ", 0, 1, 1) + b"|O"),  # object dtype: never from raw bytes
    ext(4, struct.pack("<BBQ", 0, 1, 1) + b"V8"),
    ext(4, struct.pack("<BBQ", 0, 1, 1) + b"<U0"),
    ext(4, struct.pack("<BBQ", 0, 1, 1) + b"not a dtype"),
    ext(4, struct.pack("<BBQ", 0, 1, 1) + b"<f4" * 20),
    ext(5, struct.pack("<BBbB", 250, 0, -1, 0)),  # unknown torch dtype code
    ext(5, struct.pack("<BBbB", 7, 0, -1, 200)),  # ndim beyond limits
    ext(5, struct.pack("<BBbB1Q", 7, 0, -1, 2, 1)),  # shape shorter than ndim
    ext(5, struct.pack("<BBbB", 5, 1, -1, 0)),  # requires_grad on an int tensor
    ext(7, b"\x03<f4\x00"),  # numpy scalar with the wrong size
    ext(7, b"\x02|O" + b"\x00" * 8),
    ext(8, b"torch.nothing"), ext(8, b"os.system"), ext(9, b"\x00" * 7), ext(10, b"cuda:x"),
    ext(11, b"|O"), ext(12, b"\x00" * 15), ext(13, b"\x09" + b"\x00" * 20), ext(13, b"\x03\x00"),
    ext(13, struct.pack("<BHBBBBBIBq", 0, 2020, 13, 1, 0, 0, 0, 0, 0, -(1 << 63))),
    ext(14, b"no-separator"), ext(14, b"tests.unit.test_codec:Color\x00PURPLE"),
    b"\xa2\xff\xfe",  # invalid UTF-8
    b"\x01\x02",  # trailing data
])
def test_malformed_payloads(payload):
    for buffers in ([], [b"\x00" * 8]):  # fails whether or not it would take a buffer
        expect_decode_error(PREFIX + payload, buffers)


def test_device_buffer_where_host_data_is_declared_is_rejected_or_handled():
    header, bufs = encode(np.arange(4, dtype=np.uint8))
    # a CPU torch tensor is fine as a host buffer
    assert list(SAFE.decode(header, [torch.arange(4, dtype=torch.uint8)])) == [0, 1, 2, 3]
    expect_decode_error(header, [torch.zeros(2, 2)])  # wrong size


# --------------------------------------------------------------------------------------
# fuzzing: random and mutated headers never raise anything but DecodeError


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes(body, bufs):
    for header in (body, PREFIX + body):
        try:
            SAFE.decode(header, bufs)
        except DecodeError:
            pass


@pytest.fixture(scope="module")
def valid_message():
    return encode(sample())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_headers(valid_message, data):
    header, bufs = valid_message
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    mutated = bytearray(header)
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        pos = rng.randrange(4, len(mutated))
        if kind < 0.6:
            mutated[pos] = rng.randrange(256)
        elif kind < 0.8:
            del mutated[pos]
        else:
            mutated.insert(pos, rng.randrange(256))
    buffers = [bytes(b) for b in bufs]
    if rng.random() < 0.3:
        buffers = buffers[: rng.randrange(len(buffers) + 1)]
    try:
        SAFE.decode(bytes(mutated), buffers)
    except DecodeError:
        pass


# --------------------------------------------------------------------------------------
# encode errors


class Opaque:
    pass


@dataclasses.dataclass
class Holder:
    items: typing.Any
    name: str = "h"


class Tup(typing.NamedTuple):
    first: typing.Any
    second: typing.Any


def test_unknown_type_without_pickle_names_the_path():
    codec = Codec(allow_pickle=False)
    cases = [
        ({"batch": {"obs": [1, 2, 3, Opaque()]}}, '$["batch"]["obs"][3]'),
        ([(0, {5: Opaque()})], "$[0][1][5]"),
        ({"h": Holder(items=[Opaque()])}, '$["h"].items[0]'),
        (Tup(1, {"x": Opaque()}), '$.second["x"]'),
        ({"k": {frozenset({1}): [Opaque()]}}, '$["k"][frozenset({1})][0]'),
        ({"s": {Opaque()}}, '$["s"][0]'),
        ({'quote"d': Opaque()}, '$["quote\\"d"]'),
        (Opaque(), "$"),
    ]
    for obj, path in cases:
        with pytest.raises(EncodeError) as ei:
            codec.encode(obj)
        assert ei.value.path == path, obj
        assert isinstance(ei.value, TypeError)
        assert "Opaque" in str(ei.value) and path in str(ei.value)


def test_local_classes_cannot_be_rebuilt():
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(EncodeError, match="inside a function"):
        Codec(allow_pickle=False).encode([Local(1)])
    with pytest.raises(EncodeError, match="Local"):  # pickle cannot do it either
        encode([Local(1)])


@pytest.mark.parametrize("make", [
    lambda: (lambda x: (x.append(x), x)[1])([]),
    lambda: (lambda d: (d.__setitem__("self", d), d)[1])({}),
    lambda: (lambda x: (x.append((1, x)), x)[1])([]),
    lambda: (lambda h: (h.items.append(h), h)[1])(Holder(items=[])),
    lambda: (lambda d: (d.__setitem__("k", {"inner": [d]}), d)[1])({}),
])
def test_cycles_raise_encode_error(make):
    obj = make()
    for codec in (Codec(), Codec(allow_pickle=False)):
        with pytest.raises(EncodeError, match="cycle"):
            codec.encode(obj)


def test_depth_limit():
    codec = Codec(limits=Limits(max_depth=20))
    ok = []
    for _ in range(19):
        ok = [ok]
    codec.decode(*codec.encode(ok))
    with pytest.raises(EncodeError, match="max_depth=20"):
        codec.encode([ok])
    deep: typing.Any = 1
    for _ in range(300):
        deep = {"d": (deep,)}
    with pytest.raises(EncodeError, match="max_depth"):
        encode(deep)
    nested = 0
    for _ in range(Limits().max_depth - 1):
        nested = (nested,)
    assert decode(*encode(nested)) == nested  # exactly at the default limit works


def test_encode_side_limits():
    with pytest.raises(EncodeError, match="max_buffer_bytes"):
        Codec(limits=Limits(max_buffer_bytes=100)).encode({"a": np.zeros(100)})
    with pytest.raises(EncodeError, match="max_buffers"):
        Codec(limits=Limits(max_buffers=2)).encode([np.zeros(1)] * 3)
    with pytest.raises(EncodeError, match="max_header_bytes"):
        Codec(limits=Limits(max_header_bytes=1000)).encode(["x" * 100] * 20)
    with pytest.raises(EncodeError, match="max_items"):
        Codec(limits=Limits(max_items=10)).encode({"l": [[]] * 11})


def test_failing_registered_encoder_is_reported_with_path():
    def boom(obj):
        raise RuntimeError("boom")

    reg = TypeRegistry()
    reg.register(Opaque, boom, lambda v: Opaque())
    with pytest.raises(EncodeError, match="boom") as ei:
        Codec(registry=reg).encode({"x": [Opaque()]})
    assert ei.value.path == '$["x"][0]' and isinstance(ei.value.__cause__, RuntimeError)


def _ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


def test_class_paths_and_dtype_names_never_reach_a_lazy_module_getattr(monkeypatch):
    """torch and numpy import submodules from their module ``__getattr__``: a peer naming
    one must not make us import it (or run anything) with allow_pickle=False."""
    touched = []
    lazy = types.ModuleType("rlinf_lazy_test_module")
    lazy.__getattr__ = lambda name: touched.append(name) or type(name, (), {})
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)
    with pytest.raises(DecodeError, match="not found"):
        SAFE.decode(PREFIX + b"\x92" + _ext(33, f"{lazy.__name__}:Thing".encode()) + b"\x01", [])
    assert touched == []
    before = "torch._dynamo" in sys.modules
    with pytest.raises(DecodeError, match="unknown torch dtype"):
        SAFE.decode(PREFIX + _ext(8, b"torch._dynamo"), [])
    assert ("torch._dynamo" in sys.modules) == before
    header, buffers = SAFE.encode(torch.bfloat16)
    assert SAFE.decode(header, buffers) is torch.bfloat16


def test_many_colliding_big_int_keys_are_refused_not_hashed_for_minutes():
    modulus = (1 << 61) - 1                        # hash(int) is the int modulo this
    n = 4000
    body = b"\xde" + n.to_bytes(2, "big") + b"".join(
        _ext(1, ((1 << 64) + k * modulus).to_bytes(10, "big", signed=True)) + b"\xc0" for k in range(n))
    t0 = time.perf_counter()
    with pytest.raises(DecodeError, match="beyond 64 bits"):
        SAFE.decode(PREFIX + body, [])
    assert time.perf_counter() - t0 < 1.0          # was ~0.2 s at 4000 keys, quadratic beyond
    few = {(1 << 70) + k: k for k in range(100)}   # a reasonable number still round-trips
    assert SAFE.decode(*SAFE.encode(few)) == few
