"""A worker in a mount namespace of its own (run as a script by ``test_node_identity.py``).

    python ns_worker.py SPEC_JSON

SPEC: ``{"shm": bool, "keep": [paths under /tmp], "address", "peer", "manager",
"token", "first": bool}``. Before importing rlinf it leaves the test's mount namespace
(``unshare(CLONE_NEWNS)``, mounts made private), mounts a private tmpfs on ``/tmp`` (and
on ``/dev/shm`` when ``shm`` is true), then binds ``keep`` back from the old ``/tmp``
(the repository and the interpreter may live there: CI clones to ``/tmp``). So it shares
the host name, kernel, network and PIDs with the test, as a container with host
networking does, but not its files.

Then it exchanges with ``peer``: the ``first`` sends a 40 MiB array and small messages,
the other checks them and sends the array back; the last line of stdout is a JSON
report. Exit status 77: the namespace cannot be made here (the reason on stdout).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
SKIP = 77


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def enter_namespace(private_shm: bool, keep: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    try:
        if libc.unshare(CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)     # nothing we mount reaches the test
        if private_shm:
            _mount(libc, "tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777")
        old_tmp = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)   # the way back to what /tmp held
        _mount(libc, "tmpfs", "/tmp", "tmpfs", 0, "mode=1777")
    except OSError as exc:
        print(f"cannot make a private /tmp and /dev/shm here: {exc}", flush=True)
        sys.exit(SKIP)
    for path in keep:           # the kernel follows /proc/self/fd/N to the covered /tmp
        os.makedirs(path, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{old_tmp}/{os.path.relpath(path, '/tmp')}", path, None, MS_BIND | MS_REC)
    os.close(old_tmp)


async def exchange(spec: dict) -> dict:
    import numpy as np

    import rlinf

    big = np.random.default_rng(23).integers(0, 255, 40 << 20, dtype=np.uint8)
    peer, small = spec["peer"], 50
    async with rlinf.connect(spec["address"], manager=spec["manager"], token=spec["token"]) as comm:
        report = {"info": comm.info.to_wire(), "tmp": sorted(os.listdir("/tmp")),
                  "shm": sorted(os.listdir("/dev/shm"))}
        start = time.monotonic()
        if spec["first"]:
            await comm.send(big, peer, timeout=10)
            for i in range(small):
                await comm.send(i, peer, tag=1, timeout=10)
            back = await comm.recv(peer, timeout=10)
            report["big_back"] = bool(np.array_equal(back, big))
            report["done"] = await comm.recv(peer, tag=2, timeout=10)
            report.update(_route(comm, peer, big))     # while the peer waits for "fin"
            await comm.send("fin", peer, tag=3, timeout=10)
        else:
            got = await comm.recv(peer, timeout=10)
            report["big"] = bool(np.array_equal(got, big))
            report["small"] = [await comm.recv(peer, tag=1, timeout=10) for _ in range(small)] == list(range(small))
            await comm.send(got, peer, timeout=10)
            await comm.send("done", peer, tag=2, timeout=10)
            report.update(_route(comm, peer, big))     # while the peer waits for "fin"
            report["fin"] = await comm.recv(peer, tag=3, timeout=10)
        report["seconds"] = time.monotonic() - start
    return report


def _route(comm, peer: str, big) -> dict:
    """How messages to ``peer`` went: the link and the route of ``big``."""
    from rlinf.routing import select_transport

    session = comm._sessions.get(peer)
    link = session.outbox.link
    return {"link": f"{type(link).__name__} {getattr(link, 'endpoint', '').partition('://')[0]}",
            "route": select_transport(comm.info, session.info, big).transport}


def main() -> None:
    spec = json.loads(sys.argv[1])
    enter_namespace(spec["shm"], spec["keep"])
    from rlinf.control.client import run

    try:
        report = run(exchange(spec))
    except Exception as exc:     # the test shows it
        report = {"error": repr(exc)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
