"""Names of what a process leaves on its machine, and removing the leftovers of gone ones."""

from __future__ import annotations

import os
import subprocess
import sys

from rlinf.transports import leftovers
from rlinf.transports import shm


def _gone_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _make(directory, names: list[str]) -> None:
    for name in names:
        if name.endswith("/"):
            (directory / name).mkdir()
            (directory / name / "s").write_bytes(b"")    # a socket directory is not empty
        else:
            (directory / name).write_bytes(b"")


def test_names_carry_the_pid_and_the_pid_namespace():
    ns = leftovers.namespace()
    assert ns is not None and int(ns, 16) == os.stat("/proc/self/ns/pid").st_ino
    assert leftovers.prefix() == f"rlinf-{os.getpid()}-{ns}-"
    assert leftovers.prefix(123) == f"rlinf-123-{ns}-"


def test_remove_orphans_takes_only_what_gone_processes_of_this_namespace_left(tmp_path):
    ns, dead = leftovers.namespace(), _gone_pid()
    gone = [f"rlinf-{dead}-{ns}-ab-0", f"rlinf-{dead}-{ns}-ab-1", f"rlinf-{dead}-{ns}-k2/"]
    kept = [
        f"rlinf-{os.getpid()}-{ns}-ab-0",          # this process
        f"rlinf-{os.getppid()}-{ns}-cd-0",         # a live one
        f"rlinf-{dead}-1234abcd-ab-0",             # another PID namespace: its pid means nothing here
        f"rlinf-{dead}-x-ab-0",                    # made where the namespace was unknown
        f"rlinf-{dead}-ab-0", "rlinf-bench-floor-7", "other",
    ]
    _make(tmp_path, gone + kept)
    assert leftovers.remove_orphans([str(tmp_path)]) == len(gone)
    assert sorted(os.listdir(tmp_path)) == sorted(n.rstrip("/") for n in kept)
    assert leftovers.remove_orphans([str(tmp_path), str(tmp_path / "missing")]) == 0


def test_sweep_removes_only_that_pid_of_this_namespace(tmp_path):
    ns = leftovers.namespace()
    _make(tmp_path, [f"rlinf-123-{ns}-ab-0", f"rlinf-123-{ns}-cd-7", f"rlinf-1234-{ns}-ab-0",
                     "rlinf-123-1234abcd-ab-0", "other"])
    assert shm.sweep(123, directory=str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([f"rlinf-1234-{ns}-ab-0", "rlinf-123-1234abcd-ab-0", "other"])


def test_segments_and_socket_directories_are_named_after_their_process():
    from rlinf.transports.zeromq import ipc_dirs_of, make_ipc_dir

    path = make_ipc_dir()
    try:
        assert os.path.basename(path).startswith(leftovers.prefix())
        assert path in ipc_dirs_of(os.getpid())
    finally:
        os.rmdir(path)
    pool = shm.ShmPool(1 << 20)
    try:
        assert pool.acquire(100_000, {"peer:0": 1}) is not None
        assert pool.segment_names() and all(n.startswith(leftovers.prefix()) for n in pool.segment_names())
    finally:
        pool.close()
