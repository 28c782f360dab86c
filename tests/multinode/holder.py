"""The long-lived first process of one emulated node (see ``netns.py``).

Run as ``unshare --net --uts --ipc --mount --pid --fork python holder.py HOSTNAME KEEP...``:
it is PID 1 of the node's PID namespace. It makes the node's mounts private, gives it
its own ``/tmp``, ``/dev/shm`` and ``/proc``, binds the ``KEEP`` directories (the
repository, the interpreter) back into the fresh ``/tmp`` when they live under it, sets
the hostname, prints ``ready``, and then waits. It ends when its stdin closes (the test
process ended, however abruptly): as PID 1, its exit kills every process of the node,
and with them the node's network namespace and link. While it waits it reaps the
orphans of the node, as an init does.
"""

import ctypes
import os
import signal
import socket
import sys

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None):
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target} ({fstype}): {os.strerror(errno)}")


def _reap(signum, frame):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def main(hostname, keep):
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    # Directories under /tmp that must stay visible: hold them open, so that they can be
    # bound back from their old place once a fresh tmpfs hides it.
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep
            if path.startswith("/tmp/") and os.path.isdir(path)]
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    for path, fd in held:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    socket.sethostname(hostname)
    signal.signal(signal.SIGCHLD, _reap)
    print("ready", os.getpid(), flush=True)
    while sys.stdin.buffer.read(4096):
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
