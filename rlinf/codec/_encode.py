"""The encoder: one walk over the object that collects buffers and builds the msgpack tree.

Dispatch is on ``type(obj)``: str/int/float/bool/None pass through, dict/list/tuple are
handled inline (one Python frame per nesting level), every other type through a per-codec
dict of handlers that :func:`classify` fills on first sight of a type. Handlers return
the msgpack value for the object and append its raw buffers to ``_Enc.bufs`` in the order
the header will list them (keys before values, items in order).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import datetime as _dt
import enum
import pickle
import struct
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from . import _wire as W
from ._wire import NATIVE, Fail, ext, tuple_new

if TYPE_CHECKING:
    from . import Codec

_ExtType = W.ExtType
_TAG_TUPLE, _TAG_DICT, _TAG_ODICT = ext(W.T_TUPLE), ext(W.T_DICT), ext(W.T_ODICT)
_TAG_SET, _TAG_FROZENSET = ext(W.T_SET), ext(W.T_FROZENSET)
OOB_BYTES, _OOB_BYTEARRAY = ext(W.X_OOB, b"\x00"), ext(W.X_OOB, b"\x01")
_INLINE_MAX = W.INLINE_MAX


class Enc:
    """Per-call encoder state: the buffers collected so far and the containers on the path."""

    __slots__ = ("bufs", "active", "codec", "dispatch", "allow_pickle", "max_depth",
                 "max_items", "max_bytes", "max_ndim", "whole", "owners")

    def __init__(self, codec: Codec) -> None:
        lim = codec._limits
        self.bufs: list = []
        self.active: set = set()
        self.whole: memoryview | None = None  # see arena()
        self.owners: list = []
        self.codec, self.dispatch, self.allow_pickle = codec, codec._dispatch, codec._allow_pickle
        self.max_depth, self.max_items, self.max_bytes, self.max_ndim = (
            lim.max_depth, lim.max_items, lim.max_buffer_bytes, lim.max_ndim)

    def enter(self, obj: Any, n: int, depth: int) -> int:
        if depth >= self.max_depth:
            raise Fail(f"nesting deeper than Limits.max_depth={self.max_depth}")
        if n > self.max_items:
            raise Fail(f"{n} items exceed Limits.max_items={self.max_items}")
        oid = id(obj)
        if oid in self.active:
            raise Fail(f"reference cycle: this {type(obj).__name__} contains itself")
        self.active.add(oid)
        return oid

    def arena(self) -> memoryview:
        """A "B" memoryview of the whole address space, made once per message and sliced
        for each CPU tensor's bytes: one ctypes object per message instead of one per
        tensor (``t.numpy()`` costs ~2 us, a ctypes object ~0.6 us, a slice ~0.1 us). The
        message's tensors hang on it, so every buffer keeps its tensor (and the message's
        other tensors) alive. No byte outside the tensors is ever read."""
        c = _ADDRESS_SPACE.from_address(0)
        c._rlinf_owners = self.owners
        self.whole = memoryview(c).cast("B")
        return self.whole

    def enc(self, obj: Any, depth: int) -> Any:
        """The msgpack value for ``obj``; its buffers are appended to ``self.bufs``."""
        t = type(obj)
        if t in NATIVE:
            return obj
        if t is dict:
            oid = self.enter(obj, len(obj), depth)
            depth += 1
            out: dict = {}
            pairs = None
            enc = self.enc
            k = None
            try:
                for k, v in obj.items():
                    if pairs is None:
                        if type(k) in NATIVE:
                            out[k] = v if type(v) in NATIVE else enc(v, depth)
                            continue
                        pairs = [_TAG_DICT]  # a non-scalar key: a tagged list of pairs
                        for kv in out.items():
                            pairs.extend(kv)
                    pairs.append(k if type(k) in NATIVE else enc(k, depth))
                    pairs.append(v if type(v) in NATIVE else enc(v, depth))
            except Fail as e:
                e.segs.append((k, None))
                raise
            self.active.discard(oid)
            return out if pairs is None else pairs
        if t is list:
            if NATIVE.issuperset(map(type, obj)) and depth < self.max_depth \
                    and len(obj) <= self.max_items:
                return obj  # only scalars: no copy, and no cycle is possible
            return self.seq(None, obj, depth)
        if t is tuple:
            return self.seq(_TAG_TUPLE, obj, depth)
        h = self.dispatch.get(t) or classify(self.codec, t)
        try:
            return h(self, obj, depth)
        except Fail:
            raise
        except Exception as exc:  # a torch/numpy/user-hook error: report it with the path
            raise Fail(f"cannot encode {t.__qualname__}: {exc!r}", exc) from None

    def seq(self, tag: Any, items: Any, depth: int, names: Sequence[str] | None = None,
            owner: Any = None) -> list:
        """``[tag, *encoded items]`` (a plain list when ``tag`` is None) for ``owner``
        (default ``items``); ``names`` label the items in error paths."""
        oid = self.enter(items if owner is None else owner, len(items), depth)
        depth += 1
        out = [] if tag is None else [tag]
        enc = self.enc
        i = 0
        try:
            for i, v in enumerate(items):
                out.append(v if type(v) in NATIVE else enc(v, depth))
        except Fail as e:
            e.segs.append(names[i] if names else (i,))
            raise
        self.active.discard(oid)
        return out

    def pairs(self, tag: Any, obj: Any, items: Any, depth: int, names: Any = None) -> list:
        """``[tag, k1, v1, k2, v2, ...]`` for ``items`` (key, value) of ``obj``; keys are
        field ``names`` (path ``.name``) or mapping keys (path ``[key]``)."""
        oid = self.enter(obj, len(items), depth)
        depth += 1
        out = [tag]
        enc = self.enc
        k = None
        try:
            for k, v in items:
                out.append(k if type(k) in NATIVE else enc(k, depth))
                out.append(v if type(v) in NATIVE else enc(v, depth))
        except Fail as e:
            e.segs.append(k if names else (k, None))
            raise
        self.active.discard(oid)
        return out


def pack_default(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: ints beyond 64 bits."""
    if type(obj) is int:
        return ext(W.X_BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "big", signed=True))
    raise TypeError(f"unexpected {type(obj).__qualname__} in the encoded tree")


def _fallback(st: Enc, obj: Any, depth: int, what: str) -> Any:
    if st.allow_pickle:
        return _enc_pickle(st, obj, depth)
    raise Fail(f"cannot encode {what} without pickle (allow_pickle=False)")


def _enc_bytes(st: Enc, obj: bytes, depth: int) -> Any:
    if len(obj) <= _INLINE_MAX:
        return obj
    if len(obj) > st.max_bytes:
        _check_size(st, len(obj))
    st.bufs.append(memoryview(obj))
    return OOB_BYTES


def _enc_bytearray(st: Enc, obj: bytearray, depth: int) -> Any:
    if len(obj) <= _INLINE_MAX:
        return ext(W.X_BYTEARRAY, bytes(obj))
    if len(obj) > st.max_bytes:
        _check_size(st, len(obj))
    st.bufs.append(memoryview(obj))
    return _OOB_BYTEARRAY


def _enc_memoryview(st: Enc, obj: memoryview, depth: int) -> Any:
    if not obj.c_contiguous:
        return _enc_bytes(st, obj.tobytes(), depth)
    mv = obj if obj.ndim == 1 and obj.format == "B" else obj.cast("B")
    if mv.nbytes <= _INLINE_MAX:
        return mv.tobytes()
    if mv.nbytes > st.max_bytes:
        _check_size(st, mv.nbytes)
    st.bufs.append(mv)
    return OOB_BYTES


def _check_size(st: Enc, n: int) -> None:
    if n > st.max_bytes:
        raise Fail(f"{n} bytes exceed Limits.max_buffer_bytes={st.max_bytes}")


def _enc_ndarray(st: Enc, a: np.ndarray, depth: int) -> Any:
    if a.ndim > st.max_ndim:
        raise Fail(f"{a.ndim} dimensions exceed Limits.max_ndim={st.max_ndim}")
    code = W.np_code(a.dtype)
    if code is None:
        return _fallback(st, a, depth, f"a numpy array of dtype {a.dtype}")
    flags = 0
    if a.flags.c_contiguous:
        src = a
    elif a.ndim > 1 and a.flags.f_contiguous:
        src, flags = a.T, W.F_FORTRAN  # ship the C-ordered transpose; decode transposes back
    else:
        src = np.ascontiguousarray(a)
    n = a.nbytes
    if n > st.max_bytes:
        _check_size(st, n)
    if n == 0:
        mv = W.EMPTY
    elif a.dtype.kind in "Mm":  # datetime64 cannot export a buffer; its bytes can
        mv = memoryview(src.reshape(-1).view(W.U8))
    else:
        try:
            mv = memoryview(src).cast("B")
        except ValueError:   # long double in the non-native byte order cannot either
            mv = memoryview(src.reshape(-1).view(W.U8))
    st.bufs.append(mv)
    shape = a.shape
    return tuple_new(_ExtType, (W.X_NDARRAY, W.NS[len(shape)].pack(flags, len(shape), *shape) + code))


def _enc_npscalar(st: Enc, obj: np.generic, depth: int) -> Any:
    dt = obj.dtype
    raw = obj.tobytes()
    if dt.itemsize == 0:   # np.str_("") / np.bytes_(b""): one NUL character reads back as empty
        dt = np.dtype(dt.str[:-1] + "1")
        raw = bytes(dt.itemsize)
    code = W.np_code(dt)
    if code is None:
        return _fallback(st, obj, depth, f"numpy scalar {type(obj).__name__}")
    return ext(W.X_NPSCALAR, bytes([len(code)]) + code + raw)


def _enc_npdtype(st: Enc, dt: np.dtype, depth: int) -> Any:
    code = W.np_code(dt)
    if code is None:
        return _fallback(st, dt, depth, f"numpy dtype {dt}")
    return ext(W.X_NPDTYPE, code)


def _shape_packer(ndim: int) -> Callable:
    """``f(code, flags, device, shape)`` packing a torch descriptor. Generated per ndim:
    ``pack(*shape)`` on a torch.Size costs twice as much as indexing it."""
    pack = W.TS[ndim].pack
    if ndim > 8:
        return lambda a, b, c, s: pack(a, b, c, ndim, *s)
    items = "".join(f", s[{i}]" for i in range(ndim))
    return eval(f"lambda a, b, c, s: pack(a, b, c, {ndim}{items})", {"pack": pack})


_PACK_T = [_shape_packer(n) for n in range(65)]
_TORCH_ENC = W.TORCH_ENC
_ADDRESS_SPACE = ctypes.c_char * (1 << 62)  # a type only: nothing is allocated or read
_STRIDED: Any = None  # torch.strided, once torch is loaded


def _enc_torch(st: Enc, t: Any, depth: int) -> Any:
    desc = _TORCH_ENC.get(t.dtype)
    if desc is None or not t.is_cpu or t.layout is not _STRIDED:
        return _enc_torch_other(st, t, depth, desc)
    if not t.is_contiguous() or t.is_neg() or (desc[2] and t.is_conj()):
        t = t.contiguous().resolve_conj().resolve_neg()  # lazy conj/neg views: materialize
    shape = t.shape
    if len(shape) > st.max_ndim:
        raise Fail(f"{len(shape)} dimensions exceed Limits.max_ndim={st.max_ndim}")
    n = t.nbytes
    if n:
        if n > st.max_bytes:
            _check_size(st, n)
        whole = st.whole
        if whole is None:
            whole = st.arena()
        p = t.data_ptr()
        st.owners.append(t)
        st.bufs.append(whole[p:p + n])
    else:
        st.bufs.append(W.EMPTY)
    return tuple_new(_ExtType, (W.X_TORCH, _PACK_T[len(shape)](desc[0], t.requires_grad, -1, shape)))


def _enc_torch_other(st: Enc, t: Any, depth: int, desc: tuple | None) -> Any:
    if desc is not None and t.layout is _STRIDED and t.is_cuda:
        return _enc_torch_device(st, t, desc)
    return _fallback(st, t, depth, f"a torch tensor ({t.dtype}, {t.layout}, {t.device})")


def _enc_torch_device(st: Enc, t: Any, desc: tuple) -> Any:
    flat = t.detach() if t.requires_grad else t
    if not flat.is_contiguous() or flat.is_neg() or (desc[2] and flat.is_conj()):
        flat = flat.contiguous().resolve_conj().resolve_neg()
    n = flat.nbytes
    if n > st.max_bytes:
        _check_size(st, n)
    st.bufs.append(flat.view(-1).view(W.TORCH.uint8))  # stays on its device: no copy
    return ext(W.X_TORCH, _PACK_T[t.dim()](desc[0], t.requires_grad, t.device.index or 0, t.shape))


def _enc_cupy(st: Enc, a: Any, depth: int) -> Any:
    code = W.np_code(np.dtype(a.dtype))
    if code is None:
        return _fallback(st, a, depth, f"a cupy array of dtype {a.dtype}")
    cp = sys.modules["cupy"]
    _check_size(st, a.nbytes)
    st.bufs.append(cp.ascontiguousarray(a).reshape(-1).view(cp.uint8))
    shape = a.shape
    return ext(W.X_CUPY, W.CS[len(shape)].pack(a.device.id, len(shape), *shape) + code)


def _enc_tsize(st: Enc, s: Any, depth: int) -> Any:
    if len(s) > 64:
        raise Fail(f"torch.Size with {len(s)} dims (at most 64)")
    return ext(W.X_TSIZE, W.TSIZES[len(s)].pack(*s))


def _enc_tdtype(st: Enc, dt: Any, depth: int) -> Any:
    return ext(W.X_TDTYPE, str(dt).encode())


def _enc_tdevice(st: Enc, dev: Any, depth: int) -> Any:
    return ext(W.X_TDEVICE, str(dev).encode())


def _enc_complex(st: Enc, z: complex, depth: int) -> Any:
    return ext(W.X_COMPLEX, struct.pack("<dd", z.real, z.imag))


def _enc_set(st: Enc, s: Any, depth: int) -> Any:
    return st.seq(_TAG_SET if type(s) is set else _TAG_FROZENSET, s, depth)


def _enc_odict(st: Enc, d: Any, depth: int) -> Any:
    return st.pairs(_TAG_ODICT, d, d.items(), depth)


def _enc_datetime(st: Enc, v: Any, depth: int) -> Any:
    t = type(v)
    tz = getattr(v, "tzinfo", None)
    if tz is not None and type(tz) is not _dt.timezone:
        return _fallback(st, v, depth, f"{t.__name__} with tzinfo {type(tz).__name__}")
    if t is _dt.timedelta:
        return ext(W.X_DATETIME, b"\x03" + struct.pack("<qII", v.days, v.seconds, v.microseconds))
    if t is _dt.date:
        return ext(W.X_DATETIME, W.HEAD_DT.pack(1, v.year, v.month, v.day, 0, 0, 0, 0, 0, W.NO_TZ))
    off, name = W.NO_TZ, b""
    if tz is not None:
        delta = tz.utcoffset(None)
        off = delta // _dt.timedelta(microseconds=1)
        if tz.tzname(None) != _dt.timezone(delta).tzname(None):
            name = tz.tzname(None).encode()
    if t is _dt.time:
        head = W.HEAD_DT.pack(2, 1, 1, 1, v.hour, v.minute, v.second, v.microsecond, v.fold, off)
    else:
        head = W.HEAD_DT.pack(0, v.year, v.month, v.day, v.hour, v.minute, v.second,
                              v.microsecond, v.fold, off)
    return ext(W.X_DATETIME, head + name)


def _enc_pickle(st: Enc, obj: Any, depth: int) -> Any:
    bufs = st.bufs
    start = len(bufs)

    def take(pb: pickle.PickleBuffer) -> bool | None:
        try:
            mv = pb.raw()
        except BufferError:  # not contiguous: let pickle keep it in band
            return True
        bufs.append(mv)
        return None

    data = pickle.dumps(obj, protocol=5, buffer_callback=take)
    count = len(bufs) - start
    if len(data) <= _INLINE_MAX:
        return ext(W.X_PICKLE, W.HEAD_P.pack(count, 0) + data)
    bufs.append(memoryview(data))
    return ext(W.X_PICKLE, W.HEAD_P.pack(count, 1))


def _unsupported(st: Enc, obj: Any, depth: int) -> Any:
    t = type(obj)
    hint = ("; classes defined inside a function cannot be rebuilt by name"
            if "<locals>" in t.__qualname__ else "")
    raise Fail(f"cannot encode {t.__module__}.{t.__qualname__}: not a supported type, not in "
               f"the codec's TypeRegistry, and allow_pickle=False{hint}")


BUILTIN: dict = {
    bytes: _enc_bytes, bytearray: _enc_bytearray, memoryview: _enc_memoryview,
    np.ndarray: _enc_ndarray, np.memmap: _enc_ndarray, complex: _enc_complex,
    set: _enc_set, frozenset: _enc_set, collections.OrderedDict: _enc_odict,
    _dt.datetime: _enc_datetime, _dt.date: _enc_datetime, _dt.time: _enc_datetime,
    _dt.timedelta: _enc_datetime,
}
for _sc in set(np.sctypeDict.values()):
    if issubclass(_sc, np.generic) and np.dtype(_sc).kind in W.NP_KINDS:
        BUILTIN[_sc] = _enc_npscalar


def _registered(tag: Any, fn: Callable[[Any], Any]) -> Callable:
    def h(st: Enc, obj: Any, depth: int) -> Any:
        return st.seq(tag, (fn(obj),), depth, ("<registered>",), obj)
    return h


def _namedtuple(tag: Any, names: tuple) -> Callable:
    def h(st: Enc, obj: Any, depth: int) -> Any:
        return st.seq(tag, obj, depth, names)
    return h


def _dataclass(tag: Any, names: tuple) -> Callable:
    def h(st: Enc, obj: Any, depth: int) -> Any:
        return st.pairs(tag, obj, [(n, getattr(obj, n)) for n in names], depth, names)
    return h


def _enum(path: bytes) -> Callable:
    def h(st: Enc, obj: Any, depth: int) -> Any:
        name = obj._name_
        if name is not None and type(obj).__members__.get(name) is obj:
            return ext(W.X_ENUM, path + b"\x00" + name.encode())
        return st.seq(ext(W.T_ENUMVALUE, path), (obj._value_,), depth, ("value",), obj)
    return h


def _structural(t: type) -> Callable | None:
    """Handlers found by what a class is rather than by its exact type."""
    torch = W.TORCH
    if torch is not None and issubclass(t, torch.Tensor):
        return _enc_torch  # nn.Parameter and other tensor subclasses: a plain tensor
    if issubclass(t, np.dtype):
        return _enc_npdtype
    if t.__module__.startswith("cupy") and t.__name__ == "ndarray":
        return _enc_cupy
    is_nt = issubclass(t, tuple) and hasattr(t, "_fields") and hasattr(t, "_make")
    is_dc = dataclasses.is_dataclass(t)
    is_enum = issubclass(t, enum.Enum)
    if not (is_nt or is_dc or is_enum):
        return None
    path = W.class_path(t)
    if path is None:
        return None  # a local class: cannot be rebuilt by name
    raw = path.encode()
    if is_nt:
        return _namedtuple(ext(W.T_NAMEDTUPLE, raw), tuple(t._fields))
    if is_dc:
        return _dataclass(ext(W.T_DATACLASS, raw), tuple(f.name for f in dataclasses.fields(t)))
    return _enum(raw)


def _install_torch() -> None:
    global _STRIDED
    torch = W.load_torch()  # the first torch object: import torch now, not before
    _STRIDED = torch.strided
    BUILTIN.update({torch.Tensor: _enc_torch, torch.Size: _enc_tsize,
                    torch.dtype: _enc_tdtype, torch.device: _enc_tdevice})


def classify(codec: Codec, t: type) -> Callable:
    """Find (and cache in the codec) the handler for a type seen for the first time."""
    reg = codec._reg_types.get(t)
    if reg is not None:
        h = _registered(ext(W.T_REGISTERED, reg[0].encode()), reg[1])
    else:
        if _STRIDED is None and (t.__module__.startswith("torch") or W.TORCH is not None
                                 or hasattr(sys.modules.get("torch"), "Tensor")):
            _install_torch()   # also for a user's Tensor subclass, if torch is loaded already
        h = BUILTIN.get(t) or _structural(t)
        if h is None:
            h = _enc_pickle if codec._allow_pickle else _unsupported
    if len(codec._dispatch) < W.MAX_CACHE:
        codec._dispatch[t] = h
    return h
