"""Structure-aware serializer: ``encode(obj) -> (header, buffers)``, ``decode(header, buffers)``.

A message is one small msgpack *header* (the structure: containers, scalars, strings and,
per array, its dtype, shape and device) plus a list of raw *buffers* with the array and
tensor data, which a transport sends out of band without copying. See ``docs/codec.md``
for the format, the supported types and the rules; in short:

* Any nesting of dict / list / tuple / namedtuple / dataclass / set / None / bool / int /
  float / complex / str / bytes / bytearray / memoryview / numpy arrays and scalars /
  torch tensors (any dtype, CPU or GPU) / cupy arrays / enum members / datetime values.
* Shared references are encoded by value: two references to one array arrive as two
  arrays. A reference cycle raises :class:`~rlinf.errors.EncodeError`.
* Unknown types: the codec's :class:`TypeRegistry`, else pickle protocol 5 with
  out-of-band buffers if ``allow_pickle``, else ``EncodeError`` naming the path inside
  the object, e.g. ``$["batch"]["obs"][3]``.
* :meth:`Codec.decode` checks every size, count and depth against :class:`Limits` before
  building anything and raises only :class:`~rlinf.errors.DecodeError`; with
  ``allow_pickle=False`` it never unpickles and never imports a module.

torch and cupy are imported only once an object or a message holds one of their types.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import msgpack

from . import _decode, _encode
from ._wire import (INLINE_MAX, MAGIC, NATIVE, PREFIX, VERSION, Fail, Limits, TypeRegistry, buffer_nbytes, fmt_path,
                    is_device_buffer)
from ..errors import DecodeError, EncodeError

__all__ = [
    "Codec",
    "Limits",
    "TypeRegistry",
    "encode",
    "decode",
    "buffer_nbytes",
    "is_device_buffer",
    "VERSION",
]

_unpackb = msgpack.unpackb
_local = threading.local()  # one msgpack Packer per thread: building one costs ~1 us


#: The header of a bytes object sent out of band (longer than INLINE_MAX): a message
#: that is one such object skips the encoder's and decoder's per-call state.
_BYTES_HEADER = PREFIX + msgpack.packb(_encode.OOB_BYTES)


def _new_packer() -> msgpack.Packer:
    _local.packer = msgpack.Packer(use_bin_type=True, default=_encode.pack_default)
    return _local.packer


class Codec:
    """Encodes objects to ``(header, buffers)`` and back. Build once, reuse, share freely.

    Args:
        allow_pickle: encode unknown types with pickle (protocol 5, out-of-band buffers)
            and decode pickled nodes. Only for peers you trust: unpickling runs code.
            When False, decoding never unpickles and never imports a module (classes of
            namedtuples, dataclasses and enums must already be imported).
        registry: encoders for extra types; copied at construction.
        limits: bounds checked on decode (and on encode, so a sender fails first).

    The codec is immutable after construction and safe to use from several threads.
    """

    __slots__ = ("_allow_pickle", "_limits", "_dispatch", "_reg_types", "_reg_dec", "_classes",
                 "_tcache", "_lone_bytes")

    def __init__(self, *, allow_pickle: bool = True, registry: TypeRegistry | None = None,
                 limits: Limits | None = None) -> None:
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be a bool, got {allow_pickle!r}")
        if registry is not None and not isinstance(registry, TypeRegistry):
            raise TypeError(f"registry must be a TypeRegistry, got {type(registry).__name__}")
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
        init = object.__setattr__
        init(self, "_allow_pickle", allow_pickle)
        init(self, "_limits", limits or Limits())
        reg_types = dict(registry._by_type) if registry is not None else {}
        init(self, "_reg_types", reg_types)
        init(self, "_reg_dec", dict(registry._by_name) if registry is not None else {})
        dispatch = {t: h for t, h in _encode.BUILTIN.items() if t not in reg_types}
        init(self, "_dispatch", dispatch)  # type -> handler; a cache filled on first sight
        init(self, "_classes", {})  # decode side: class path -> class / tag (a cache)
        init(self, "_tcache", {})  # decode side: torch descriptor -> validated (shape, ...)
        # a message that is one bytes object takes the shortcut (no per-call state) unless
        # bytes has an encoder of the registry's, or the limits refuse even its header
        init(self, "_lone_bytes", bytes not in reg_types and self._limits.max_header_bytes >= len(_BYTES_HEADER))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Codec is immutable")

    @property
    def allow_pickle(self) -> bool:
        return self._allow_pickle

    @property
    def limits(self) -> Limits:
        return self._limits

    def __repr__(self) -> str:
        return f"<Codec allow_pickle={self._allow_pickle} registered={len(self._reg_types)}>"

    def encode(self, obj: Any) -> tuple[bytes, list]:
        """Encode ``obj`` into a header and a list of buffers.

        Returns:
            ``(header, buffers)``. ``header`` is bytes. Each host entry of ``buffers`` is a
            1-D C-contiguous ``memoryview`` of format ``"B"`` that points at the object's
            own memory (nothing is copied except non-contiguous arrays, made contiguous
            once) and keeps that memory alive (a CPU tensor's buffer keeps all the
            message's CPU tensors alive). GPU tensors and cupy arrays appear as
            themselves, flattened to uint8 on their device. Buffer lifetime: the buffers
            alias the object, so do not modify its arrays until the buffers are sent.

        Raises:
            EncodeError: an unsupported type (with allow_pickle=False), a reference cycle,
                nesting deeper than ``limits.max_depth``, a size over the limits, or a
                str that is not UTF-8 text (a lone surrogate). Its
                ``path`` names the place inside ``obj``, e.g. ``$["batch"]["obs"][3]``.
        """
        t = type(obj)
        lone = t is bytes and self._lone_bytes
        if lone and INLINE_MAX < len(obj) <= self._limits.max_buffer_bytes:
            return _BYTES_HEADER, [memoryview(obj)]      # what the general path makes of it
        try:
            if t in NATIVE or lone and len(obj) <= INLINE_MAX:
                tree, bufs = obj, []      # nothing out of band: no per-call encoder state
            else:
                st = _encode.Enc(self)
                tree, bufs = st.enc(obj, 0), st.bufs
            try:
                packer = _local.packer
            except AttributeError:
                packer = _new_packer()
            body = packer.pack(tree)
        except Fail as e:
            raise EncodeError(e.msg, path=fmt_path(e.segs)) from e.cause
        except RecursionError as exc:
            raise EncodeError("nesting too deep for Python's recursion limit") from exc
        except UnicodeEncodeError as exc:   # a str that is no UTF-8 text: a lone surrogate
            raise EncodeError(f"a str that UTF-8 cannot encode ({exc.reason}: {exc.object[:40]!r}); "
                              f"msgpack strings are UTF-8, send such data as bytes") from exc
        lim = self._limits
        if len(body) + 4 > lim.max_header_bytes:
            raise EncodeError(f"a {len(body) + 4}-byte header exceeds Limits.max_header_bytes="
                              f"{lim.max_header_bytes}")
        if len(bufs) > lim.max_buffers:
            raise EncodeError(f"{len(bufs)} buffers exceed Limits.max_buffers={lim.max_buffers}")
        return PREFIX + body, bufs

    def decode(self, header: Any, buffers: Sequence[Any]) -> Any:
        """Rebuild the object from a header and its buffers.

        Args:
            header: bytes-like (bytes, memoryview, ``zmq.Frame.buffer``).
            buffers: the buffers in order: buffer-protocol objects (bytes, memoryview,
                ``zmq.Frame.buffer``, mmap slices) or, for GPU entries, CUDA uint8 tensors.

        Returns:
            The object. Arrays and tensors are views over ``buffers``, never copies, and
            are writable. Buffer lifetime: they keep their buffers (and the objects owning
            them, e.g. a ``zmq.Frame`` or an mmap) alive. The receiver owns the buffers: a
            read-only buffer over 4 KiB is aliased writably (writes through a decoded
            array land in that buffer, so never pass a read-only *mapping*, whose pages
            cannot be written); smaller read-only ones are copied. Decode each buffer once
            and do not reuse it while objects decoded from it are alive.

        Raises:
            DecodeError: the message is truncated, corrupted, of another version, refers
                to more or fewer buffers than given, declares sizes that do not match its
                buffers or exceed ``limits``, or holds a pickled object while
                ``allow_pickle`` is False. Never any other exception.
        """
        lim = self._limits
        if type(header) is bytes and header == _BYTES_HEADER and self._lone_bytes and type(buffers) is list \
                and len(buffers) == 1:
            buf = buffers[0]              # one bytes object out of band, as the general path
            if type(buf) is memoryview and buf.nbytes <= lim.max_buffer_bytes:
                return buf.tobytes()
        try:
            nbufs = len(buffers)
            if type(header) is bytes and len(header) < 65536:
                body: Any = header[4:]  # copying a small header is cheaper than a memoryview
                head = header[:4]
            else:
                body = header if type(header) is memoryview else memoryview(header)
                if body.ndim != 1 or body.itemsize != 1:
                    body = body.cast("B")
                head = bytes(body[:4])
                body = body[4:]
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"header must be bytes-like and buffers a sequence: {exc}") from exc
        if len(body) + 4 > lim.max_header_bytes:
            raise DecodeError(f"a {len(body) + 4}-byte header exceeds Limits.max_header_bytes")
        if head != PREFIX:
            if head[:3] == MAGIC and len(head) == 4:
                raise DecodeError(f"codec version {head[3]} is not supported (this is {VERSION})")
            raise DecodeError("not an rlinf codec header")
        if nbufs > lim.max_buffers:
            raise DecodeError(f"{nbufs} buffers exceed Limits.max_buffers={lim.max_buffers}")
        st = _decode.Dec(self, buffers, nbufs)
        try:
            # a container of max_items items may take 2 * max_items + 1 msgpack elements
            # (a tag first; a tagged mapping's keys and values): what the encoder lets by
            items = 2 * lim.max_items + 1
            if len(body) <= items:
                # msgpack bounds every declared length by the data's size by default, and
                # no container can hold more items than the header has bytes
                obj = _unpackb(body, ext_hook=st.ext, list_hook=st.lst, raw=False,
                               strict_map_key=False)
            else:
                obj = _unpackb(body, ext_hook=st.ext, list_hook=st.lst, raw=False,
                               strict_map_key=False, max_array_len=items,
                               max_map_len=lim.max_items)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"malformed message: {exc!r}") from exc
        if st.tags:
            raise DecodeError("malformed message: a container tag outside its container")
        if st.next != nbufs:
            raise DecodeError(f"the header uses {st.next} buffers but {nbufs} were given")
        return obj


_DEFAULT = Codec()


def encode(obj: Any) -> tuple[bytes, list]:
    """``Codec().encode(obj)`` with the default codec (pickle allowed, default limits)."""
    return _DEFAULT.encode(obj)


def decode(header: Any, buffers: Sequence[Any]) -> Any:
    """``Codec().decode(header, buffers)`` with the default codec."""
    return _DEFAULT.decode(header, buffers)
