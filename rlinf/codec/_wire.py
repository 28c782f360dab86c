"""Wire format constants, limits, the type registry and raw-memory helpers of the codec.

Header layout: ``b"\\xc1RL"`` + one version byte + one msgpack value. ``0xc1`` is never
the first byte of valid msgpack, so a header cannot be mistaken for plain msgpack.

Inside the msgpack value, dict / list / str / int (64-bit) / float / bool / None and bytes
up to 1 KiB are native. Everything else is a msgpack extension value whose code is listed
below: *leaves* (the payload describes the value, e.g. dtype + shape of an array whose
bytes are the next buffer) and *container tags* (an empty or class-naming payload that
only ever appears as the first element of a msgpack array holding the container's items).
Buffers carry no index: leaves take them in the order they appear in the header.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import struct
import sys
from typing import Any, Callable

import msgpack
import numpy as np

from ..errors import DecodeError

VERSION = 1
MAGIC = b"\xc1RL"
PREFIX = MAGIC + bytes([VERSION])
INLINE_MAX = 1023  # bytes-like values up to this size travel inside the header
COPY_READONLY_BELOW = 4097  # read-only buffers up to 4 KiB are copied, not aliased
MAX_CACHE = 4096  # bound of every per-type / per-class cache

# Leaf extension codes.
X_BIGINT, X_OOB, X_BYTEARRAY, X_NDARRAY, X_TORCH, X_CUPY, X_NPSCALAR = 1, 2, 3, 4, 5, 6, 7
X_TDTYPE, X_TSIZE, X_TDEVICE, X_NPDTYPE, X_COMPLEX, X_DATETIME, X_ENUM = 8, 9, 10, 11, 12, 13, 14
X_PICKLE = 15
# Container tag codes.
T_TUPLE, T_NAMEDTUPLE, T_DATACLASS, T_DICT, T_ODICT, T_SET, T_FROZENSET = 32, 33, 34, 35, 36, 37, 38
T_REGISTERED, T_ENUMVALUE = 39, 40

NATIVE = frozenset((str, int, float, bool, type(None)))
F_GRAD = 1  # torch flags: requires_grad
F_FORTRAN = 1  # numpy flags: shipped as the C-ordered transpose
NO_TZ = -(1 << 63)
tuple_new = tuple.__new__
ExtType = msgpack.ExtType


def ext(code: int, data: bytes = b"") -> msgpack.ExtType:
    """``ExtType(code, data)`` without its Python-level argument checks (4x faster)."""
    return tuple_new(ExtType, (code, data))


EMPTY = memoryview(b"")
U8 = np.dtype(np.uint8)
HEAD_T = struct.Struct("<BBbB")  # torch: dtype code, flags, cuda index (-1: host), ndim
HEAD_N = struct.Struct("<BB")  # numpy: flags, ndim; the dtype string follows the shape
HEAD_C = struct.Struct("<bB")  # cupy: device, ndim; the dtype string follows the shape
HEAD_P = struct.Struct("<IB")  # pickle: out-of-band buffer count, stream out of band
HEAD_DT = struct.Struct("<BHBBBBBIBq")  # kind, y, m, d, H, M, S, us, fold, tz offset (us)
TS = [struct.Struct("<BBbB%dQ" % n) for n in range(65)]
NS = [struct.Struct("<BB%dQ" % n) for n in range(65)]
CS = [struct.Struct("<bB%dQ" % n) for n in range(65)]
SHAPES = [struct.Struct("<%dQ" % n) for n in range(65)]
#: A torch.Size is any tuple of int64s (``view``'s -1 included), not only array shapes.
TSIZES = [struct.Struct("<%dq" % n) for n in range(65)]


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a decoder checks before it builds anything (the encoder enforces them too).

    Attributes:
        max_header_bytes: largest header accepted.
        max_depth: deepest container nesting (at most 500, msgpack's own stack is 511).
        max_buffers: most buffers in one message.
        max_buffer_bytes: largest single buffer (declared shape x itemsize).
        max_items: most items in one container (also bounds msgpack array/map lengths).
        max_ndim: most dimensions of one array.
    """

    max_header_bytes: int = 16 << 20
    max_depth: int = 256
    max_buffers: int = 100_000
    max_buffer_bytes: int = 1 << 40
    max_items: int = 10_000_000
    max_ndim: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {v!r}")
        if self.max_depth > 500:
            raise ValueError("Limits.max_depth must be <= 500 (msgpack nests at most 511 deep)")
        if self.max_ndim > 64:
            raise ValueError("Limits.max_ndim must be <= 64")


class TypeRegistry:
    """Encoders for types the codec does not know, passed to :class:`Codec` (no global).

    ``encode_fn(obj)`` returns any codec-encodable object; ``decode_fn(value)`` rebuilds
    the instance from it. Lookup is by exact type. A Codec copies the registry when it is
    built, so register every type before building the codecs that use them.
    """

    __slots__ = ("_by_type", "_by_name")

    def __init__(self) -> None:
        self._by_type: dict[type, tuple[str, Callable[[Any], Any]]] = {}
        self._by_name: dict[str, Callable[[Any], Any]] = {}

    def register(self, cls: type, encode_fn: Callable[[Any], Any],
                 decode_fn: Callable[[Any], Any], name: str | None = None) -> None:
        """Register ``cls``; ``name`` (default ``"module:qualname"``) identifies it on the wire.

        Raises:
            TypeError: ``cls`` is not a class or a function is not callable.
            ValueError: ``cls`` or ``name`` is registered already.
        """
        if not isinstance(cls, type):
            raise TypeError(f"register() needs a class, got {cls!r}")
        if not callable(encode_fn) or not callable(decode_fn):
            raise TypeError("encode_fn and decode_fn must be callable")
        name = f"{cls.__module__}:{cls.__qualname__}" if name is None else name
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty str")
        if cls in self._by_type or name in self._by_name:
            raise ValueError(f"{cls.__qualname__} (name {name!r}) is registered already")
        self._by_type[cls] = (name, encode_fn)
        self._by_name[name] = decode_fn

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_type

    def __len__(self) -> int:
        return len(self._by_type)

    def __repr__(self) -> str:
        return f"<TypeRegistry {sorted(self._by_name)}>"


class Fail(Exception):
    """Internal: an encode failure on its way up; containers add their path segment."""

    def __init__(self, msg: str, cause: BaseException | None = None) -> None:
        super().__init__(msg)
        self.msg, self.cause, self.segs = msg, cause, []


def fmt_path(segs: list) -> str:
    out = ["$"]
    for seg in reversed(segs):
        if type(seg) is str:  # a field name
            out.append("." + seg)
        elif type(seg) is tuple:  # (index,) or (key, None)
            v = seg[0]
            out.append(f"[{v}]" if len(seg) == 1 else
                       "[" + (json.dumps(v, ensure_ascii=False) if type(v) is str else repr(v)) + "]")
    return "".join(out)


def class_path(cls: type) -> str | None:
    """``"module:qualname"`` when importing it gives ``cls`` back, else None."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    try:
        return path if lookup(sys.modules.get(cls.__module__), cls.__qualname__) is cls else None
    except AttributeError:
        return None


def lookup(module: Any, qualname: str) -> Any:
    """``module.<qualname>`` through the objects' own ``__dict__``: never a module's lazy
    ``__getattr__`` (torch's and numpy's import submodules) or a descriptor, so a peer's
    class path cannot make us import or run anything."""
    if module is None or "<" in qualname:
        raise AttributeError(qualname)
    obj = module
    for part in qualname.split("."):
        try:
            obj = vars(obj)[part]
        except (KeyError, TypeError):
            raise AttributeError(f"{qualname}: no {part!r}") from None
    return obj


# --------------------------------------------------------------------------------------
# raw memory helpers


# ctypes keeps every array type it ever made (one per length), so views use lengths rounded
# up to a power of two (48 types, up to 128 TiB) and are cut back to the real size.
CARRAYS: list = [ctypes.c_char * (1 << k) for k in range(48)]


def ptr_view(addr: int, n: int, owner: object) -> memoryview:
    """A writable 1-D "B" memoryview of ``n`` (> 0) bytes at ``addr`` keeping ``owner`` alive.

    No byte beyond ``n`` is ever read: the power-of-two ctypes array only names the memory.
    """
    c = CARRAYS[(n - 1).bit_length()].from_address(addr)
    c._rlinf_owner = owner  # the view -> ctypes array -> owner chain keeps the memory alive
    return memoryview(c).cast("B")[:n]


def host_view(buf: Any) -> memoryview:
    """The received host buffer as a writable 1-D "B" memoryview, without copying.

    Read-only buffers (bytes, ``zmq.Frame.buffer``) are aliased writably: the receiver owns
    them. Ones of at most 4 KiB are copied instead: such small ``bytes`` may be shared
    (CPython interns short bytes and folds constants up to 4096 bytes) and copying them
    costs less than the aliasing.
    """
    mv = buf if type(buf) is memoryview else memoryview(host_object(buf))
    if not mv.c_contiguous:
        raise DecodeError("a received buffer is not contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if mv.readonly:
        n = mv.nbytes
        if n < COPY_READONLY_BELOW:
            return memoryview(bytearray(mv))
        mv = ptr_view(np.frombuffer(mv, U8).ctypes.data, n, mv)
    return mv


def host_object(buf: Any) -> Any:
    mod = type(buf).__module__
    if mod.startswith(("torch", "cupy")):
        if is_device_buffer(buf):
            raise DecodeError("a device buffer was given where the header declares host data")
        return buf.detach().contiguous().numpy() if mod.startswith("torch") else buf
    return buf


def buffer_nbytes(buf: Any) -> int:
    """Size in bytes of one entry of ``buffers`` (host buffer, torch tensor or cupy array)."""
    t = type(buf)
    if t is memoryview:
        return buf.nbytes
    if t is bytes or t is bytearray:
        return len(buf)
    if t.__module__.startswith(("torch", "cupy")):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


def is_device_buffer(buf: Any) -> bool:
    """True when ``buf`` lives in GPU memory (a CUDA torch tensor or a cupy array)."""
    mod = type(buf).__module__
    if mod.startswith("torch"):
        return bool(getattr(buf, "is_cuda", False))
    return mod.startswith("cupy")


# --------------------------------------------------------------------------------------
# dtype tables

# Append-only: the index is the wire code of a torch dtype.
TORCH_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                "float64", "complex64", "complex128", "bfloat16", "complex32", "uint16",
                "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
NUMPY_NATIVE = frozenset(TORCH_NAMES[:11] + TORCH_NAMES[13:16])
TORCH: Any = None  # the torch module once something needed it
TORCH_ENC: dict = {}  # torch.dtype -> (code, itemsize, is_complex)
TORCH_DEC: list = []  # code -> (torch.dtype, numpy dtype for the bytes, needs .view, itemsize)


def load_torch() -> Any:
    global TORCH
    if TORCH is None:
        import torch

        dec = []
        for code, name in enumerate(TORCH_NAMES):
            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype):
                dec.append(None)
                continue
            size = dt.itemsize
            native = name in NUMPY_NATIVE
            npdt = np.dtype(name) if native else np.dtype({1: "u1", 2: "<i2", 4: "<i4"}[size])
            dec.append((dt, npdt, not native, size))
            TORCH_ENC[dt] = (code, size, dt.is_complex)
        TORCH_DEC[:] = dec
        TORCH = torch
    return TORCH


NP_KINDS = frozenset("biufcMmSU")
NP_ENC: dict = {}  # np.dtype -> dtype.str as bytes, or None when not plain data
NP_DEC: dict = {}  # dtype bytes -> np.dtype (validated)


def np_code(dt: np.dtype) -> bytes | None:
    code = NP_ENC.get(dt, False)
    if code is False:
        code = dt.str.encode() if dt.kind in NP_KINDS and not dt.hasobject and not dt.fields else None
        if len(NP_ENC) < MAX_CACHE:
            NP_ENC[dt] = code
    return code


def np_dtype(raw: bytes) -> np.dtype:
    dt = NP_DEC.get(raw)
    if dt is None:
        if len(raw) > 32:
            raise DecodeError("numpy dtype string too long")
        dt = np.dtype(raw.decode("ascii"))
        if dt.kind not in NP_KINDS or dt.hasobject or dt.fields or dt.itemsize == 0:
            raise DecodeError(f"numpy dtype {dt.str!r} is not plain data")
        if len(NP_DEC) < MAX_CACHE:
            NP_DEC[raw] = dt
    return dt


