"""Tests for rlinf.control.devices: node identity, device discovery, addresses, buffer descriptors."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rlinf.control.devices import (NODE_TOKEN, BufferInfo, describe_buffer, discover_devices, host_addresses,
                                   ipc_visible, node_id, node_token, preferred_address, preferred_peer_address)
from rlinf.config import Settings, visible_devices
from rlinf.info import DeviceInfo

_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
NO_GPU_NODES = sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _GPU_NODES)


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ----------------------------------------------------------------- node identity


def test_node_id_env_override(monkeypatch):
    assert node_id(Settings.from_env({"RLINF_NODE_ID": "rack7-node3"}).node_id) == "rack7-node3"
    assert node_id(" rack7-node3 ") == "rack7-node3"
    monkeypatch.setenv("RLINF_NODE_ID", "rack7-node3")     # read by Settings, not here
    assert node_id() != "rack7-node3"


def test_node_id_host_identity_is_stable():
    first = node_id()
    assert first == node_id()
    assert first.startswith(socket.gethostname() or "localhost")
    assert len(first) > len(socket.gethostname())  # hostname plus the machine/boot hash


def test_blank_node_id_env_is_ignored():
    host = node_id()
    assert node_id(Settings.from_env({"RLINF_NODE_ID": "  "}).node_id) == host
    assert node_id("  ") == node_id("") == node_id(None) == host


def test_node_token_is_made_once_and_kept(tmp_path):
    """The token behind the node id: 32 hex digits in a 0644 file of this user, the same
    on every call; the draft it was written to is gone."""
    token = node_token(str(tmp_path))
    assert token is not None and len(token) == 32 and int(token, 16) >= 0
    path = tmp_path / NODE_TOKEN.format(uid=os.getuid())
    assert path.read_text().strip() == token and (path.stat().st_mode & 0o777) == 0o644
    assert node_token(str(tmp_path)) == token
    assert os.listdir(tmp_path) == [path.name]


def test_processes_starting_at_once_agree_on_the_node_token(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from rlinf.control.devices import node_token
        time.sleep(max(0.0, float(sys.argv[1]) - time.time()))    # all start together
        print(node_token({str(tmp_path)!r}))
    """)
    import time

    start = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", script, start], stdout=subprocess.PIPE, text=True)
             for _ in range(8)]
    tokens = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(tokens) == 1 and len(tokens.pop()) == 32
    assert os.listdir(tmp_path) == [NODE_TOKEN.format(uid=os.getuid())]


@pytest.mark.parametrize("bad", ["garbage", "symlink", "directory", "other user"])
def test_a_node_token_name_taken_by_something_else_is_not_used(tmp_path, bad):
    path = tmp_path / NODE_TOKEN.format(uid=os.getuid())
    if bad == "garbage":
        path.write_text("not a token\n")
    elif bad == "symlink":
        (tmp_path / "elsewhere").write_text("0" * 32)
        path.symlink_to(tmp_path / "elsewhere")
    elif bad == "directory":
        path.mkdir()
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to give a file away")
        path.write_text("0" * 32)
        os.chown(path, 65534, 65534)
    assert node_token(str(tmp_path)) is None
    assert node_token(str(tmp_path / "missing")) is None


def test_leftover_cleanup_keeps_the_node_token(tmp_path):
    from rlinf.transports import leftovers
    from rlinf.transports.shm import sweep

    token = node_token(str(tmp_path))
    leftovers.remove_orphans([str(tmp_path)])
    sweep(os.getpid(), str(tmp_path))
    assert node_token(str(tmp_path)) == token and len(os.listdir(tmp_path)) == 1


def test_ipc_visible(tmp_path):
    assert ipc_visible("tcp://127.0.0.1:5555") and ipc_visible("unix:///nowhere/s")
    assert not ipc_visible(f"ipc://{tmp_path}/d")
    (tmp_path / "d").write_text("")
    assert ipc_visible(f"ipc://{tmp_path}/d")


# ----------------------------------------------------------------- discovery


def test_discover_devices_returns_device_infos():
    devices = discover_devices()
    assert isinstance(devices, tuple)
    assert all(isinstance(d, DeviceInfo) and d.kind == "cuda" for d in devices)
    assert [d.index for d in devices] == list(range(len(devices)))


@pytest.mark.parametrize("value", ["", "-1", " -1 "])
def test_hidden_gpus_give_no_devices(value):
    assert visible_devices({"CUDA_VISIBLE_DEVICES": value}) == value
    assert discover_devices(visible=value) == ()


@pytest.mark.skipif(_torch_cuda(), reason="this machine has a GPU")
def test_no_devices_without_gpu():
    assert discover_devices() == ()


@pytest.mark.cuda
@pytest.mark.skipif(not _torch_cuda(), reason="needs an NVIDIA GPU")
def test_discover_devices_matches_torch():
    import torch

    devices = discover_devices()
    assert len(devices) == torch.cuda.device_count()
    for d in devices:
        assert d.total_memory == torch.cuda.get_device_properties(d.index).total_memory > 0
        assert d.uuid
    assert len({d.uuid for d in devices}) == len(devices)


@pytest.mark.cuda
@pytest.mark.skipif(not _torch_cuda(), reason="needs an NVIDIA GPU")
def test_describe_cuda_tensor():
    import torch

    t = torch.zeros((8, 16), dtype=torch.float16, device="cuda:0")
    assert describe_buffer(t) == BufferInfo(device="cuda:0", nbytes=8 * 16 * 2, shared=False)
    assert describe_buffer(t[:, ::2]).nbytes == 8 * 8 * 2


def _run_python(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RLINF_NO_TORCH", "CUDA_VISIBLE_DEVICES")}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_and_cpu_calls_do_not_import_torch():
    out = _run_python(
        """
        import sys
        import numpy as np
        import rlinf.control.devices, rlinf.routing
        assert "torch" not in sys.modules and "cupy" not in sys.modules, "import pulled torch/cupy"
        from rlinf.control.devices import describe_buffer, node_id, host_addresses, preferred_address
        describe_buffer(np.zeros(3)); describe_buffer(b"abc"); describe_buffer(memoryview(b"x"))
        node_id(); host_addresses()
        print("torch" in sys.modules, "cupy" in sys.modules)
        """
    )
    assert out == "False False"


def test_no_torch_env_keeps_torch_out():
    out = _run_python(
        """
        import sys
        from rlinf.config import Settings
        from rlinf.control.devices import discover_devices
        devices = discover_devices(no_torch=Settings.from_env().no_torch)
        print("torch" in sys.modules, type(devices).__name__)
        """,
        RLINF_NO_TORCH="1",
    )
    assert out == "False tuple"


@pytest.mark.skipif(not NO_GPU_NODES, reason="only on a Linux host without NVIDIA device nodes")
def test_cpu_only_host_discovery_skips_torch_import():
    out = _run_python(
        """
        import sys
        from rlinf.control.devices import discover_devices
        print(discover_devices(), "torch" in sys.modules)
        """
    )
    assert out == "() False"


# ----------------------------------------------------------------- addresses


def test_host_addresses():
    addrs = host_addresses()
    assert "127.0.0.1" in addrs
    assert len(addrs) == len(set(addrs))
    parsed = [ipaddress.IPv4Address(a) for a in addrs]
    assert not any(ip.is_unspecified for ip in parsed)
    loop = [ip.is_loopback for ip in parsed]
    assert loop == sorted(loop), "loopback addresses must come after routable ones"
    assert addrs[loop.index(True)] == "127.0.0.1"


@pytest.mark.parametrize(
    ("peer", "local", "expected"),
    [
        # same /24 beats same /16, whatever the order
        (["10.1.2.9"], ["10.1.7.1", "10.1.2.3"], "10.1.2.3"),
        (["10.1.2.9"], ["10.1.2.3", "10.1.7.1"], "10.1.2.3"),
        # the InfiniBand-style second network is chosen when the peer is on it
        (["192.168.0.4", "172.16.5.20"], ["192.168.1.7", "172.16.5.10"], "172.16.5.10"),
        # a shared /16 still counts
        (["10.1.200.9"], ["192.168.0.2", "10.1.3.3"], "10.1.3.3"),
        # nothing shares a /16: let the OS route
        (["10.2.0.1"], ["10.1.0.1", "192.168.0.1"], None),
        # loopback never matches, even against loopback
        (["127.0.0.1"], ["127.0.0.1"], None),
        (["127.0.0.1", "10.0.0.8"], ["127.0.0.1", "10.0.0.3"], "10.0.0.3"),
        # junk, hostnames and IPv6 are ignored
        (["not-an-ip", "fe80::1", "10.9.9.9"], ["", "::1", "10.9.9.1"], "10.9.9.1"),
        # ties go to the earlier local address
        (["10.0.0.1", "10.0.1.1"], ["10.0.1.2", "10.0.0.2"], "10.0.1.2"),
        ([], ["10.0.0.1"], None),
        (["10.0.0.1"], [], None),
    ],
)
def test_preferred_address(peer, local, expected):
    assert preferred_address(peer, local) == expected


def test_preferred_address_min_prefix():
    assert preferred_address(["10.2.0.1"], ["10.1.0.1"], min_prefix=8) == "10.1.0.1"
    assert preferred_address(["10.1.2.9"], ["10.1.7.1"], min_prefix=24) is None
    assert preferred_address(["10.1.2.9"], ["10.1.2.1"], min_prefix=24) == "10.1.2.1"
    assert preferred_address(["8.8.8.8"], ["127.0.0.1", "192.168.0.1"], min_prefix=0) == "192.168.0.1"
    with pytest.raises(ValueError, match="min_prefix"):
        preferred_address([], [], min_prefix=33)


def test_preferred_peer_address():
    peer = ["192.168.0.4", "172.16.5.20", "127.0.0.1"]
    local = ["192.168.9.7", "172.16.5.10"]
    assert preferred_peer_address(peer, local) == "172.16.5.20"
    assert preferred_peer_address(["10.0.0.1"], ["192.168.0.1"]) is None


# ----------------------------------------------------------------- buffers


def test_describe_numpy_arrays():
    a = np.zeros((3, 4), dtype=np.float32)
    assert describe_buffer(a) == BufferInfo(device="cpu", nbytes=48, shared=False)
    assert describe_buffer(a[:, ::2]).nbytes == 24  # non-contiguous view: its own elements only
    assert describe_buffer(np.float64(1.0)).nbytes == 8
    assert describe_buffer(np.array(["a", None], dtype=object)).nbytes == 2 * np.dtype(object).itemsize


def test_describe_bytes_like():
    assert describe_buffer(b"hello") == BufferInfo("cpu", 5)
    assert describe_buffer(bytearray(7)) == BufferInfo("cpu", 7)
    assert describe_buffer(b"") == BufferInfo("cpu", 0)
    view = memoryview(bytearray(64)).cast("d")
    assert describe_buffer(view).nbytes == 64
    assert describe_buffer(view[::2]).nbytes == 32
    view.release()


def test_describe_rejects_non_buffers():
    for bad in (object(), 3, "text", [1, 2]):
        with pytest.raises(TypeError, match="cannot describe"):
            describe_buffer(bad)


def test_describe_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert describe_buffer(t) == BufferInfo(device="cpu", nbytes=48, shared=False)
    assert describe_buffer(t[:, ::2]).nbytes == 24
    assert describe_buffer(torch.zeros(5, dtype=torch.bfloat16)).nbytes == 10
    assert describe_buffer(torch.nn.Parameter(torch.zeros(2, 2))).nbytes == 16
    shared = torch.zeros(100, dtype=torch.int64).share_memory_()
    assert describe_buffer(shared) == BufferInfo(device="cpu", nbytes=800, shared=True)


def test_describe_torch_rejects_other_devices():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="CPU and CUDA"):
        describe_buffer(torch.empty(3, device="meta"))


def test_buffer_info_validation_and_properties():
    assert BufferInfo("cuda:3", 10).kind == "cuda"
    assert BufferInfo("cuda:3", 10).index == 3
    assert BufferInfo("cpu", 10).kind == "cpu"
    assert BufferInfo("cpu", 10).index is None
    for device in ("gpu", "cuda", "cuda:x", "mps:0", ""):
        with pytest.raises(ValueError, match="device"):
            BufferInfo(device, 1)
    for nbytes in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            BufferInfo("cpu", nbytes)
