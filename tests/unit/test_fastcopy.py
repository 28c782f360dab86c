"""Streaming copies (rlinf.util._fastcopy via copier.copy_bytes) give exactly the bytes
of a plain copy, at every size and alignment, and refuse what they cannot copy whole."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from rlinf.util import copier
from rlinf.util.copier import STREAM_BYTES, byte_view, copy_bytes, streaming

try:
    from rlinf.util import _fastcopy
except ImportError:
    _fastcopy = None

needs_ext = pytest.mark.skipif(_fastcopy is None, reason="rlinf.util._fastcopy not built (no C compiler at install)")

_X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_extension_is_built_where_a_compiler_is():
    """An install that found a C compiler on x86-64 must have built the streaming copy:
    a silent build failure would quietly cost large copies ~1.6x."""
    if not (_X86 and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("no C compiler on an x86-64 machine here: rlinf copies with numpy")
    assert _fastcopy is not None, "rlinf.util._fastcopy was not built: reinstall (pip install -e .)"
    assert streaming()


# sizes around the 4-page groups and the threshold; offsets that misalign source and
# destination against each other and against pages
@pytest.mark.parametrize("n", [0, 1, 63, 4095, 4097, 16383, 16384, 16385, 3 * 16384 + 4095,
                               STREAM_BYTES - 1, STREAM_BYTES, STREAM_BYTES + 12345, (5 << 20) + 7])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 17), (4093, 5), (64, 16)])
def test_copy_bytes_is_exact_at_any_size_and_alignment(n, dst_off, src_off):
    rng = np.random.default_rng(n + dst_off)
    src_all = rng.integers(0, 256, n + src_off + 64, dtype=np.uint8)
    dst_all = np.full(n + dst_off + 64, 0xAB, np.uint8)
    src, dst = src_all[src_off:src_off + n], dst_all[dst_off:dst_off + n]
    copy_bytes(dst, src)
    assert np.array_equal(dst, src)
    assert (dst_all[:dst_off] == 0xAB).all() and (dst_all[dst_off + n:] == 0xAB).all()   # nothing outside


@needs_ext
def test_the_extension_copies_exactly_and_checks_its_arguments():
    src = np.arange(3 << 20, dtype=np.uint32)          # 12 MiB
    dst = np.zeros_like(src)
    _fastcopy.copy(dst, src)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="bytes"):
        _fastcopy.copy(dst[:-1], src)
    frozen = np.zeros_like(src)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):     # numpy: "read-only"
        _fastcopy.copy(frozen, src)
    with pytest.raises((BufferError, ValueError)):     # numpy: "not C-contiguous"
        _fastcopy.copy(dst[::2], src[::2])
    with pytest.raises(TypeError):
        _fastcopy.copy(dst)
    with pytest.raises(TypeError):
        _fastcopy.copy(dst, 5)


@needs_ext
def test_overlapping_buffers_copy_as_memmove():
    base = np.arange(4 << 20, dtype=np.uint8)
    expect = base.copy()
    expect[1000:1000 + (3 << 20)] = base[0:3 << 20].copy()
    _fastcopy.copy(base[1000:1000 + (3 << 20)], base[0:3 << 20])
    assert np.array_equal(base, expect)


def test_copy_bytes_falls_back_to_numpy_for_what_does_not_stream(monkeypatch):
    """Read-only, strided or differently typed arrays go to np.copyto, with its errors."""
    src = np.arange(STREAM_BYTES, dtype=np.uint8)
    frozen = np.zeros_like(src)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_bytes(frozen, src)
    wide = np.zeros(2 * STREAM_BYTES, np.uint8)
    copy_bytes(wide[::2], src)
    assert np.array_equal(wide[::2], src)
    as_float = np.zeros(STREAM_BYTES, np.float64)
    copy_bytes(as_float, src)                            # numpy casts, as before
    assert as_float[255] == 255.0
    monkeypatch.setattr(copier, "_STREAMING", False)    # an install without the extension
    dst = np.zeros_like(src)
    copy_bytes(dst, src)
    assert np.array_equal(dst, src)


def test_byte_view_of_arrays_and_tensors():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert byte_view(a).nbytes == 48 and byte_view(a).dtype == np.uint8
    assert byte_view(a.T) is None
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.bfloat16, requires_grad=True)
    v = byte_view(t)
    assert v.nbytes == 12
    v[:2] = 0                                            # a view: writes reach the tensor
    assert t[0].item() == 0.0
    assert byte_view(t[::2]) is None
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert byte_view(c) is None                          # its bytes are not its values
    assert byte_view(torch.empty(0)).nbytes == 0
