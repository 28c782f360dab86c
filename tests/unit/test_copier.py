"""rlinf.util.copier: large copies split across threads give the bytes of a plain copy."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rlinf.config import Settings
from rlinf.util.copier import Copier, default_threads, split


def _pairs(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(np.zeros(n, np.uint8), rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]


@pytest.mark.parametrize("sizes,parts", [
    ([10 << 20], 2),
    ([3 << 20, 5 << 20, 1, 0, (2 << 20) + 7], 2),
    ([1 << 20] * 9, 3),
    ([(64 << 10) * 3 + 1], 4),
])
def test_split_covers_every_byte_once_in_balanced_parts(sizes, parts):
    pairs = _pairs(sizes)
    cut = split(pairs, parts)
    assert 1 <= len(cut) <= parts
    for part in cut:
        for dst, src in part:
            np.copyto(dst, src)
    for dst, src in pairs:
        assert np.array_equal(dst, src)
    total = sum(sizes)
    sizes_per_part = [sum(src.nbytes for _, src in part) for part in cut]
    assert sum(sizes_per_part) == total
    assert max(sizes_per_part) <= -(-total // parts) + (64 << 10)


def test_large_copies_are_split_across_threads_and_exact():
    seen = set()
    copier = Copier(2, split_bytes=1 << 20)

    def spy(pairs):     # the copy function of each part (cma reads pass theirs so)
        seen.add(threading.get_ident())
        for dst, src in pairs:
            np.copyto(dst, src)

    try:
        pairs = _pairs([3 << 20, 1 << 20, 123])
        copier.copy(pairs, spy)
    finally:
        copier.close()
    assert all(np.array_equal(d, s) for d, s in pairs)
    assert len(seen) == 2, "the copy was not split across two threads"


def test_small_copies_and_one_thread_stay_on_the_caller():
    for copier, sizes in ((Copier(2), [1 << 20]), (Copier(1, split_bytes=0), [4 << 20])):
        pairs = _pairs(sizes, seed=1)
        copier.copy(pairs)
        assert copier._pool is None
        assert all(np.array_equal(d, s) for d, s in pairs)
        copier.close()


def test_a_failing_part_raises_after_every_part_is_done():
    copier = Copier(2, split_bytes=1)
    good = _pairs([2 << 20])[0]
    bad = (np.zeros(5, np.uint8), np.ones(7, np.uint8))     # shapes that cannot be copied
    try:
        with pytest.raises(ValueError):
            copier.copy([good, bad])
    finally:
        copier.close()
    assert np.array_equal(*good)


def test_closed_copier_still_copies_on_the_caller():
    copier = Copier(2, split_bytes=1)
    copier.close()
    pairs = _pairs([2 << 20])
    copier.copy(pairs)
    assert copier._pool is None and np.array_equal(*pairs[0])


def test_threads_setting(monkeypatch):
    threads = Settings.from_env({"RLINF_COPY_THREADS": "3"}).copy_threads
    assert threads == 3 and Copier(threads).threads == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="RLINF_COPY_THREADS"):
            Settings.from_env({"RLINF_COPY_THREADS": bad})
    assert Settings.from_env({}).copy_threads is None
    monkeypatch.setenv("RLINF_COPY_THREADS", "3")          # the environment is not read here
    assert default_threads() in (1, 2) and Copier().threads == default_threads() == Copier(None).threads
    with pytest.raises(ValueError):
        Copier(0)
