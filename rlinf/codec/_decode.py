"""The decoder: one ``msgpack.unpackb`` whose hooks rebuild the leaves and the containers.

msgpack's C parser walks the header (it bounds nesting at 1024 levels and every declared
length by the ``max_*_len`` limits before allocating); ``Dec.ext`` turns extension values
into leaves, taking buffers in order, and ``Dec.lst`` turns tagged arrays into tuples,
dataclasses and the like. Everything a hook raises ends up as :class:`DecodeError`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import enum
import importlib
import math
import pickle
import struct
import sys
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import _wire as W
from ..errors import DecodeError

if TYPE_CHECKING:
    from . import Codec

_ndarray = np.ndarray


class Tag:
    """What a container tag decodes to until ``Dec.lst`` consumes it: a builder + its arg."""

    __slots__ = ("build", "arg")

    def __init__(self, build: Callable, arg: Any = None) -> None:
        self.build, self.arg = build, arg


class Dec:
    """Per-call decoder state: the buffers, the next one to take, the unconsumed tags."""

    __slots__ = ("bufs", "nbufs", "next", "tags", "codec", "max_bytes", "max_ndim", "tcache", "bigints")

    def __init__(self, codec: Codec, bufs: Any, nbufs: int) -> None:
        self.bufs, self.nbufs, self.next, self.tags, self.codec = bufs, nbufs, 0, 0, codec
        self.bigints = 0
        self.max_bytes, self.max_ndim = codec._limits.max_buffer_bytes, codec._limits.max_ndim
        self.tcache = codec._tcache

    def take(self) -> Any:
        i = self.next
        if i >= self.nbufs:
            raise DecodeError(f"the header refers to more than the {self.nbufs} buffers given")
        self.next = i + 1
        return self.bufs[i]

    def ext(self, code: int, data: bytes) -> Any:
        if code == 5:  # W.X_TORCH: the hot path, inlined; _d_torch fills the cache
            d = self.tcache.get(data)
            if d is not None:
                i = self.next
                buf = self.bufs[i] if i < self.nbufs else None
                if type(buf) is memoryview and buf.nbytes == d[2] and not buf.readonly:
                    self.next = i + 1
                    t = _from_numpy(_ndarray(d[0], d[1], buf))
                    if d[3] is not None:
                        t = t.view(d[3])
                    if d[4]:
                        t.requires_grad_()
                    return t
        elif code == 2 and data == b"\x00":  # W.X_OOB bytes, the small-message hot path
            i = self.next
            buf = self.bufs[i] if i < self.nbufs else None
            if type(buf) is memoryview and buf.nbytes <= self.max_bytes:
                self.next = i + 1
                return buf.tobytes()
        return _EXT_TABLE[code & 0xFF](self, data)

    def lst(self, items: list) -> Any:
        if items and type(items[0]) is Tag:
            self.tags -= 1
            tag = items[0]
            return tag.build(self, tag.arg, items)
        return items

    def shape(self, data: bytes, off: int, ndim: int, itemsize: int, exact: bool) -> tuple:
        """The shape at ``data[off:]`` and its size in bytes, checked against the limits."""
        if ndim > self.max_ndim:
            raise DecodeError(f"{ndim} dimensions exceed Limits.max_ndim={self.max_ndim}")
        end = off + 8 * ndim
        if len(data) < end or (exact and len(data) != end):
            raise DecodeError("array descriptor has the wrong length")
        shape = W.SHAPES[ndim].unpack_from(data, off)
        n = math.prod(shape) * itemsize
        if n > self.max_bytes:
            raise DecodeError(f"declared {n} bytes exceed Limits.max_buffer_bytes={self.max_bytes}")
        return shape, n


def _wrong_size(got: int, n: int) -> DecodeError:
    return DecodeError(f"a buffer holds {got} bytes but its header declares {n}")


def _host_array(st: Dec, shape: tuple, n: int, dt: np.dtype, fortran: int) -> np.ndarray:
    """A writable numpy array over the next (host) buffer, without copying."""
    buf = st.take()
    if n == 0:
        if W.buffer_nbytes(buf) != 0:
            raise _wrong_size(W.buffer_nbytes(buf), 0)
        return np.empty(shape, dt, order="F" if fortran else "C")
    mv = W.host_view(buf)
    if mv.nbytes != n:
        raise _wrong_size(mv.nbytes, n)
    if fortran:
        return _ndarray(shape[::-1], dt, mv).T
    return _ndarray(shape, dt, mv)


def _d_ndarray(st: Dec, data: bytes) -> Any:
    flags, ndim = W.HEAD_N.unpack_from(data)
    dt = W.np_dtype(data[2 + 8 * ndim:])
    shape, n = st.shape(data, 2, ndim, dt.itemsize, False)
    return _host_array(st, shape, n, dt, flags & W.F_FORTRAN)


def _device_view(buf: Any, n: int) -> Any:
    """A device buffer as a flat uint8 torch tensor (cupy arrays are wrapped, not copied)."""
    torch = W.TORCH or W.load_torch()     # a cupy array may be the first thing decoded
    if not type(buf).__module__.startswith("torch"):
        buf = torch.as_tensor(buf, device="cuda")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise DecodeError("a device buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() != n:
        raise _wrong_size(buf.numel(), n)
    return buf


_TORCH_DEC = W.TORCH_DEC
_HEAD_T = W.HEAD_T.unpack_from
_SHAPES = W.SHAPES
_prod = math.prod
_from_numpy: Any = None


def _d_torch(st: Dec, data: bytes) -> Any:
    global _from_numpy
    if _from_numpy is None:
        _from_numpy = W.load_torch().from_numpy
    code, flags, dev, ndim = _HEAD_T(data)
    desc = _TORCH_DEC[code] if code < len(_TORCH_DEC) else None
    if desc is None:
        raise DecodeError(f"torch dtype code {code} is unknown to torch {W.TORCH.__version__}")
    if len(data) != 4 + 8 * ndim or ndim > st.max_ndim:
        raise DecodeError("bad torch tensor descriptor")
    dt, npdt, view, size = desc
    shape = _SHAPES[ndim].unpack_from(data, 4)
    n = _prod(shape) * size
    i = st.next
    if i >= st.nbufs:
        raise DecodeError(f"the header refers to more than the {st.nbufs} buffers given")
    buf = st.bufs[i]
    st.next = i + 1
    if dev < 0 and type(buf) is memoryview and n and buf.nbytes == n and not buf.readonly \
            and n <= st.max_bytes:  # the common case, e.g. decoding what encode returned
        t = _from_numpy(_ndarray(shape, npdt, buf))
        if view:
            t = t.view(dt)
        if dev < 0 and len(st.tcache) < W.MAX_CACHE:  # a validated descriptor: cache it
            st.tcache[data] = (shape, npdt, n, dt if view else None, flags & W.F_GRAD)
    else:
        st.next = i  # the general path takes the buffer again
        t = _torch_general(st, shape, n, desc, dev)
    if flags & W.F_GRAD:
        t.requires_grad_()
    return t


def _torch_general(st: Dec, shape: tuple, n: int, desc: tuple, dev: int) -> Any:
    torch = W.TORCH
    dt, npdt, view, size = desc
    if n > st.max_bytes:
        raise DecodeError(f"declared {n} bytes exceed Limits.max_buffer_bytes={st.max_bytes}")
    buf = st.bufs[st.next]
    if W.is_device_buffer(buf):
        st.next += 1
        return _device_view(buf, n).view(dt).view(shape)
    if n == 0:  # nothing to alias: a fresh empty tensor has torch's own strides
        _host_array(st, shape, n, npdt, 0)
        t = torch.empty(shape, dtype=dt)
    else:
        t = torch.from_numpy(_host_array(st, shape, n, npdt, 0))
        if view:
            t = t.view(dt)
    if dev >= 0 and torch.cuda.is_available():
        t = t.to("cuda")  # host bytes of a CUDA tensor: onto this process's current device
    return t


def _d_cupy(st: Dec, data: bytes) -> Any:
    dev, ndim = W.HEAD_C.unpack_from(data)
    dt = W.np_dtype(data[2 + 8 * ndim:])
    shape, n = st.shape(data, 2, ndim, dt.itemsize, False)
    buf = st.bufs[st.next] if st.next < st.nbufs else None
    try:
        cp = sys.modules.get("cupy") or importlib.import_module("cupy")
    except ImportError:
        cp = None  # no cupy here: host bytes decode as a numpy array
    if buf is not None and W.is_device_buffer(buf):
        if cp is None:
            raise DecodeError("a cupy array arrived on the device but cupy is not installed")
        st.next += 1
        if type(buf).__module__.startswith("torch"):
            buf = cp.asarray(_device_view(buf, n))
        if buf.dtype != cp.uint8 or buf.ndim != 1 or buf.size != n:
            raise DecodeError("a cupy device buffer must be a 1-D uint8 array of the declared size")
        return buf.view(dt).reshape(shape)
    arr = _host_array(st, shape, n, dt, 0)
    return arr if cp is None else cp.asarray(arr)


def _d_oob(st: Dec, data: bytes) -> Any:
    if data != b"\x00" and data != b"\x01":
        raise DecodeError("bad out-of-band bytes descriptor")
    buf = st.take()
    if data == b"\x00" and type(buf) is bytes and len(buf) <= st.max_bytes:
        return buf
    mv = memoryview(W.host_object(buf))
    if mv.nbytes > st.max_bytes:
        raise DecodeError(f"a {mv.nbytes}-byte buffer exceeds Limits.max_buffer_bytes")
    return bytes(mv) if data == b"\x00" else bytearray(mv)


def _d_npdtype(st: Dec, data: bytes) -> np.dtype:
    """A dtype object; unlike an array's, it may be an unsized string type (``np.dtype("U")``)."""
    if data in (b"<U0", b">U0", b"|S0", b"|V0"):
        return np.dtype(data.decode("ascii"))
    return W.np_dtype(data)


#: Ints beyond 64 bits per message: they hash alike at will (equal modulo 2**61 - 1), so
#: many of them as dict or set keys would make decoding quadratic.
MAX_BIGINTS = 2048


def _d_bigint(st: Dec, data: bytes) -> int:
    st.bigints += 1
    if st.bigints > MAX_BIGINTS:
        raise DecodeError(f"more than {MAX_BIGINTS} ints beyond 64 bits in one message")
    return int.from_bytes(data, "big", signed=True)


def _d_npscalar(st: Dec, data: bytes) -> Any:
    k = data[0]
    dt = W.np_dtype(data[1:1 + k])
    raw = data[1 + k:]
    if len(raw) != dt.itemsize:
        raise DecodeError("numpy scalar has the wrong size")
    return np.frombuffer(raw, dt)[0]


_TORCH_DTYPES: dict[str, Any] = {}


def _d_tdtype(st: Dec, data: bytes) -> Any:
    torch = W.TORCH or W.load_torch()
    if not _TORCH_DTYPES:   # by name, from torch's own namespace: no lazy attribute is touched
        _TORCH_DTYPES.update((str(v), v) for v in list(vars(torch).values()) if isinstance(v, torch.dtype))
    name = data.decode("ascii", "replace")
    dt = _TORCH_DTYPES.get(name)
    if dt is None:
        raise DecodeError(f"unknown torch dtype {name!r}")
    return dt


def _d_tsize(st: Dec, data: bytes) -> Any:
    torch = W.TORCH or W.load_torch()
    if len(data) % 8 or len(data) > 8 * 64:
        raise DecodeError("bad torch.Size descriptor")
    return torch.Size(W.TSIZES[len(data) // 8].unpack(data))


def _d_tdevice(st: Dec, data: bytes) -> Any:
    torch = W.TORCH or W.load_torch()
    if len(data) > 64:
        raise DecodeError("bad torch.device descriptor")
    return torch.device(data.decode("ascii"))


def _d_datetime(st: Dec, data: bytes) -> Any:
    if data[:1] == b"\x03":
        return _dt.timedelta(*struct.unpack("<qII", data[1:]))
    kind, y, mo, d, hh, mm, ss, us, fold, off = W.HEAD_DT.unpack_from(data)
    tz = None
    if off != W.NO_TZ:
        delta = _dt.timedelta(microseconds=off)
        name = data[W.HEAD_DT.size:]
        tz = _dt.timezone(delta, name.decode()) if name else _dt.timezone(delta)
    if kind == 1:
        return _dt.date(y, mo, d)
    if kind == 2:
        return _dt.time(hh, mm, ss, us, tz, fold=fold)
    if kind == 0:
        return _dt.datetime(y, mo, d, hh, mm, ss, us, tz, fold=fold)
    raise DecodeError(f"unknown datetime kind {kind}")


def _d_pickle(st: Dec, data: bytes) -> Any:
    if not st.codec._allow_pickle:
        raise DecodeError("the message holds a pickled object and this codec has allow_pickle=False")
    count, oob = W.HEAD_P.unpack_from(data)
    if count > st.nbufs - st.next:
        raise DecodeError("pickled object refers to more buffers than were given")
    bufs = [W.host_view(st.take()) for _ in range(count)]
    stream = memoryview(W.host_object(st.take())) if oob else data[W.HEAD_P.size:]
    return pickle.loads(stream, buffers=bufs)


def _d_enum(st: Dec, data: bytes) -> Any:
    path, sep, name = data.partition(b"\x00")
    if not sep:
        raise DecodeError("bad enum descriptor")
    members = _resolve(st, path, "enum").__members__
    member = members.get(name.decode())
    if member is None:
        raise DecodeError(f"enum {path.decode()} has no member {name.decode()!r}")
    return member


# --------------------------------------------------------------------------------------
# containers


def _b_tuple(st: Dec, arg: Any, items: list) -> Any:
    del items[0]
    return tuple(items)


def _b_dict(st: Dec, arg: Any, items: list) -> Any:
    if len(items) % 2 != 1:
        raise DecodeError("a dict needs key, value pairs")
    it = iter(items)
    next(it)
    return arg(zip(it, it))


def _b_set(st: Dec, arg: Any, items: list) -> Any:
    del items[0]
    return arg(items)


def _b_namedtuple(st: Dec, cls: Any, items: list) -> Any:
    del items[0]
    return cls._make(items)


def _b_dataclass(st: Dec, arg: Any, items: list) -> Any:
    cls, names = arg
    given = items[1::2]
    if len(items) % 2 != 1 or len(given) != len(names) or set(given) != names:
        raise DecodeError(f"fields of {cls.__qualname__} do not match its definition here")
    obj = cls.__new__(cls)  # like pickle and copy: __init__ / __post_init__ do not run again
    setattr_ = object.__setattr__  # works on frozen and slotted dataclasses too
    for i in range(1, len(items), 2):
        setattr_(obj, items[i], items[i + 1])
    return obj


def _b_call(st: Dec, fn: Callable, items: list) -> Any:
    if len(items) != 2:
        raise DecodeError("a registered or enum value needs exactly one payload")
    return fn(items[1])


_KIND_CHECK = {
    "namedtuple": lambda c: issubclass(c, tuple) and hasattr(c, "_fields") and hasattr(c, "_make"),
    "dataclass": dataclasses.is_dataclass,
    "enum": lambda c: issubclass(c, enum.Enum),
}


def _resolve(st: Dec, path: bytes, kind: str) -> Any:
    """The class named ``module:qualname``; imports only when pickle is allowed."""
    codec = st.codec
    cls = codec._classes.get((kind, path))
    if cls is None:
        mod, sep, qual = path.decode().partition(":")
        if not sep:
            raise DecodeError(f"bad class path {path!r}")
        module = sys.modules.get(mod)
        if module is None:
            if not codec._allow_pickle:
                raise DecodeError(f"module {mod!r} is not loaded and allow_pickle=False "
                                  "forbids importing it")
            module = importlib.import_module(mod)
        try:
            cls = W.lookup(module, qual)
        except AttributeError:
            raise DecodeError(f"class {mod}:{qual} not found") from None
        if not isinstance(cls, type) or not _KIND_CHECK[kind](cls):
            raise DecodeError(f"{mod}:{qual} is not a {kind} class")
        if len(codec._classes) < W.MAX_CACHE:
            codec._classes[(kind, path)] = cls
    return cls


def _simple_tag(build: Callable, arg: Any = None) -> Callable:
    tag = Tag(build, arg)

    def f(st: Dec, data: bytes) -> Tag:
        if data:
            raise DecodeError("unexpected payload in a container tag")
        st.tags += 1
        return tag
    return f


def _class_tag(kind: str, build: Callable) -> Callable:
    def f(st: Dec, data: bytes) -> Tag:
        key = (kind + "-tag", data)
        tag = st.codec._classes.get(key)
        if tag is None:
            cls = _resolve(st, data, kind)
            if kind == "dataclass":
                cls = (cls, frozenset(fl.name for fl in dataclasses.fields(cls)))
            tag = Tag(build, cls)
            if len(st.codec._classes) < W.MAX_CACHE:
                st.codec._classes[key] = tag
        st.tags += 1
        return tag
    return f


def _registered_tag(st: Dec, data: bytes) -> Tag:
    fn = st.codec._reg_dec.get(data.decode())
    if fn is None:
        raise DecodeError(f"type {data.decode()!r} is not in this codec's TypeRegistry")
    st.tags += 1
    return Tag(_b_call, fn)


_EXT: dict = {
    W.X_BIGINT: _d_bigint,
    W.X_OOB: _d_oob,
    W.X_BYTEARRAY: lambda st, data: bytearray(data),
    W.X_NDARRAY: _d_ndarray,
    W.X_TORCH: _d_torch,
    W.X_CUPY: _d_cupy,
    W.X_NPSCALAR: _d_npscalar,
    W.X_TDTYPE: _d_tdtype,
    W.X_TSIZE: _d_tsize,
    W.X_TDEVICE: _d_tdevice,
    W.X_NPDTYPE: _d_npdtype,
    W.X_COMPLEX: lambda st, data: complex(*struct.unpack("<dd", data)),
    W.X_DATETIME: _d_datetime,
    W.X_ENUM: _d_enum,
    W.X_PICKLE: _d_pickle,
    W.T_TUPLE: _simple_tag(_b_tuple),
    W.T_DICT: _simple_tag(_b_dict, dict),
    W.T_ODICT: _simple_tag(_b_dict, collections.OrderedDict),
    W.T_SET: _simple_tag(_b_set, set),
    W.T_FROZENSET: _simple_tag(_b_set, frozenset),
    W.T_NAMEDTUPLE: _class_tag("namedtuple", _b_namedtuple),
    W.T_DATACLASS: _class_tag("dataclass", _b_dataclass),
    W.T_ENUMVALUE: _class_tag("enum", _b_call),
    W.T_REGISTERED: _registered_tag,
}


def _unknown_ext(st: Dec, data: bytes) -> Any:
    raise DecodeError("unknown extension code in the header")


_EXT_TABLE = [_EXT.get(code, _unknown_ext) for code in range(256)]  # msgpack codes: -128..127
