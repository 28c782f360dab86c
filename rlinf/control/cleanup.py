"""Removing what a dead worker process left on its node.

A process's shared-memory segments and socket directories are named after its pid
(see :mod:`rlinf.transports.leftovers`); once it is gone, whoever notices it (the
launcher that reaped it, the worker that started a channel process) removes them here.
The manager sweeps the shared memory of the registered workers of its machine too.
"""

from __future__ import annotations

import logging
import shutil
from typing import Sequence

from ..transports.shm import sweep
from ..transports.zeromq import ipc_dirs_of

__all__ = ["remove_leftovers", "remove_socket_dirs"]

log = logging.getLogger("rlinf.control.cleanup")


def remove_leftovers(pid: int | None, socket_dirs: Sequence[str]) -> None:
    """Remove what a dead worker left on its node: the shared memory and the socket
    directories named after its pid, and the socket directories it reported. Call only
    once it is gone (until then the pid cannot be reused, and the files may be in use)."""
    if pid is not None:
        socket_dirs = [*socket_dirs, *ipc_dirs_of(pid)]   # also those made before it could report them
        try:
            sweep(pid)
        except OSError as exc:
            log.warning("rlinf: could not remove the shared memory of pid %d: %s", pid, exc)
    remove_socket_dirs(socket_dirs)


def remove_socket_dirs(socket_dirs: Sequence[str]) -> None:
    """Remove a dead process's socket directories (``rlinf.info.socket_dirs``): only it
    used them, and a clean exit already removed them."""
    for directory in socket_dirs:
        shutil.rmtree(directory, ignore_errors=True)
