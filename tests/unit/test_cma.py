"""Reading another process's memory (rlinf/transports/cma.py), against a real child."""

from __future__ import annotations

import errno
import multiprocessing
import os

import numpy as np
import pytest

from rlinf.util.copier import Copier
from rlinf.transports import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv / pidfd here")


def _child(conn) -> None:
    """Hold a cookie and an array of 0..255 repeated; tell the parent where; exit when told."""
    cookie = cma.Cookie()
    data = np.tile(np.arange(256, dtype=np.uint8), (3 << 20) // 256 + 1)
    conn.send((os.getpid(), cookie.address, cookie.value, cma.address_of(data), data.nbytes))
    conn.recv()


@pytest.fixture
def child():
    """A live child process: ``(process, pid, cookie address, cookie, data address, nbytes)``."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(theirs,), daemon=True)
    proc.start()
    try:
        assert ours.poll(30), "the child did not start"
        yield (proc, *ours.recv())
    finally:
        if proc.is_alive():
            ours.send("exit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def _verified(child):
    _proc, pid, where, cookie, _addr, _n = child
    try:
        return cma.verify(pid, where, cookie)
    except PermissionError as exc:   # Yama ptrace_scope or a seccomp filter: nothing to test here
        pytest.skip(f"this machine forbids reading another process: {exc}")


def test_a_verified_child_is_read_exactly_and_split_reads_agree(child):
    _proc, _pid, _where, _cookie, addr, n = child
    process = _verified(child)
    try:
        expected = np.tile(np.arange(256, dtype=np.uint8), n // 256 + 1)[:n]
        whole = np.zeros(n, np.uint8)
        process.read([(whole, cma.Remote(addr, n))])
        assert np.array_equal(whole, expected)
        parts = np.zeros(n, np.uint8)
        copier = Copier(2, split_bytes=1 << 20)
        try:   # two threads, each a part of both ranges; an odd offset too
            copier.copy([(parts[:1001], cma.Remote(addr, 1001)), (parts[1001:], cma.Remote(addr + 1001, n - 1001))],
                        process.read)
        finally:
            copier.close()
        assert np.array_equal(parts, expected)
    finally:
        process.close()


def test_a_wrong_cookie_or_a_missing_process_is_refused(child):
    _proc, pid, where, cookie, _addr, _n = child
    _verified(child).close()
    with pytest.raises(OSError) as info:
        cma.verify(pid, where, bytes(16))
    assert info.value.errno == errno.EINVAL and "cookie" in str(info.value)
    with pytest.raises(OSError):
        cma.verify(pid, 8, cookie)            # nothing mapped there
    with pytest.raises(ProcessLookupError):
        cma.verify(2 ** 22 + 12345, where, cookie)   # above pid_max's ceiling: no such process


def test_a_process_that_exited_is_never_read_again(child):
    proc, _pid, _where, _cookie, addr, _n = child
    process = _verified(child)
    try:
        assert process.alive()
        proc.kill()
        proc.join(10)
        assert not process.alive()
        with pytest.raises(ProcessLookupError):
            process.read([(np.zeros(16, np.uint8), cma.Remote(addr, 16))])
    finally:
        process.close()
    assert not process.alive()                # closed: refused too
    process.close()                           # idempotent


def test_remote_ranges_slice_like_arrays():
    r = cma.Remote(0x1000, 100)
    assert (r[10:30].address, r[10:30].nbytes) == (0x100A, 20)
    assert r[90:500].nbytes == 10 and r[:].nbytes == 100
    with pytest.raises(ValueError):
        r[::2]
