"""Streaming copies (rlinf.util._fastcopy via copier.copy_bytes) give exactly the bytes
of a plain copy, at every size and alignment, and refuse what they cannot copy whole."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import warnings

import numpy as np
import pytest

from rlinf.util import copier
from pathlib import Path

from rlinf.util.copier import STREAM_BYTES, byte_view, copy_bytes, streaming

try:
    from rlinf.util import _fastcopy
except ImportError:
    _fastcopy = None

needs_ext = pytest.mark.skipif(_fastcopy is None, reason="rlinf.util._fastcopy not built (no C compiler at install)")

_X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_extension_is_built_where_it_can_be():
    """An install on x86-64 with a C compiler and Python's headers must have built the
    streaming copy: a silent build failure would quietly slow every large copy."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (_X86 and shutil.which(compiler) and headers.exists()):
        pytest.skip(f"cannot build here (x86-64: {_X86}, compiler {compiler!r}: {bool(shutil.which(compiler))}, "
                    f"{headers}: {headers.exists()}): rlinf copies with numpy")
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


# -- what must never be copied as bytes, and what torch must still see (review of afd595b)

def _child(code: str) -> subprocess.CompletedProcess:
    """In a child process: a raw copy of object references crashes the interpreter."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_object_arrays_are_copied_as_references_not_bytes():
    r = _child("""
        import gc, numpy as np
        from rlinf.codec import decode, encode
        from rlinf.codec.into import copy_into
        n = 400_000                                    # 3 MiB of pointers: past STREAM_BYTES
        target = {"x": np.empty(n, object)}
        copy_into(target, decode(*encode({"x": np.array([str(i) * 3 for i in range(n)], dtype=object)})))
        gc.collect()
        assert target["x"][7] == "777" and sum(len(s) for s in target["x"]) > 0
        del target; gc.collect(); print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-500:])


def test_string_dtype_arrays_are_not_copied_as_bytes():
    dtypes = pytest.importorskip("numpy.dtypes")
    if not hasattr(dtypes, "StringDType"):
        pytest.skip("numpy without StringDType")
    r = _child("""
        import numpy as np
        from numpy.dtypes import StringDType
        from rlinf.codec.into import copy_into
        n = 200_000
        src = np.array(["x" * 40 + str(i) for i in range(n)], dtype=StringDType())
        dst = np.empty(n, StringDType())
        copy_into(dst, src); del src
        assert dst[5] == "x" * 40 + "5"; del dst; print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout and not r.stderr, (r.returncode, r.stderr[-500:])


def test_recv_into_a_parameter_moves_its_version_as_copy_does():
    """autograd must refuse a backward through a graph that saved the old values."""
    torch = pytest.importorskip("torch")
    from rlinf.codec.into import copy_into
    p = torch.ones(STREAM_BYTES // 4 * 2, requires_grad=True)
    y = (p * p).sum()
    before = p._version
    copy_into(p, torch.full(p.shape, 3.0))
    assert p._version > before and p[0].item() == 3.0
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward()


def test_tensors_whose_bytes_are_not_their_values_copy_by_value():
    torch = pytest.importorskip("torch")
    from rlinf.codec import decode, encode
    from rlinf.codec.into import copy_into
    n = STREAM_BYTES                                    # int8: past the threshold
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = torch.quantize_per_tensor(torch.linspace(-1, 1, n), 0.01, 3, torch.qint8)
        t = torch.quantize_per_tensor(torch.zeros(n), 0.5, 0, torch.qint8)
        copy_into(t, s)
        assert torch.equal(t.dequantize(), s.dequantize())
        assert byte_view(s) is None
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1., 2.]), (1 << 20,))
        target = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([0.]), (1 << 20,))
        copy_into({"w": target}, decode(*encode({"w": sparse})))
        assert target.to_dense()[5].item() == 2.0 and byte_view(sparse) is None


def test_an_inference_tensor_is_refused_as_torch_refuses_it():
    torch = pytest.importorskip("torch")
    from rlinf.codec.into import copy_into
    with torch.inference_mode():
        t = torch.zeros(STREAM_BYTES)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        copy_into(t, torch.ones(STREAM_BYTES))
    assert byte_view(t) is not None and byte_view(t, write=True) is None
    with torch.inference_mode():                        # where torch allows it, so do we
        copy_into(t, torch.ones(STREAM_BYTES))
    assert t[-1].item() == 1.0
