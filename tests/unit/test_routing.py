"""Table tests for rlinf.routing.select_transport with fake worker/buffer descriptors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rlinf.config import Settings
from rlinf.control.devices import BufferInfo
from rlinf.info import DeviceInfo, WorkerInfo
from rlinf.core.routing import (ALWAYS_AVAILABLE, BULK, CUDA_IPC, DEFAULT_SHM_THRESHOLD, INLINE, NCCL, ROUTING_TABLE,
                                SHM, STAGED, TRANSPORTS, Route, RoutingConfig, select_scheme, select_transport)

GPU = (DeviceInfo(kind="cuda", index=0, uuid="GPU-0000", total_memory=80 << 30),)
ALL = (INLINE, SHM, BULK, CUDA_IPC, NCCL)
KIB = 1024
MIB = 1024 * KIB


def worker(
    address: str,
    node: str = "node-a",
    transports: tuple[str, ...] = ALL,
    devices: tuple[DeviceInfo, ...] = (),
    endpoints: dict[str, str] | None = None,
) -> WorkerInfo:
    if endpoints is None:
        endpoints = {"ipc": f"ipc:///tmp/rlinf-x/{address}", "tcp": "tcp://10.0.0.1:5555"}
    return WorkerInfo(
        address=address,
        incarnation="inc-" + address,
        node_id=node,
        endpoints=endpoints,
        devices=devices,
        transports=transports,
    )


CPU_SMALL = BufferInfo(device="cpu", nbytes=1 * KIB)
CPU_LARGE = BufferInfo(device="cpu", nbytes=40 * MIB)
CUDA_BUF = BufferInfo(device="cuda:0", nbytes=4 * MIB)


# (id, src, dst, buffer, expected transport, expected scheme, expected fallback)
TABLE_CASES = [
    ("cpu-same-large", worker("a:0"), worker("b:0"), CPU_LARGE, SHM, "ipc", False),
    ("cpu-same-small", worker("a:0"), worker("b:0"), CPU_SMALL, INLINE, "ipc", False),
    ("cpu-other-large", worker("a:0"), worker("b:0", node="node-b"), CPU_LARGE, BULK, "tcp", False),
    ("cpu-other-medium", worker("a:0"), worker("b:0", node="node-b"), BufferInfo("cpu", 512 * KIB), INLINE, "tcp",
     False),
    ("cpu-other-large-no-bulk", worker("a:0"), worker("b:0", node="node-b", transports=(INLINE,)), CPU_LARGE,
     INLINE, "tcp", True),
    ("cpu-other-small", worker("a:0"), worker("b:0", node="node-b"), CPU_SMALL, INLINE, "tcp", False),
    ("cuda-same", worker("a:0", devices=GPU), worker("b:0", devices=GPU), CUDA_BUF, CUDA_IPC, "ipc", False),
    (
        "cuda-other",
        worker("a:0", devices=GPU),
        worker("b:0", node="node-b", devices=GPU),
        CUDA_BUF,
        NCCL,
        "tcp",
        False,
    ),
    # small GPU buffers use the same rows: size only matters for CPU buffers
    (
        "cuda-same-tiny",
        worker("a:0", devices=GPU),
        worker("b:0", devices=GPU),
        BufferInfo(device="cuda:1", nbytes=4),
        CUDA_IPC,
        "ipc",
        False,
    ),
]


@pytest.mark.parametrize(
    ("src", "dst", "buf", "transport", "scheme", "fallback"),
    [case[1:] for case in TABLE_CASES],
    ids=[case[0] for case in TABLE_CASES],
)
def test_every_row_first_choice(src, dst, buf, transport, scheme, fallback):
    route = select_transport(src, dst, buf)
    assert route == Route(transport=transport, scheme=scheme, fallback=fallback, reason=route.reason)
    assert route.reason.startswith(buf.kind)


def test_reason_text_names_size_and_threshold():
    route = select_transport(worker("a:0"), worker("b:0"), CPU_LARGE)
    assert route.reason == "cpu, same node, 40.0 MiB >= shm threshold 256.0 KiB"
    small = select_transport(worker("a:0"), worker("b:0"), BufferInfo(device="cpu", nbytes=100))
    assert small.reason == "cpu, same node, 100 B < shm threshold 256.0 KiB"
    other = select_transport(worker("a:0"), worker("b:0", node="n2"), CPU_LARGE)
    assert other.reason == "cpu, other node, 40.0 MiB >= bulk threshold 1.0 MiB"


# ----------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (DEFAULT_SHM_THRESHOLD - 1, INLINE),
        (DEFAULT_SHM_THRESHOLD, SHM),  # "at or above" the threshold
        (DEFAULT_SHM_THRESHOLD + 1, SHM),
        (0, INLINE),
    ],
)
def test_default_threshold_boundary(nbytes, expected):
    route = select_transport(worker("a:0"), worker("b:0"), BufferInfo(device="cpu", nbytes=nbytes))
    assert route.transport == expected
    assert route.fallback is False


def test_default_threshold_is_256_kib():
    assert DEFAULT_SHM_THRESHOLD == 256 * 1024
    assert RoutingConfig().shm_threshold == 256 * 1024


@pytest.mark.parametrize(("nbytes", "expected"), [(999, INLINE), (1000, SHM)])
def test_custom_threshold_boundary(nbytes, expected):
    config = RoutingConfig(shm_threshold=1000)
    route = select_transport(worker("a:0"), worker("b:0"), BufferInfo(device="cpu", nbytes=nbytes), config=config)
    assert route.transport == expected


def test_zero_threshold_sends_even_empty_buffers_through_shm():
    config = RoutingConfig(shm_threshold=0)
    assert select_transport(worker("a:0"), worker("b:0"), BufferInfo("cpu", 0), config=config).transport == SHM


# ----------------------------------------------------------------- fallbacks


def test_shm_disabled_by_config_falls_back_inline():
    config = RoutingConfig(disabled=frozenset({SHM}))
    route = select_transport(worker("a:0"), worker("b:0"), CPU_LARGE, config=config)
    assert (route.transport, route.scheme, route.fallback) == (INLINE, "ipc", True)
    assert "shm disabled" in route.reason


def test_shm_missing_on_receiver_falls_back_inline():
    dst = worker("b:0", transports=(INLINE,))
    route = select_transport(worker("a:0"), dst, CPU_LARGE)
    assert (route.transport, route.fallback) == (INLINE, True)
    assert "shm unavailable on b:0" in route.reason


def test_cuda_ipc_missing_on_sender_falls_back_to_nccl():
    src = worker("a:0", transports=(INLINE, NCCL), devices=GPU)
    route = select_transport(src, worker("b:0", devices=GPU), CUDA_BUF)
    assert (route.transport, route.fallback) == (NCCL, True)
    assert "cuda_ipc unavailable on a:0" in route.reason


def test_cuda_same_node_without_gpu_transports_is_staged():
    src = worker("a:0", transports=(INLINE, SHM), devices=GPU)
    dst = worker("b:0", transports=(INLINE, SHM), devices=GPU)
    route = select_transport(src, dst, CUDA_BUF)
    assert (route.transport, route.scheme, route.fallback) == (STAGED, "ipc", True)
    assert "cuda_ipc unavailable on a:0 and b:0" in route.reason
    assert "nccl unavailable on a:0 and b:0" in route.reason


def test_cuda_ipc_needs_devices_on_both_sides():
    # dst lists the transports but has no GPU (e.g. a CPU consumer of GPU data)
    route = select_transport(worker("a:0", devices=GPU), worker("b:0"), CUDA_BUF)
    assert (route.transport, route.fallback) == (STAGED, True)
    assert "cuda_ipc needs a GPU on b:0" in route.reason
    assert "nccl needs a GPU on b:0" in route.reason


def test_nccl_across_nodes_needs_devices():
    route = select_transport(worker("a:0", devices=GPU), worker("b:0", node="n2"), CUDA_BUF)
    assert (route.transport, route.scheme, route.fallback) == (STAGED, "tcp", True)


def test_nccl_disabled_across_nodes_is_staged():
    config = RoutingConfig(disabled=frozenset({NCCL}))
    route = select_transport(worker("a:0", devices=GPU), worker("b:0", node="n2", devices=GPU), CUDA_BUF, config=config)
    assert (route.transport, route.fallback) == (STAGED, True)
    assert route.reason == "cuda, other node; nccl disabled"


def test_disabled_via_env():
    config = RoutingConfig.from_settings(Settings.from_env({"RLINF_DISABLE_TRANSPORTS": "nccl, CUDA_IPC"}))
    assert config == RoutingConfig(disabled=frozenset({NCCL, CUDA_IPC}))
    route = select_transport(worker("a:0", devices=GPU), worker("b:0", devices=GPU), CUDA_BUF, config=config)
    assert (route.transport, route.fallback) == (STAGED, True)
    assert "cuda_ipc disabled" in route.reason and "nccl disabled" in route.reason


def test_select_transport_does_not_read_env(monkeypatch):
    monkeypatch.setenv("RLINF_DISABLE_TRANSPORTS", "shm")
    assert select_transport(worker("a:0"), worker("b:0"), CPU_LARGE).transport == SHM


# ----------------------------------------------------------------- config


def _from(env: dict[str, str]) -> RoutingConfig:
    return RoutingConfig.from_settings(Settings.from_env(env))


def test_from_settings_defaults():
    assert _from({}) == RoutingConfig() == RoutingConfig.from_settings(Settings())


def test_from_settings_thresholds():
    assert _from({"RLINF_SHM_THRESHOLD": "4096"}).shm_threshold == 4096
    assert _from({"RLINF_BULK_THRESHOLD": "123"}).bulk_threshold == 123
    assert _from({"RLINF_SHM_THRESHOLD": "4k"}).shm_threshold == 4 * KIB      # sizes take suffixes now
    assert _from({"RLINF_BULK_THRESHOLD": "2M"}).bulk_threshold == 2 * MIB
    with pytest.raises(ValueError, match="RLINF_BULK_THRESHOLD='lots'"):
        _from({"RLINF_BULK_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="RLINF_SHM_THRESHOLD='-1'"):
        _from({"RLINF_SHM_THRESHOLD": "-1"})


def test_from_settings_names():
    config = _from({"RLINF_DISABLE_TRANSPORTS": "shm nccl", "RLINF_SHM_THRESHOLD": "7"})
    assert config == RoutingConfig(shm_threshold=7, disabled=frozenset({SHM, NCCL}))


@pytest.mark.parametrize("value", ["nccl,bogus", "infiniband"])
def test_from_settings_rejects_unknown_names(value):
    with pytest.raises(ValueError, match="RLINF_DISABLE_TRANSPORTS.*unknown transport"):
        _from({"RLINF_DISABLE_TRANSPORTS": value})


@pytest.mark.parametrize("value", ["zmq", "staged,shm"])
def test_from_settings_rejects_last_resort_names(value):
    with pytest.raises(ValueError, match="RLINF_DISABLE_TRANSPORTS.*cannot be disabled"):
        _from({"RLINF_DISABLE_TRANSPORTS": value})


@pytest.mark.parametrize("name", [INLINE, STAGED])
def test_last_resort_transports_cannot_be_disabled(name):
    with pytest.raises(ValueError, match="cannot be disabled"):
        RoutingConfig(disabled=frozenset({name}))


def test_config_validation():
    with pytest.raises(ValueError, match=">= 0"):
        RoutingConfig(shm_threshold=-1)
    with pytest.raises(TypeError, match="int"):
        RoutingConfig(shm_threshold=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a str"):
        RoutingConfig(disabled="shm")  # type: ignore[arg-type]
    assert RoutingConfig(disabled={SHM}).disabled == frozenset({SHM})  # type: ignore[arg-type]


# ----------------------------------------------------------------- schemes


@pytest.mark.parametrize(
    ("dst", "expected"),
    [
        (worker("b:0"), "ipc"),
        (worker("b:0", endpoints={"tcp": "tcp://10.0.0.2:1"}), "tcp"),
        (worker("b:0", node="node-b"), "tcp"),
        (worker("b:0", node="node-b", endpoints={"ipc": "ipc:///tmp/x"}), "tcp"),
    ],
    ids=["same-node-ipc", "same-node-tcp-only", "other-node", "other-node-ipc-only"],
)
def test_select_scheme(dst, expected):
    assert select_scheme(worker("a:0"), dst) == expected
    assert select_transport(worker("a:0"), dst, CPU_SMALL).scheme == expected


_STREAMING = {"stream": "unix:///tmp/rlinf-x/s", "ipc": "ipc:///tmp/rlinf-x/d", "tcp": "tcp://10.0.0.1:1"}


@pytest.mark.parametrize(
    ("src_endpoints", "dst", "disabled", "expected"),
    [
        (_STREAMING, worker("b:0", endpoints=_STREAMING), (), "stream"),
        (_STREAMING, worker("b:0", endpoints=_STREAMING), ("stream",), "ipc"),
        (None, worker("b:0", endpoints=_STREAMING), (), "ipc"),          # the sender has no stream
        (_STREAMING, worker("b:0"), (), "ipc"),                           # the receiver has none
        (_STREAMING, worker("b:0", node="node-b", endpoints=_STREAMING), (), "tcp"),
    ],
    ids=["both", "disabled", "sender-without", "receiver-without", "other-node"],
)
def test_select_scheme_prefers_the_stream_on_one_node(src_endpoints, dst, disabled, expected):
    src = worker("a:0", endpoints=src_endpoints)
    config = RoutingConfig(disabled=frozenset(disabled))
    assert select_scheme(src, dst, config=config) == expected
    assert select_transport(src, dst, CPU_SMALL, config=config).scheme == expected


_TCP_STREAMING = {**_STREAMING, "tcp_stream": "tcp://10.0.0.1:2"}


@pytest.mark.parametrize(
    ("src_endpoints", "dst", "disabled", "expected"),
    [
        (_TCP_STREAMING, worker("b:0", node="node-b", endpoints=_TCP_STREAMING), (), "tcp_stream"),
        (_TCP_STREAMING, worker("b:0", node="node-b", endpoints=_TCP_STREAMING), ("tcp_stream",), "tcp"),
        (_STREAMING, worker("b:0", node="node-b", endpoints=_TCP_STREAMING), (), "tcp"),
        (_TCP_STREAMING, worker("b:0", node="node-b", endpoints=_STREAMING), (), "tcp"),
        (_TCP_STREAMING, worker("b:0", endpoints=_TCP_STREAMING), (), "stream"),      # one node: Unix
    ],
    ids=["both", "disabled", "sender-without", "receiver-without", "same-node"],
)
def test_select_scheme_prefers_the_tcp_stream_between_nodes(src_endpoints, dst, disabled, expected):
    src = worker("a:0", endpoints=src_endpoints)
    config = RoutingConfig(disabled=frozenset(disabled))
    assert select_scheme(src, dst, config=config) == expected
    assert select_transport(src, dst, CPU_SMALL, config=config).scheme == expected


# ----------------------------------------------------------------- raw buffers


def test_raw_buffers_are_described():
    src, dst = worker("a:0"), worker("b:0")
    assert select_transport(src, dst, np.zeros(MIB, dtype=np.uint8)).transport == SHM
    assert select_transport(src, dst, b"x" * 10).transport == INLINE
    assert select_transport(src, dst, memoryview(bytearray(DEFAULT_SHM_THRESHOLD))).transport == SHM
    with pytest.raises(TypeError, match="cannot describe"):
        select_transport(src, dst, object())


def test_torch_cpu_tensor_routes_as_cpu():
    torch = pytest.importorskip("torch")
    route = select_transport(worker("a:0"), worker("b:0"), torch.zeros(MIB // 4, dtype=torch.float32))
    assert route.transport == SHM


# ----------------------------------------------------------------- the table itself


def test_table_rows_end_in_always_available_transports():
    for row in ROUTING_TABLE:
        assert row.prefer, row
        assert row.prefer[-1] in ALWAYS_AVAILABLE, row
        assert set(row.prefer) <= set(TRANSPORTS), row


@pytest.mark.parametrize(
    ("device", "same_node", "large", "prefer"),
    [
        ("cpu", True, True, (SHM, INLINE)),
        ("cpu", True, False, (INLINE,)),
        ("cpu", False, True, (BULK, INLINE)),
        ("cpu", False, False, (INLINE,)),
        ("cuda", True, True, (CUDA_IPC, NCCL, STAGED)),
        ("cuda", True, False, (CUDA_IPC, NCCL, STAGED)),
        ("cuda", False, True, (NCCL, STAGED)),
        ("cuda", False, False, (NCCL, STAGED)),
    ],
)
def test_table_covers_every_combination(device, same_node, large, prefer):
    matching = [row for row in ROUTING_TABLE if row.matches(device, same_node, large)]
    assert len(matching) == 1
    assert matching[0].prefer == prefer


def _subsets(items):
    return [frozenset(c) for n in range(len(items) + 1) for c in itertools.combinations(items, n)]


def test_exhaustive_never_raises_and_respects_availability():
    optional = (SHM, CUDA_IPC, NCCL)
    buffers = (CPU_SMALL, CPU_LARGE, CUDA_BUF)
    checked = 0
    for src_t, dst_t, src_gpu, dst_gpu, same, disabled in itertools.product(
        _subsets(optional), _subsets(optional), (False, True), (False, True), (False, True), _subsets(optional)
    ):
        src = worker("a:0", transports=(INLINE, *sorted(src_t)), devices=GPU if src_gpu else ())
        dst = worker("b:0", node="node-a" if same else "node-b", transports=(INLINE, *sorted(dst_t)),
                     devices=GPU if dst_gpu else ())
        config = RoutingConfig(disabled=disabled)
        for buf in buffers:
            route = select_transport(src, dst, buf, config=config)
            threshold = config.shm_threshold if same else config.bulk_threshold
            row = next(r for r in ROUTING_TABLE if r.matches(buf.kind, same, buf.nbytes >= threshold))
            assert route.transport in row.prefer
            assert route.fallback == (route.transport != row.prefer[0])
            assert route.transport not in disabled
            if route.transport not in ALWAYS_AVAILABLE:
                assert route.transport in src_t and route.transport in dst_t
            if route.transport in (CUDA_IPC, NCCL):
                assert src_gpu and dst_gpu
            if route.transport in (CUDA_IPC, SHM):
                assert same
            # the best usable choice is taken: everything before it really is unusable
            for earlier in row.prefer[: row.prefer.index(route.transport)]:
                usable = (
                    earlier not in disabled
                    and earlier in src_t
                    and earlier in dst_t
                    and (earlier == SHM or (src_gpu and dst_gpu))
                )
                assert not usable, (earlier, route)
            checked += 1
    assert checked == 8 * 8 * 2 * 2 * 2 * 8 * 3
