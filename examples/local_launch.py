"""Start N copies of a script with the environment torchrun gives its workers.

The examples' ``--local N`` mode uses it, so they run without torchrun. Standalone:

    python examples/local_launch.py 3 examples/torch_port_rlinf.py

Sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT; if one copy fails, the others are terminated. Returns its exit code.
"""

import os
import socket
import subprocess
import sys


def launch(script: str, nproc: int, args: list[str] = ()) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = {}
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        p = subprocess.Popen([sys.executable, script, *args], env=env)
        procs[p.pid] = p
    failed = 0
    while procs:
        pid, status = os.wait()
        p = procs.pop(pid, None)
        if p is None:
            continue
        p.returncode = code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code
            print(f"rank with pid {pid} failed ({code}); stopping the others", file=sys.stderr)
            for other in procs.values():
                other.terminate()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[2], int(sys.argv[1]), sys.argv[3:]))
