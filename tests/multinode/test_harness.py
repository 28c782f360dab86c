"""The emulated nodes are what the other tests take them for: separate machines (network,
hostname, ``/tmp``, ``/dev/shm``, PIDs) that see the repository, reach each other only
through their links, and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from . import netns

pytestmark = pytest.mark.multiproc


def test_nodes_are_separate_machines_that_see_the_repository(nodes):
    n = nodes(2)
    files = [f"/tmp/rlinf-mn-{os.getpid()}", f"/dev/shm/rlinf-mn-{os.getpid()}"]
    n.sh(0, " && ".join(f"echo here > {f}" for f in files))
    for i in range(2):
        seen = n.sh(i, "hostname; ip -o -4 addr show; ls /tmp /dev/shm; echo pid $$; "
                       f"cd / && PYTHONPATH={netns.REPO} {sys.executable} -c "
                       "'import rlinf, tests.multinode; print(rlinf.__file__)'")
        assert seen.splitlines()[0] == f"node{i}"
        assert f"inet {n[i].address}/24" in seen and "inet 127.0.0.1/8" in seen   # eth0, and loopback up
        assert ("rlinf-mn-" in seen) == (i == 0)                                       # /tmp, /dev/shm private
        assert str(netns.REPO / "rlinf" / "__init__.py") in seen                      # the repository, visible
        assert int(seen.split("pid ")[1].split()[0]) < 100                           # its own PID numbering
    for f in files:
        assert not os.path.exists(f)                                                   # nor is ours touched


def test_nodes_reach_each_other_only_through_their_links(nodes):
    n = nodes(3)
    n.check_reachable(0, 2)
    n.check_reachable(2, 1)
    n.link_down(2)
    with pytest.raises(netns.HarnessError):
        n.check_reachable(0, 2, timeout=1)
    n.link_up(2)
    n.check_reachable(0, 2)


def test_a_node_can_be_stalled_and_killed_with_everything_in_it(nodes):
    n = nodes(2)
    proc = n.spawn(1, [sys.executable, "-c", "import time\nwhile True: print('tick', flush=True); time.sleep(0.01)"])
    proc.expect_line("tick", timeout=20)
    proc.stop()
    assert _state(proc.pid) == "T"
    proc.cont()
    proc.expect_line("tick", timeout=20)
    child = n.spawn(1, ["sleep", "600"])
    holder = n[1].pid
    n.kill_node(1, link_first=True)
    for pid in (proc.pid, child.pid, holder):
        _until_gone(pid)
    assert proc.wait(timeout=10) != 0
    _until_link_gone(n, n[1].veth)              # the link went with the namespace
    n.check_reachable(0, 0)                     # the other node is untouched


def test_two_nodes_may_share_a_hostname_and_stay_apart(nodes):
    n = nodes(2, ["twin", "twin"])
    n.sh(0, "echo a > /dev/shm/mine")
    assert n.sh(1, "hostname; ls /dev/shm").split() == ["twin"]
    n.check_reachable(1, 0)


def test_a_link_can_be_rate_limited(nodes):
    n = nodes(2)
    mbit = 40
    n.rate_limit(1, f"{mbit}mbit")
    seconds = _transfer_seconds(n, 0, 1, 8 << 20)
    assert seconds > 8 * 8 / mbit * 0.7, f"8 MiB in {seconds:.2f} s: not limited to {mbit} Mbit/s"
    n.unlimit(1)
    assert _transfer_seconds(n, 0, 1, 8 << 20) < seconds / 2


def test_netem_is_detected(multinode_allowed):
    """Not every kernel has netem (this one may not): tests that need it skip by this."""
    assert isinstance(netns.netem_available(), bool)


def test_nothing_is_left_when_the_test_process_dies(multinode_allowed, tmp_path):
    """A test process killed outright (no finally, no atexit): its nodes end with it (their
    holders see stdin close), and the next session sweeps the bridge it left."""
    code = ("import sys, time\n"
            f"sys.path.insert(0, {str(netns.REPO)!r})\n"
            "from tests.multinode import netns\n"
            "n = netns.Nodes(2)\n"
            "print(n.bridge, n[0].pid, n[1].pid, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        bridge, *holders = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    for pid in holders:
        _until_gone(int(pid))
    assert bridge in _links()
    assert bridge in netns.sweep_stale()
    assert not [name for name in _links() if name.startswith(bridge.split("z")[0])]


# --------------------------------------------------------------------------- helpers


def _state(pid: int) -> str:
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state != "R" and state != "S" or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def _until_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        assert time.monotonic() < deadline, f"process {pid} still there after {timeout} s"
        time.sleep(0.01)


def _until_link_gone(n, veth: str, timeout: float = 10) -> None:
    """The kernel dismantles a namespace whose last process died in a work queue, a little
    later: its veth leaves the root namespace then, not at once."""
    deadline = time.monotonic() + timeout
    while veth in n.leftovers():
        assert time.monotonic() < deadline, f"link {veth} still there {timeout} s after its namespace died"
        time.sleep(0.02)


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines()]


def _transfer_seconds(n: netns.Nodes, i: int, j: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over TCP from node ``i`` to node ``j`` (timed in the
    sending process, from connect to the receiver's acknowledgement of the last byte)."""
    sink = ("import socket\n"
            "s=socket.socket(); s.bind(('0.0.0.0',0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
            "c,_=s.accept(); got=0\n"
            "while (b:=c.recv(1<<20)): got+=len(b)\n"
            "c.sendall(str(got).encode()); c.close()\n")
    source = ("import socket, sys, time\n"
              "t=time.monotonic(); s=socket.create_connection((sys.argv[1],int(sys.argv[2])),10)\n"
              "s.sendall(bytes(int(sys.argv[3]))); s.shutdown(socket.SHUT_WR); got=s.recv(64)\n"
              "print(got.decode(), time.monotonic()-t)\n")
    receiver = n.spawn(j, [sys.executable, "-c", sink], name="sink")
    port = receiver.expect_line("", timeout=20).strip()
    got, seconds = n.sh(i, f"{sys.executable} -c '{source}' {n[j].address} {port} {nbytes}", timeout=60).split()
    assert int(got) == nbytes
    return float(seconds)
