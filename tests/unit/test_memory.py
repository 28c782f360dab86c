"""rlinf.util.memory: page-aligned buffers for copies (see its module docstring)."""

import mmap

import numpy as np
import pytest

from rlinf.util.memory import page_aligned, page_aligned_like


@pytest.mark.parametrize("n", [1, 16, 4095, 4096, 64 << 10, 400 << 10, 3 << 20])
def test_page_aligned_starts_on_a_page_and_has_the_size(n):
    a = page_aligned(n)
    assert a.dtype == np.uint8 and a.nbytes == n and a.flags.writeable
    assert a.ctypes.data % mmap.PAGESIZE == 0


def test_page_aligned_like_matches_shape_and_dtype_in_c_order():
    x = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(4, 6))
    y = page_aligned_like(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.flags.c_contiguous
    assert y.ctypes.data % mmap.PAGESIZE == 0
    np.copyto(y, x)
    assert np.array_equal(y, x)
    assert page_aligned_like(np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert page_aligned_like(np.float32(2.0).reshape(())).shape == ()


def test_the_buffer_keeps_its_memory_alive():
    view = page_aligned(1 << 20)[4096:8192]   # nothing else refers to the allocation
    view[:] = 7
    assert int(view.sum()) == 7 * 4096
