"""rlinf.config: one parser per kind of value, today's defaults, the frozen Settings,
from_env reading only what it is given, and docs/configuration.md kept current."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlinf import config
from rlinf.config import (DEFAULTS, LaunchEnv, Settings, knobs, parse_bool, parse_duration, parse_int, parse_names,
                          parse_size, parse_str, visible_devices)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"
DOC = ROOT / "docs" / "configuration.md"

K, M, G = 1 << 10, 1 << 20, 1 << 30

#: Today's defaults, as the code that reads each variable had them before Settings.
TODAY = {
    "RLINF_SHM_THRESHOLD": 256 * K,          # routing.DEFAULT_SHM_THRESHOLD
    "RLINF_BULK_THRESHOLD": 1 * M,           # routing.DEFAULT_BULK_THRESHOLD
    "RLINF_DISABLE_TRANSPORTS": frozenset(),
    "RLINF_SHM_CAP": None,                   # min(4 GiB, half of /dev/shm), decided at the pool
    "RLINF_SHM_VIEWS": True,
    "RLINF_SHM_OFFLOAD": 16 * M,             # _shm_common.DEFAULT_OFFLOAD
    "RLINF_SHM_PULL": 1 * M,                 # _pull.DEFAULT_PULL
    "RLINF_SHM_FD": True,
    "RLINF_SHM_FD_CACHE": 2 * G,             # _fdshare.DEFAULT_FD_CACHE
    "RLINF_COPY_THREADS": None,              # 2, or 1 on a 1-CPU machine, decided by the copier
    "RLINF_CUDA_IPC_CAP": 2 * G,             # cuda_ipc.DEFAULT_CAP
    "RLINF_NO_TORCH": False,
    "RLINF_BUSY_POLL": 1000.0,               # busypoll.DEFAULT_US
    "RLINF_WINDOW_BYTES": 8 << 20,           # the credit window (flow control, issue 24)
    "RLINF_WINDOW_MSGS": 4096,
    "RLINF_PEER_TIMEOUT": 2.5,
    "RLINF_TIMEOUT": None,                   # operations without timeout= wait forever
    "RLINF_TRACE": None,                     # no timeline written
    "RLINF_HEARTBEAT_INTERVAL": 0.25,
    "RLINF_TCP_STREAM": True,
    "RLINF_TCP_ENCRYPTION": True,
    "RLINF_HOST": None,
    "RLINF_NODE_ID": None,
    "RLINF_ADDRESS": None,
    "RLINF_MANAGER": None,
    "RLINF_TOKEN": None,
}


def _field(env: str) -> str:
    return next(k.name for k in knobs() if k.env == env)


# --------------------------------------------------------------------------- parsers


@pytest.mark.parametrize("raw, value", [
    ("0", 0), ("4096", 4096), (" 4096 ", 4096), ("4096B", 4096), ("4096b", 4096),
    ("64K", 64 * K), ("64k", 64 * K), ("64KiB", 64 * K), ("64kib", 64 * K), ("64KB", 64 * K),
    ("16M", 16 * M), ("16MiB", 16 * M), ("16 MiB", 16 * M), ("16m", 16 * M),
    ("4G", 4 * G), ("4GiB", 4 * G), ("4g", 4 * G), ("1T", 1 << 40),
    ("1.5G", 3 * G // 2), ("0.5K", 512),
])
def test_size_accepts(raw, value):
    assert parse_size("RLINF_X", raw) == value


@pytest.mark.parametrize("raw", ["4X", "lots", "-1", "-4G", "1.5", "G", "4 G B", "4iB", "1e6", "nan", "inf",
                                 "0x10", "4GG", "1_000", "off"])
def test_size_rejects(raw):
    with pytest.raises(ValueError) as info:
        parse_size("RLINF_X", raw)
    assert str(info.value) == f"RLINF_X={raw!r}: not a size (use bytes or 64K/16M/4G)"


def test_size_minimum_and_off_words():
    assert parse_size("RLINF_X", "256K", minimum=256 * K) == 256 * K
    with pytest.raises(ValueError, match=r"RLINF_X='100': must be at least 262144 bytes \(256K\)"):
        parse_size("RLINF_X", "100", minimum=256 * K)
    for word in ("off", "OFF", "no", "False", "0"):
        assert parse_size("RLINF_X", word, off=True) == 0


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "True", "yes", "YES", "on", "On", " on ", "\ttrue\n"])
def test_bool_true(raw):
    assert parse_bool("RLINF_X", raw) is True


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "False", "no", "NO", "off", "Off", " off "])
def test_bool_false(raw):
    assert parse_bool("RLINF_X", raw) is False


@pytest.mark.parametrize("raw", ["2", "maybe", "y", "n", "enable", "t", "-1", "1.0", "o n"])
def test_bool_rejects(raw):
    with pytest.raises(ValueError) as info:
        parse_bool("RLINF_X", raw)
    assert str(info.value).startswith(f"RLINF_X={raw!r}: not a boolean")


@pytest.mark.parametrize("raw, value", [("2.5", 2.5), (" 10 ", 10.0), ("0.25", 0.25), ("1e-3", 0.001)])
def test_duration_accepts(raw, value):
    assert parse_duration("RLINF_X", raw) == value


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "-1", "-0.5", "0", "0.0", "soon", "2.5s", ""])
def test_duration_rejects(raw):
    with pytest.raises(ValueError) as info:
        parse_duration("RLINF_X", raw)
    assert str(info.value) == f"RLINF_X={raw!r}: not a duration (use seconds > 0, e.g. 2.5)"


def test_duration_zero_where_allowed():
    assert parse_duration("RLINF_X", "0", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match=r"RLINF_X='-5': not a duration \(use microseconds >= 0"):
        parse_duration("RLINF_X", "-5", allow_zero=True, unit="us")
    with pytest.raises(ValueError, match="RLINF_X='nan'"):
        parse_duration("RLINF_X", "nan", allow_zero=True)


def test_int():
    assert parse_int("RLINF_X", " 3 ") == 3 and parse_int("RLINF_X", "+3") == 3
    for bad in ("two", "1.5", "3K", "", "1_0"):
        with pytest.raises(ValueError, match=re.escape(f"RLINF_X={bad!r}: not a whole number")):
            parse_int("RLINF_X", bad)
    with pytest.raises(ValueError, match=r"RLINF_X='0': must be a whole number >= 1"):
        parse_int("RLINF_X", "0", minimum=1)


def test_names_and_str():
    assert parse_names("RLINF_X", "nccl, CUDA_IPC") == {"nccl", "cuda_ipc"}
    assert parse_names("RLINF_X", "shm nccl,,bulk") == {"shm", "nccl", "bulk"}
    for bad in ("shm;nccl", "shm,cuda-ipc", "a/b"):
        with pytest.raises(ValueError, match=re.escape(f"RLINF_X={bad!r}: not a list of names")):
            parse_names("RLINF_X", bad)
    assert parse_str("RLINF_X", "  tcp://10.0.0.1:5555 ") == "tcp://10.0.0.1:5555"


# --------------------------------------------------------------------------- Settings


def test_defaults_are_todays():
    assert {k.env for k in knobs()} == set(TODAY)
    settings = Settings()
    for env, value in TODAY.items():
        got = getattr(settings, _field(env))
        assert got == value and type(got) is type(value), env
    assert Settings.from_env({}) == settings


def test_every_knob_has_metadata():
    fields = dataclasses.fields(Settings)
    assert [f.name for f in fields] == [k.name for k in knobs()]
    assert len({k.env for k in knobs()}) == len(fields)
    for f in fields:
        knob = f.metadata["knob"]
        assert knob.env.startswith("RLINF_") and knob.kind in ("size", "bool", "duration", "int", "names", "str")
        assert knob.default == f.default
        assert knob.meaning.endswith(".") and "\n" not in knob.meaning, knob.env
        assert not re.search(r"\.\s+[A-Z]", knob.meaning), f"{knob.env}: meaning is more than one sentence"
        if knob.default is None and knob.kind != "str":
            assert knob.shown, f"{knob.env}: a default decided at the use site needs its rule shown"


def test_every_variable_the_code_names_is_a_knob():
    named = set()
    for path in (ROOT / "rlinf").rglob("*.py"):
        named |= set(re.findall(r"\bRLINF_[A-Z_]*[A-Z]\b", path.read_text()))
    assert named, "found no RLINF_ variables in rlinf/: the scan is broken"
    assert named <= {k.env for k in knobs()}, f"read by the code but not in Settings: {named - set(TODAY)}"


def test_each_default_reads_back():
    for knob in knobs():
        if knob.default is not None and knob.kind != "names":
            assert Settings.from_env({knob.env: knob.format(knob.default)}) == Settings(), knob.env


def test_from_env_parses_each_kind():
    s = Settings.from_env({"RLINF_SHM_CAP": "512M", "RLINF_SHM_THRESHOLD": "4k", "RLINF_CUDA_IPC_CAP": "1G",
                           "RLINF_SHM_PULL": "off", "RLINF_SHM_VIEWS": "No", "RLINF_TCP_ENCRYPTION": " OFF ",
                           "RLINF_NO_TORCH": "true", "RLINF_BUSY_POLL": "0", "RLINF_PEER_TIMEOUT": "10",
                           "RLINF_COPY_THREADS": "3", "RLINF_DISABLE_TRANSPORTS": "nccl, CUDA_IPC",
                           "RLINF_NODE_ID": " node-a ", "RLINF_TOKEN": "secret", "RLINF_UNKNOWN": "x"})
    assert (s.shm_cap, s.shm_threshold, s.cuda_ipc_cap, s.shm_pull) == (512 * M, 4 * K, G, 0)
    assert (s.shm_views, s.tcp_encryption, s.no_torch) == (False, False, True)
    assert (s.busy_poll_us, s.peer_timeout, s.copy_threads) == (0.0, 10.0, 3)
    assert s.disable_transports == {"nccl", "cuda_ipc"}
    assert (s.node_id, s.token, s.address) == ("node-a", "secret", None)


def test_the_default_timeout():
    """RLINF_TIMEOUT: unset is None (wait forever), a duration otherwise; no 0 sentinel."""
    assert Settings.from_env({}).timeout is None and Settings.from_env({"RLINF_TIMEOUT": " "}).timeout is None
    assert Settings.from_env({"RLINF_TIMEOUT": "1.5"}).timeout == 1.5
    assert Settings(timeout=2).timeout == 2.0 and type(Settings(timeout=2).timeout) is float
    assert Settings(timeout=2).replace(timeout=None).timeout is None
    peer = [k.env for k in knobs()].index("RLINF_PEER_TIMEOUT")
    assert [k.env for k in knobs()][peer + 1] == "RLINF_TIMEOUT"     # documented next to it


def test_check_timeout_applies_the_default():
    from rlinf.info import check_timeout

    assert check_timeout(None) is None and check_timeout(None, 3.0) == 3.0
    assert check_timeout(1, 3.0) == 1.0 and check_timeout(0, 3.0) == 0.0     # an explicit one wins
    with pytest.raises(ValueError, match="timeout"):
        check_timeout(-1, 3.0)
    with pytest.raises(TypeError, match="timeout"):
        check_timeout("1", 3.0)


def test_empty_means_unset():
    blank = {env: "" for env in TODAY} | {"RLINF_SHM_CAP": "   "}
    assert Settings.from_env(blank) == Settings()


@pytest.mark.parametrize("env, raw, message", [
    ("RLINF_SHM_CAP", "4X", "RLINF_SHM_CAP='4X': not a size (use bytes or 64K/16M/4G)"),
    ("RLINF_SHM_FD_CACHE", "-1", "RLINF_SHM_FD_CACHE='-1': not a size"),
    ("RLINF_CUDA_IPC_CAP", "64K", "RLINF_CUDA_IPC_CAP='64K': must be at least 262144 bytes"),
    ("RLINF_SHM_VIEWS", "maybe", "RLINF_SHM_VIEWS='maybe': not a boolean"),
    ("RLINF_PEER_TIMEOUT", "nan", "RLINF_PEER_TIMEOUT='nan': not a duration (use seconds > 0"),
    ("RLINF_HEARTBEAT_INTERVAL", "0", "RLINF_HEARTBEAT_INTERVAL='0': not a duration"),
    ("RLINF_TIMEOUT", "0", "RLINF_TIMEOUT='0': not a duration (use seconds > 0"),
    ("RLINF_TIMEOUT", "inf", "RLINF_TIMEOUT='inf': not a duration"),
    ("RLINF_TIMEOUT", "30s", "RLINF_TIMEOUT='30s': not a duration"),
    ("RLINF_BUSY_POLL", "-5", "RLINF_BUSY_POLL='-5': not a duration (use microseconds >= 0"),
    ("RLINF_COPY_THREADS", "0", "RLINF_COPY_THREADS='0': must be a whole number >= 1"),
    ("RLINF_COPY_THREADS", "two", "RLINF_COPY_THREADS='two': not a whole number"),
    ("RLINF_DISABLE_TRANSPORTS", "shm;nccl", "RLINF_DISABLE_TRANSPORTS='shm;nccl': not a list of names"),
])
def test_errors_name_the_variable_and_value(env, raw, message):
    with pytest.raises(ValueError) as info:
        Settings.from_env({env: raw})
    assert str(info.value).startswith(message)


def test_frozen_and_replace():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.shm_cap = 1
    with pytest.raises((AttributeError, TypeError)):
        s.extra = 1                       # slots: no new attributes either
    t = s.replace(peer_timeout=10, disable_transports=["shm"])
    assert (t.peer_timeout, t.disable_transports) == (10.0, frozenset({"shm"}))
    assert (s.peer_timeout, s.disable_transports) == (2.5, frozenset())
    assert t != s
    with pytest.raises(TypeError):
        Settings(4096)                     # keyword-only
    with pytest.raises(TypeError):
        s.replace(no_such_knob=1)


@pytest.mark.parametrize("changes, error", [
    ({"peer_timeout": 0}, ValueError), ({"peer_timeout": float("nan")}, ValueError),
    ({"busy_poll_us": -1}, ValueError), ({"shm_threshold": -1}, ValueError),
    ({"cuda_ipc_cap": 1024}, ValueError), ({"copy_threads": 0}, ValueError),
    ({"timeout": 0}, ValueError), ({"timeout": -1.0}, ValueError), ({"timeout": "30"}, TypeError),
    ({"shm_views": 1}, TypeError), ({"shm_cap": "4G"}, TypeError), ({"shm_offload": True}, TypeError),
    ({"disable_transports": "shm"}, TypeError), ({"token": 5}, TypeError), ({"shm_fd_cache": None}, TypeError),
])
def test_direct_values_are_checked(changes, error):
    with pytest.raises(error, match=f"Settings.{next(iter(changes))}"):
        Settings().replace(**changes)


def test_repr_hides_the_token():
    s = Settings(token="very-secret", manager="tcp://h:1")
    assert "very-secret" not in repr(s) and "tcp://h:1" in repr(s)


def test_from_env_reads_only_the_mapping_it_is_given(monkeypatch):
    monkeypatch.setenv("RLINF_SHM_CAP", "4X")
    monkeypatch.setenv("RLINF_PEER_TIMEOUT", "7")
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({"RLINF_PEER_TIMEOUT": "3"}).peer_timeout == 3.0
    with pytest.raises(ValueError, match="RLINF_SHM_CAP='4X'"):
        Settings.from_env()               # None: os.environ
    monkeypatch.delenv("RLINF_SHM_CAP")
    assert Settings.from_env().peer_timeout == 7.0

    class Untouchable(dict):
        def get(self, key, default=None):
            raise AssertionError(f"os.environ read: {key}")

        __getitem__ = get

    saved = config.os.environ
    config.os.environ = Untouchable()
    try:
        assert Settings.from_env({"RLINF_SHM_FD": "0"}).shm_fd is False
        with pytest.raises(AssertionError, match="os.environ read"):
            Settings.from_env()
    finally:
        config.os.environ = saved
    assert os.environ is saved


def test_defaults_object():
    assert DEFAULTS == Settings() == Settings.from_env({})


# --------------------------------------------------------------------------- other launchers


def test_launch_env():
    assert LaunchEnv.from_env({}) == LaunchEnv()
    env = LaunchEnv.from_env({"RANK": " 3 ", "WORLD_SIZE": "8", "MASTER_ADDR": "node7", "MASTER_PORT": "29500",
                              "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "abc",
                              "SLURM_JOB_ID": "42", "RLINF_SHM_CAP": "4X"})       # not a LaunchEnv variable
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 8, "node7", 29500)
    assert (env.agent_store, env.run_id, env.restart_count, env.slurm_job_id) == (True, "abc", "0", "42")
    blank = LaunchEnv.from_env({"RANK": "", "WORLD_SIZE": " ", "MASTER_ADDR": "", "TORCHELASTIC_USE_AGENT_STORE": ""})
    assert blank == LaunchEnv()
    assert LaunchEnv.from_env({"TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store is False
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        with pytest.raises(ValueError, match=f"{name}='x': not a whole number"):
            LaunchEnv.from_env({name: "x"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 1


def test_visible_devices(monkeypatch):
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == ""          # blank hides every GPU (CUDA's rule)
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1,0"}) == "1,0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_devices() == "-1"


# --------------------------------------------------------------------------- wiring

#: Where the environment may be read: this module, and the launcher boundary (the local
#: launcher saves and restores the variables it sets while a child process starts).
ENV_READERS = {"rlinf/config.py", "rlinf/launch/cluster.py"}
#: Methods of os.environ that only write it when their result is unused.
_WRITERS = {"update", "pop", "setdefault", "clear", "__setitem__", "__delitem__"}
_ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that read the environment: any use of ``os.environ``/``os.getenv``
    (or an import of them from ``os``) that is not a plain write for child processes."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def writes(node: ast.Attribute) -> bool:
        parent = parents[node]
        if node.attr.startswith("getenv"):
            return False
        if isinstance(parent, ast.Subscript) and parent.value is node:      # os.environ[k] = v / del
            return isinstance(parent.ctx, (ast.Store, ast.Del))
        if isinstance(parent, ast.Attribute) and parent.attr in _WRITERS:   # os.environ.update(...)
            call = parents.get(parent)
            return isinstance(call, ast.Call) and call.func is parent and isinstance(parents.get(call), ast.Expr)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(alias.name in _ENV_NAMES for alias in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "os" and not writes(node):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_tells_reads_from_writes():
    code = """
import os
from os import getenv
a = os.environ.get("X")
b = os.getenv("X")
c = dict(os.environ)
d = os.environ["X"]
e = os.environ.pop("X")
f(env=os.environ)
os.environ["X"] = "1"
del os.environ["X"]
os.environ.update({"X": "1"})
os.environ.pop("X", None)
os.environ.setdefault("X", "1")
g = os.environ["X"] = "1"
"""
    assert _environment_reads(ast.parse(code)) == [3, 4, 5, 6, 7, 8, 9]


def test_only_the_settings_module_and_the_launcher_boundary_read_the_environment():
    readers = {}
    for path in sorted((ROOT / "rlinf").rglob("*.py")):
        lines = _environment_reads(ast.parse(path.read_text(), str(path)))
        if lines:
            readers[path.relative_to(ROOT).as_posix()] = lines
    assert "rlinf/config.py" in readers, "found no read in rlinf/config.py: the scan is broken"
    strays = {path: lines for path, lines in readers.items() if path not in ENV_READERS}
    assert not strays, f"the environment is read outside rlinf.config (take a Settings instead): {strays}"


def test_a_bad_knob_fails_communicator_construction(monkeypatch):
    from rlinf import Communicator

    monkeypatch.setenv("RLINF_SHM_CAP", "4X")
    with pytest.raises(ValueError, match=re.escape("RLINF_SHM_CAP='4X': not a size")):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")
    monkeypatch.delenv("RLINF_SHM_CAP")
    monkeypatch.setenv("RLINF_PEER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RLINF_PEER_TIMEOUT='soon'"):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")
    monkeypatch.setenv("RLINF_PEER_TIMEOUT", "2")
    monkeypatch.setenv("RLINF_DISABLE_TRANSPORTS", "shm,pigeon")
    with pytest.raises(ValueError, match=r"RLINF_DISABLE_TRANSPORTS.*unknown transport.*pigeon"):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t")


def test_the_communicator_reads_the_environment_when_constructed(monkeypatch):
    from rlinf import Communicator

    monkeypatch.setenv("RLINF_ADDRESS", "late:3")          # set after import, as the Ray launcher does
    monkeypatch.setenv("RLINF_MANAGER", "tcp://127.0.0.1:1")
    monkeypatch.setenv("RLINF_TOKEN", "t")
    comm = Communicator()
    assert (comm.address, comm.manager_address) == ("late:3", "tcp://127.0.0.1:1")


def test_given_settings_win_and_the_environment_is_not_parsed(monkeypatch):
    from rlinf import Communicator

    monkeypatch.setenv("RLINF_SHM_CAP", "4X")              # would fail if parsed
    monkeypatch.setenv("RLINF_ADDRESS", "env:0")
    settings = Settings(address="given:1", manager="tcp://127.0.0.1:1", token="t", shm_views=False)
    comm = Communicator(settings=settings)
    assert (comm.address, comm.manager_address) == ("given:1", "tcp://127.0.0.1:1")
    assert Communicator("arg:2", settings=settings).address == "arg:2"        # arguments win over settings
    with pytest.raises(TypeError, match="Settings"):
        Communicator("a:0", manager="tcp://127.0.0.1:1", token="t", settings={"shm_views": False})


def test_the_manager_takes_its_peer_timeout_from_settings(monkeypatch):
    from rlinf.control.manager import Manager

    monkeypatch.setenv("RLINF_PEER_TIMEOUT", "7")
    assert Manager().peer_timeout == 7.0
    assert Manager(settings=Settings(peer_timeout=3)).peer_timeout == 3.0
    assert Manager(peer_timeout=4, settings=Settings(peer_timeout=3)).peer_timeout == 4
    monkeypatch.setenv("RLINF_PEER_TIMEOUT", "nan")
    with pytest.raises(ValueError, match="RLINF_PEER_TIMEOUT='nan'"):
        Manager()


def test_commands_read_the_environment_only_when_they_run(monkeypatch, capsys):
    from rlinf.tools import cli

    monkeypatch.setenv("RLINF_SHM_CAP", "4X")
    for command in ("manager", "top"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])                    # an unrelated bad knob does not break --help
        assert exit_info.value.code == 0
    capsys.readouterr()
    assert cli.main(["top", "--manager", "tcp://127.0.0.1:1", "--token", "t", "--once"]) == 2
    assert "RLINF_SHM_CAP='4X'" in capsys.readouterr().err
    assert cli.main(["manager", "--bind", "tcp://127.0.0.1:0", "--token", "t"]) == 1
    assert "RLINF_SHM_CAP='4X'" in capsys.readouterr().err


# --------------------------------------------------------------------------- docs


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_configuration_doc_is_current():
    out = _run("--check")
    assert out.returncode == 0, out.stderr


def test_configuration_doc_check_fails_when_stale(tmp_path):
    target = tmp_path / "configuration.md"
    assert _run("--check", "--out", str(target)).returncode == 1          # missing
    assert _run("--out", str(target)).returncode == 0
    assert target.read_text() == DOC.read_text()
    assert _run("--check", "--out", str(target)).returncode == 0
    target.write_text(target.read_text().replace("`256K`", "`512K`"))
    out = _run("--check", "--out", str(target))
    assert out.returncode == 1 and "stale" in out.stderr


def test_configuration_doc_lists_every_knob():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| `RLINF_"):
            rows[cells[0].strip("`")] = cells
    assert set(rows) == {k.env for k in knobs()}
    for knob in knobs():
        variable, default, kind, meaning = rows[knob.env]
        assert default.strip("`") == knob.format(knob.default)
        assert kind.startswith(knob.kind) and meaning == knob.meaning


def test_the_module_needs_only_the_standard_library():
    code = ("import importlib.util, sys; before = set(sys.modules); "
            f"spec = importlib.util.spec_from_file_location('rlinf_config', {str(ROOT / 'rlinf' / 'config.py')!r}); "
            "module = importlib.util.module_from_spec(spec); sys.modules['rlinf_config'] = module; "
            "spec.loader.exec_module(module); module.Settings.from_env({}); "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} "
            "- set(sys.stdlib_module_names) - {'rlinf_config'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
