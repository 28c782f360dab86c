"""Emulated machines on this one: the plumbing of the multi-node tests.

A :class:`Nodes` object builds ``n`` nodes. Each is a holder process (``holder.py``)
made with ``unshare --net --uts --ipc --mount --pid --fork``: its own network stack,
hostname, System V IPC, PID numbering, and private ``/tmp``, ``/dev/shm`` and
``/proc``. The node's ``eth0`` is one end of a veth pair whose other end joins a bridge
made for these nodes in the root namespace; the bridge has no address, so the nodes
reach each other (and their own loopback) and nothing else. Commands run inside a node
through ``nsenter`` into the holder's namespaces.

Everything made is removed by :meth:`Nodes.close` (also run at exit for whatever a
crash left open): processes, holders (their namespaces and veths go with them), the
bridge. Should the test process die without running it, the holders see their stdin
close and end, and :func:`sweep_stale` removes the bridges of dead test processes the
next time nodes are made.

Interface names carry the test process's pid (in hex), so parallel runs never clash:
``rmn<pid>z<k>`` is a bridge, ``rmn<pid>v<k>n<i>`` the outer end of node ``i``'s link.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["Nodes", "Node", "NodeProcess", "probe", "netem_available", "sweep_stale", "REPO", "SUBNET"]

#: The repository these tests belong to (what the nodes' Python imports rlinf from).
REPO = Path(__file__).resolve().parents[2]
#: The private subnet of the nodes; node ``i`` is ``SUBNET.<i + 1>``. It never leaves the
#: bridge (which has no address), so runs side by side may use the same one.
SUBNET = "10.213.77"
#: The port a manager started by :meth:`Nodes.start_manager` listens on, in its node.
MANAGER_PORT = 5555
#: Lines an agent prints for the test start with this; everything else is its log.
EVENT_PREFIX = "@@ "

_HOLDER = Path(__file__).with_name("holder.py")
_TOOLS = ("unshare", "nsenter", "ip", "tc")
_PREFIX = f"rmn{os.getpid():x}"
_STALE = re.compile(r"^rmn([0-9a-f]+)[zv]")
_counter = iter(range(1, 1 << 30))
_open: set[Nodes] = set()          # closed at exit if a test left them open


class HarnessError(RuntimeError):
    """A command of the harness failed (the output says which and why)."""


def _run(argv: list[str], *, timeout: float = 20, check: bool = True, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"{' '.join(argv)}: no answer in {timeout} s") from exc
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


def _child_of(pid: int, timeout: float = 10.0) -> int:
    """The first child of ``pid`` (nsenter and unshare fork the program they run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
        except OSError as exc:
            raise HarnessError(f"process {pid} ended before it started its child") from exc
        if children:
            return int(children[0])
        time.sleep(0.005)
    raise HarnessError(f"process {pid} started no child in {timeout} s")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _end(popen: subprocess.Popen) -> None:
    """Wait for ``popen`` (killing it if it takes over 10 s) and close its pipes."""
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=10)
    for stream in (popen.stdin, popen.stdout, popen.stderr):
        if stream is not None:
            stream.close()


def _keep_paths() -> list[str]:
    """Directories a node's Python needs that a fresh ``/tmp`` would hide: the repository,
    the interpreter's prefixes, the import path (under both their given and real names)."""
    candidates = [str(REPO), sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
    candidates += [p for p in sys.path if p] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = set()
    for p in candidates:
        if p and os.path.isdir(p):
            paths.update({os.path.abspath(p), os.path.realpath(p)})
    under_tmp = sorted(p for p in paths if p.startswith("/tmp/"))
    # a directory inside another kept one comes along with it
    return [p for p in under_tmp if not any(p.startswith(q + "/") for q in under_tmp)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the bridges and veths that test processes now dead left behind."""
    removed = []
    for line in _run(["ip", "-o", "link", "show"]).splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        m = _STALE.match(name)
        if m and not _alive(int(m.group(1), 16)):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


def probe() -> str | None:
    """Why nodes cannot be made here (None when they can): tried once, for real."""
    if os.geteuid() != 0:
        return "multi-node tests need root (network namespaces, a bridge, veth pairs, tc)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"multi-node tests need {', '.join(missing)} (util-linux, iproute2)"
    try:
        sweep_stale()
        with Nodes(2) as nodes:
            out = nodes.sh(1, "hostname; ip -o addr show eth0")
            if nodes[1].address not in out:
                return f"a node's network was not set up: {out.strip()[:200]}"
            nodes.check_reachable(1, 0)
    except (HarnessError, OSError) as exc:
        return f"cannot build emulated nodes here: {exc}"
    return None


_netem: bool | None = None


def netem_available() -> bool:
    """Whether the kernel has the ``netem`` qdisc (delay, loss); often a missing module."""
    global _netem
    if _netem is None:
        with Nodes(1) as nodes:
            done = subprocess.run(nodes.enter(0, net_only=True) + ["tc", "qdisc", "add", "dev", "lo", "root",
                                                                   "netem", "delay", "1ms"],
                                  capture_output=True, timeout=20)
            _netem = done.returncode == 0
    return _netem


class NodeProcess:
    """A program running inside a node, started through ``nsenter``.

    ``pid`` is the program's pid in the test's (root) PID namespace: signal it with
    :meth:`kill`, :meth:`stop`, :meth:`cont`. Its stdout is read by a thread: lines that
    start with ``@@ `` are events (JSON objects with a ``kind``), the rest is kept as its
    log with stderr (shown by :meth:`describe` when a test fails).
    """

    def __init__(self, node: Node, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.node = node
        self.name = name
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self._lines: queue.Queue[str] = queue.Queue()
        self._popen = subprocess.Popen(node.nodes.enter(node.index) + argv, env=env, cwd="/",
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, bufsize=1)
        self.pid = _child_of(self._popen.pid)
        self._readers = [threading.Thread(target=self._read, args=(self._popen.stdout, True), daemon=True),
                         threading.Thread(target=self._read, args=(self._popen.stderr, False), daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if is_stdout and line.startswith(EVENT_PREFIX):
                self.events.put(json.loads(line[len(EVENT_PREFIX):]))
            else:
                self.log.append(line)
                if is_stdout:
                    self._lines.put(line)

    def __repr__(self) -> str:
        return f"<NodeProcess {self.name} on {self.node.name} pid={self.pid}>"

    # -- talking to it --------------------------------------------------------------------
    def expect(self, kind: str, timeout: float = 30.0, *, required: bool = True) -> dict | None:
        """The next event of this ``kind`` (earlier events of other kinds are kept in
        ``seen``); fails the test, with the process's log, after ``timeout`` seconds
        (returns None instead when not ``required``) or when the process reports an
        error or ends."""
        deadline = time.monotonic() + timeout
        for event in self.seen:
            if event["kind"] == kind and not event.get("_taken"):
                event["_taken"] = True
                return event
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if not required:
                    return None
                raise AssertionError(f"{self.name}: no {kind!r} event in {timeout} s\n{self.describe()}")
            try:
                event = self.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self._popen.poll() is not None and self.events.empty():
                    for t in self._readers:
                        t.join(timeout=2)
                    if self.events.empty():
                        raise AssertionError(f"{self.name} ended (exit {self._popen.returncode}) "
                                             f"before a {kind!r} event\n{self.describe()}") from None
                continue
            self.seen.append(event)
            if event["kind"] == "error" and kind != "error":
                raise AssertionError(f"{self.name} failed: {event.get('error')}\n{self.describe()}")
            if event["kind"] == kind:
                event["_taken"] = True
                return event

    def expect_line(self, needle: str, timeout: float = 30.0) -> str:
        """The next plain stdout line that contains ``needle``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self._popen.poll() is not None and self._lines.empty()):
                raise AssertionError(f"{self.name}: no line with {needle!r} in {timeout} s\n{self.describe()}")
            try:
                line = self._lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if needle in line:
                return line

    def tell(self, command: str, **fields) -> None:
        """Send the agent a command (a JSON line on its stdin)."""
        self._popen.stdin.write(json.dumps({"command": command, **fields}) + "\n")
        self._popen.stdin.flush()

    def describe(self) -> str:
        return f"--- {self!r}, last lines of its output:\n" + "\n".join(self.log)

    # -- its life ---------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float = 30.0) -> int:
        """Its exit status (nsenter passes the program's on); fails after ``timeout`` s."""
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not end in {timeout} s\n{self.describe()}") from None

    def signal(self, signum: int) -> None:
        if self._popen.poll() is None:
            _signal(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL it (and wake nsenter, should it be stopped, so that it reaps it)."""
        self.signal(signal.SIGKILL)
        self._wake_nsenter()

    def stop(self) -> None:
        """Stall it (SIGSTOP) until :meth:`cont`."""
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        self._wake_nsenter()
        self.signal(signal.SIGCONT)

    def _wake_nsenter(self) -> None:
        # nsenter stops itself when its child stops (job control), and would then never
        # reap it: a dead child left unreaped keeps the node's PID 1 from exiting.
        if self._popen.poll() is None:
            _signal(self._popen.pid, signal.SIGCONT)

    def _reap(self) -> None:
        """Kill it, wait for it, and close its pipes once the readers have seen their end
        (a child it started still holds them until the node dies: kill the node first)."""
        self.kill()
        self._popen.wait(timeout=10)
        for t in self._readers:
            t.join(timeout=10)
        _end(self._popen)


class Node:
    """One emulated machine: ``index``, ``name`` (its hostname), ``address`` (on the
    bridge), ``veth`` (the outer end of its link, in the root namespace) and ``pid``
    (its holder, PID 1 of the node, as the root namespace numbers it)."""

    def __init__(self, nodes: Nodes, index: int, name: str) -> None:
        self.nodes = nodes
        self.index = index
        self.name = name
        self.address = f"{SUBNET}.{index + 1}"
        self.veth = f"{_PREFIX}v{nodes.serial:x}n{index:x}"
        if len(self.veth) > 15:
            raise HarnessError(f"interface name {self.veth!r} is longer than 15 characters")
        self.alive = False
        self.limited = False
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--ipc", "--mount", "--pid", "--fork", "--kill-child",
             sys.executable, str(_HOLDER), name, *_keep_paths()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.pid = _child_of(self._holder.pid)
            line = self._holder.stdout.readline()     # holder.py prints "ready" when set up
            if not line.startswith("ready"):
                raise HarnessError(f"node {name}: holder failed: {line.strip()} {self._holder.stderr.read()[-500:]}")
        except BaseException:
            self._holder.kill()                       # unshare --kill-child takes the holder along
            _end(self._holder)
            raise
        self.alive = True

    def __repr__(self) -> str:
        return f"<Node {self.index} {self.name} {self.address} holder={self.pid}>"

    def kill(self) -> None:
        """Kill the holder: as PID 1 of the node, every process in it dies with it."""
        if self.alive:
            self.alive = False
            _signal(self.pid, signal.SIGKILL)
        _end(self._holder)


class Nodes:
    """``n`` emulated nodes on one bridge; a context manager (or call :meth:`close`).

    Args:
        n: how many nodes.
        hostnames: their hostnames (default ``node0``, ``node1``, ...); two nodes may
            have the same one (containers with host names shared).
    """

    def __init__(self, n: int, hostnames: list[str] | None = None) -> None:
        if hostnames is None:
            hostnames = [f"node{i}" for i in range(n)]
        if len(hostnames) != n or n < 1 or n > 200:
            raise ValueError("one hostname per node, 1 to 200 nodes")
        self.serial = next(_counter)
        self.bridge = f"{_PREFIX}z{self.serial:x}"
        self.nodes: list[Node] = []
        self.processes: list[NodeProcess] = []
        self.token = secrets.token_hex(16)
        self.manager: str | None = None
        #: node index -> CPU list (``taskset -c`` syntax): programs started there from now
        #: on run pinned to it (benchmarks compare placements; tests leave it empty)
        self.cpus: dict[int, str] = {}
        self._closed = False
        _open.add(self)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i, hostname in enumerate(hostnames):
                node = Node(self, i, hostname)
                self.nodes.append(node)
                _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", str(node.pid)])
                _run(["ip", "link", "set", node.veth, "master", self.bridge, "up"])
                _run(self.enter(i, net_only=True) + ["ip", "-b", "-"], stdin=(
                    "link set lo up\n"
                    f"addr add {node.address}/24 dev eth0\n"
                    "link set eth0 up\n"))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<Nodes {self.bridge} {self.nodes}>"

    # -- running things inside ----------------------------------------------------------------
    def enter(self, i: int, *, net_only: bool = False) -> list[str]:
        """The command prefix that runs a program inside node ``i``."""
        node = self.nodes[i]
        if not node.alive:
            raise HarnessError(f"node {node.name} was killed")
        if net_only:
            return ["nsenter", "-t", str(node.pid), "-n"]
        return ["nsenter", "-t", str(node.pid), "-n", "-u", "-i", "-m", "-p"]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process in a node: this one without ``RLINF_*``, the
        repository first on the import path, unbuffered output."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLINF_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p])
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def sh(self, i: int, script: str, timeout: float = 20) -> str:
        """Run a shell script in node ``i``; its stdout."""
        return _run(self.enter(i) + ["sh", "-c", script], timeout=timeout)

    def spawn(self, i: int, argv: list[str], *, name: str | None = None, env: dict | None = None) -> NodeProcess:
        """Start ``argv`` inside node ``i`` (pinned to ``cpus[i]`` if set); killed at
        :meth:`close` if still running."""
        if i in self.cpus:
            argv = ["taskset", "-c", self.cpus[i], *argv]      # execs argv: the pid stays
        proc = NodeProcess(self.nodes[i], name or argv[0], argv, env or self.env())
        self.processes.append(proc)
        return proc

    def start_manager(self, i: int = 0, **env: str) -> str:
        """Run ``python -m rlinf.manager`` in node ``i`` (extra ``RLINF_*`` settings by
        keyword); its endpoint, which :meth:`agent` passes on. Returns once it listens."""
        endpoint = f"tcp://{self.nodes[i].address}:{MANAGER_PORT}"
        proc = self.spawn(i, [sys.executable, "-m", "rlinf.manager", "--bind", endpoint, "--token", self.token],
                          name=f"manager@{self.nodes[i].name}", env=self.env(**env))
        proc.expect_line("listening on", timeout=60)
        self.manager = endpoint
        return endpoint

    def agent(self, i: int, function: str, address: str, /, **kwargs) -> NodeProcess:
        """Run ``agents.<function>(comm, ctl, **kwargs)`` in node ``i`` as worker ``address``
        of this nodes' manager (``RLINF_MANAGER``/``RLINF_TOKEN``; it advertises its
        node's address, found from the manager's subnet). ``kwargs`` travel as JSON;
        ``env`` (a dict), if given, adds environment variables."""
        if self.manager is None:
            raise HarnessError("start_manager() first")
        env = self.env(RLINF_MANAGER=self.manager, RLINF_TOKEN=self.token, RLINF_ADDRESS=address,
                       **kwargs.pop("env", {}))
        return self.spawn(i, [sys.executable, "-m", "tests.multinode.agent", function, json.dumps(kwargs)],
                          name=f"{address}@{self.nodes[i].name}", env=env)

    def check_reachable(self, i: int, j: int, timeout: float = 5.0) -> None:
        """Node ``i`` can open a TCP connection to node ``j`` within ``timeout`` seconds
        (raises :class:`HarnessError` if not)."""
        code = ("import socket,sys\n"
                "s=socket.socket(); s.bind(('0.0.0.0',0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
                "c,_=s.accept(); c.sendall(b'ok')\n")
        server = NodeProcess(self.nodes[j], "listener", [sys.executable, "-c", code], self.env())
        try:
            port = server.expect_line("", timeout=20).strip()
            got = _run(self.enter(i) + [sys.executable, "-c",
                                        "import socket,sys; s=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
                                        "float(sys.argv[3])); print(s.recv(2).decode())",
                                        self.nodes[j].address, port, str(timeout)])
            if got.strip() != "ok":
                raise HarnessError(f"node {i} cannot reach node {j}: {got!r}")
        finally:
            server._reap()

    # -- faults -------------------------------------------------------------------------------
    def kill_node(self, i: int, *, link_first: bool = False) -> None:
        """Kill node ``i`` and everything in it. ``link_first``: take its link down
        first, so no FIN or RST ever leaves it (a machine losing power); otherwise its
        processes die as by ``kill -9`` and the kernel closes their connections."""
        if link_first:
            self.link_down(i)
        self.nodes[i].kill()

    def link_down(self, i: int) -> None:
        """Cut node ``i``'s cable: its link goes down (both ends lose carrier)."""
        _run(["ip", "link", "set", self.nodes[i].veth, "down"])

    def link_up(self, i: int) -> None:
        _run(["ip", "link", "set", self.nodes[i].veth, "up"])

    def rate_limit(self, i: int, rate: str, *, burst: str = "64kb", latency: str = "200ms") -> None:
        """Limit node ``i``'s link to ``rate`` (tc syntax, e.g. ``"20mbit"``) both ways:
        a token bucket on both ends of its veth."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        _run(["tc", "qdisc", "replace", "dev", self.nodes[i].veth, "root"] + tbf)
        _run(self.enter(i, net_only=True) + ["tc", "qdisc", "replace", "dev", "eth0", "root"] + tbf)
        self.nodes[i].limited = True

    def netem(self, i: int, spec: str) -> None:
        """``tc qdisc ... netem <spec>`` (e.g. ``"delay 20ms loss 1%"``) on both ends of
        node ``i``'s link. Check :func:`netem_available` first."""
        netem = ["netem"] + spec.split()
        _run(["tc", "qdisc", "replace", "dev", self.nodes[i].veth, "root"] + netem)
        _run(self.enter(i, net_only=True) + ["tc", "qdisc", "replace", "dev", "eth0", "root"] + netem)
        self.nodes[i].limited = True

    def unlimit(self, i: int) -> None:
        """Remove node ``i``'s qdiscs (rate limit or netem)."""
        node = self.nodes[i]
        if node.limited:
            node.limited = False
            _run(["tc", "qdisc", "del", "dev", node.veth, "root"], check=False)
            if node.alive:
                _run(self.enter(i, net_only=True) + ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Remove everything: processes, qdiscs, nodes (and with them their namespaces
        and veths), the bridge. Idempotent; safe after a failure halfway through."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for proc in self.processes:
            proc.kill()
        for node in self.nodes:
            try:
                self.unlimit(node.index)
                node.kill()           # and everything left in it
            except Exception as exc:  # keep removing the rest
                errors.append(exc)
        for proc in self.processes:
            try:
                proc._reap()
            except Exception as exc:
                errors.append(exc)
        for node in self.nodes:
            _run(["ip", "link", "del", node.veth], check=False)   # gone with the namespace, normally
        _run(["ip", "link", "del", self.bridge], check=False)
        _open.discard(self)
        if errors:
            raise HarnessError(f"teardown of {self.bridge} failed: {errors!r}")

    def leftovers(self) -> list[str]:
        """Interfaces of these nodes still present in the root namespace (none after close)."""
        names = {self.bridge} | {n.veth for n in self.nodes}
        out = _run(["ip", "-o", "link", "show"])
        return [n for n in (line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines())
                if n in names]


@atexit.register
def _close_all() -> None:
    for nodes in list(_open):
        try:
            nodes.close()
        except Exception as exc:
            print(f"multinode: teardown at exit failed: {exc}", file=sys.stderr)
