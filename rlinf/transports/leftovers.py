"""What a process leaves on its machine, and removing it once the process is gone.

Every file or directory an rlinf process makes for its own use on this machine (its
shared-memory segments in ``/dev/shm``, its socket directories in ``/tmp``) is named
``rlinf-<pid>-<ns>-...``: its pid, and the PID namespace in which that pid means this
process (:func:`prefix`). Once the process is gone, whoever notices (the manager, a
peer, the launcher) removes them by that name (:func:`owned_by`).

A job that died all at once, its manager with it (a ``kill -9`` of the whole process
group, the OOM killer, a lost container), leaves them with no one to notice. So every
manager and communicator that starts removes the leftovers of gone processes of its
own PID namespace (:func:`remove_orphans`). Names of another namespace are never
touched: a pid there may be a live process that ours cannot see.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Iterable

from ..util.procs import process_gone

__all__ = ["SHM_DIR", "namespace", "prefix", "owned_by", "remove", "remove_orphans"]

log = logging.getLogger("rlinf.transports.leftovers")

SHM_DIR = "/dev/shm"
#: What no namespace tag is made of: names made where the namespace is unknown.
_UNKNOWN = "x"
_NAME = re.compile(r"rlinf-(\d+)-([0-9a-f]+|x)-")


def namespace() -> str | None:
    """This process's PID namespace, as a name tag (None where it cannot be known)."""
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return None


def prefix(pid: int | None = None) -> str:
    """How the names of what process ``pid`` (default: this one) makes begin. ``pid``
    must belong to this process's PID namespace."""
    return f"rlinf-{os.getpid() if pid is None else int(pid)}-{namespace() or _UNKNOWN}-"


def tmp_dir() -> str:
    """Where socket directories are made (short paths: AF_UNIX allows 107 bytes)."""
    return "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()


def owned_by(pid: int, directory: str) -> list[str]:
    """The paths in ``directory`` that process ``pid`` of this namespace made."""
    start = prefix(pid)
    try:
        return [os.path.join(directory, name) for name in os.listdir(directory) if name.startswith(start)]
    except OSError:
        return []


def remove(path: str) -> bool:
    """Remove a file or a directory tree; True if it was there and is gone."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("rlinf: cannot remove %s: %s", path, exc)
        return False


def remove_orphans(directories: Iterable[str] | None = None) -> int:
    """Remove what gone processes of this PID namespace left in ``directories``
    (default: ``/dev/shm`` and the socket directory root). Returns how many entries
    went. Call at start-up; a live process's entries are never touched."""
    ours = namespace()
    if ours is None:
        return 0
    me, gone, removed = os.getpid(), {}, 0
    for directory in directories if directories is not None else (SHM_DIR, tmp_dir()):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            match = _NAME.match(name)
            if match is None or match[2] != ours:
                continue
            pid = int(match[1])
            if pid == me:
                continue
            if pid not in gone:
                gone[pid] = process_gone(pid)
            if gone[pid] and remove(os.path.join(directory, name)):
                removed += 1
    if removed:
        log.info("rlinf: removed %d leftovers of processes that are gone (%s)", removed,
                 ", ".join(str(p) for p, g in gone.items() if g))
    return removed
