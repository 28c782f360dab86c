"""Transport choice: the one place that decides how a buffer travels.

:func:`select_transport` is a pure function of the two workers' descriptors, the
buffer's descriptor and a :class:`RoutingConfig`; it does no I/O and never raises for a
transport choice. It looks up the first row of :data:`ROUTING_TABLE` that matches the
buffer (device kind, same node or not, large or not) and walks that row's preference
list, taking the first transport both processes have and the config allows. The last
entry of every row (``zmq`` or ``staged``) is always available.

=====  =========  =====  ===============================
buf    same node  large  preference
=====  =========  =====  ===============================
cpu    yes        yes    shm, zmq
cpu    yes        no     zmq (ipc://)
cpu    no         yes    bulk, zmq (tcp://)
cpu    no         no     zmq (tcp_stream, else tcp://)
cuda   yes        any    cuda_ipc, nccl, staged
cuda   no         any    nccl, staged
=====  =========  =====  ===============================

"Large" means ``nbytes >= RoutingConfig.shm_threshold`` between processes of one node
and ``nbytes >= RoutingConfig.bulk_threshold`` between nodes; "same node" means equal
:attr:`~rlinf.info.WorkerInfo.node_id`, which by default processes share only when they
share ``/dev/shm`` (see :func:`~rlinf.control.devices.node_id`). What this module picks
is what to try: a same-node socket the dialler cannot see (``/tmp`` not shared) makes it
take the peer's ``tcp://`` endpoint (:func:`~rlinf.control.devices.ipc_visible`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import DEFAULTS, Settings
from ..control.devices import BufferInfo, describe_buffer
from ..info import WorkerInfo

__all__ = [
    "INLINE",
    "STREAM",
    "TCP_STREAM",
    "SHM",
    "PULL",
    "BULK",
    "CUDA_IPC",
    "NCCL",
    "STAGED",
    "TRANSPORTS",
    "ALWAYS_AVAILABLE",
    "DEFAULT_SHM_THRESHOLD",
    "DEFAULT_BULK_THRESHOLD",
    "RouteRow",
    "ROUTING_TABLE",
    "RoutingConfig",
    "Route",
    "select_transport",
    "select_scheme",
]

INLINE = "zmq"
"""The buffer travels inside the message's frame set, over the peer's data link: the
stream socket on one node (:data:`STREAM`), else ZeroMQ (``ipc://``, ``tcp://``)."""
STREAM = "stream"
"""The link that carries frame sets between processes of one node: a Unix stream socket
written and read by the event loops (``rlinf/transports/stream.py``); disabled, ZeroMQ
``ipc://`` carries them."""
TCP_STREAM = "tcp_stream"
"""The link that carries frame sets to processes of other nodes: a TCP connection the
event loops write and read (``rlinf/transports/tcp_stream.py``), sealed when TCP
encryption is on; disabled, or where the two ends share no cipher, ZeroMQ ``tcp://``
carries them (CURVE when encryption is on)."""
SHM = "shm"
"""Same-node shared memory; only a descriptor goes through ZeroMQ."""
PULL = "pull"
"""Not a route of its own: large buffers of the shared-memory route that the receiver
reads from the sender's memory (``rlinf/transports/shm/_pull.py``); a path stats count."""
BULK = "bulk"
"""A large payload to another node over an authenticated TCP stream of its own, read into
recycled memory (sealed when TCP encryption is on); see ``rlinf/transports/tcp_bulk.py``."""
CUDA_IPC = "cuda_ipc"
"""Same-node CUDA IPC memory handle."""
NCCL = "nccl"
"""NCCL point-to-point between GPUs (any node)."""
STAGED = "staged"
"""A GPU buffer copied to host memory (``Tensor.cpu()``), then sent as a CPU buffer (inline
or through shared memory); the receiver moves it to its current device."""

TRANSPORTS: tuple[str, ...] = (INLINE, SHM, BULK, CUDA_IPC, NCCL, STAGED, STREAM, TCP_STREAM)
ALWAYS_AVAILABLE: frozenset[str] = frozenset({INLINE, STAGED})
"""Transports every process has; they are the last resort of each row and cannot be disabled."""

DEFAULT_SHM_THRESHOLD = DEFAULTS.shm_threshold      # RLINF_SHM_THRESHOLD's default (256 KiB)
DEFAULT_BULK_THRESHOLD = DEFAULTS.bulk_threshold    # RLINF_BULK_THRESHOLD's default (1 MiB)


@dataclass(frozen=True, slots=True)
class RouteRow:
    """One row of the routing table.

    Attributes:
        device: the buffer's device kind, ``"cpu"`` or ``"cuda"``.
        same_node: whether the peers share a node; ``None`` matches either.
        large: whether the buffer reaches the threshold of its case (``shm_threshold``
            on one node, ``bulk_threshold`` between nodes); ``None`` matches either.
        prefer: transports in order of preference; the last is always available.
    """

    device: str
    same_node: bool | None
    large: bool | None
    prefer: tuple[str, ...]

    def matches(self, device: str, same_node: bool, large: bool) -> bool:
        """Whether this row applies to a buffer of ``device`` kind between such peers."""
        return (
            self.device == device
            and (self.same_node is None or self.same_node == same_node)
            and (self.large is None or self.large == large)
        )


ROUTING_TABLE: tuple[RouteRow, ...] = (
    RouteRow("cpu", same_node=True, large=True, prefer=(SHM, INLINE)),
    RouteRow("cpu", same_node=True, large=False, prefer=(INLINE,)),
    RouteRow("cpu", same_node=False, large=True, prefer=(BULK, INLINE)),
    RouteRow("cpu", same_node=False, large=False, prefer=(INLINE,)),
    RouteRow("cuda", same_node=True, large=None, prefer=(CUDA_IPC, NCCL, STAGED)),
    RouteRow("cuda", same_node=False, large=None, prefer=(NCCL, STAGED)),
)
"""The routing table; the first matching row wins. Every row ends in ``ALWAYS_AVAILABLE``."""


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Knobs of the routing decision.

    Attributes:
        shm_threshold: CPU buffers of at least this many bytes go through shared memory
            between processes on one node; smaller ones travel inline.
        disabled: transport names never to choose (``zmq`` and ``staged`` can't be).
        bulk_threshold: CPU buffers of at least this many bytes go to another node over
            a bulk TCP stream; smaller ones travel inline.
    """

    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    disabled: frozenset[str] = field(default_factory=frozenset)
    bulk_threshold: int = DEFAULT_BULK_THRESHOLD

    def __post_init__(self) -> None:
        for name in ("shm_threshold", "bulk_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        if isinstance(self.disabled, str):
            raise TypeError("disabled must be a collection of transport names, not a str")
        disabled = frozenset(self.disabled)
        unknown = sorted(disabled - set(TRANSPORTS))
        if unknown:
            raise ValueError(f"unknown transport(s) {unknown}; known: {', '.join(TRANSPORTS)}")
        locked = sorted(disabled & ALWAYS_AVAILABLE)
        if locked:
            raise ValueError(f"transport(s) {locked} cannot be disabled: they are the fallback of last resort")
        object.__setattr__(self, "disabled", disabled)

    def without(self, names: Iterable[str]) -> RoutingConfig:
        """This config with ``names`` disabled too.

        Raises:
            ValueError: a name is unknown or cannot be disabled.
        """
        if isinstance(names, str):
            raise TypeError("names must be a collection of transport names, not a str")
        return replace(self, disabled=self.disabled | frozenset(names))

    @classmethod
    def from_env(cls, environ=None) -> RoutingConfig:
        """The config of the environment (``environ``, default ``os.environ``): the same as
        ``from_settings(Settings.from_env(environ))``."""
        return cls.from_settings(Settings.from_env(environ))

    @classmethod
    def from_settings(cls, settings: Settings) -> RoutingConfig:
        """The config of ``settings`` (``RLINF_SHM_THRESHOLD``, ``RLINF_BULK_THRESHOLD``,
        ``RLINF_DISABLE_TRANSPORTS``; see ``docs/configuration.md``).

        Raises:
            ValueError: a disabled name is unknown or cannot be disabled; the message
                names the setting.
        """
        try:
            return cls(shm_threshold=settings.shm_threshold, bulk_threshold=settings.bulk_threshold,
                       disabled=settings.disable_transports)
        except ValueError as exc:
            raise ValueError(f"RLINF_DISABLE_TRANSPORTS (Settings.disable_transports): {exc}") from None


@dataclass(frozen=True, slots=True)
class Route:
    """The routing decision for one buffer.

    Attributes:
        transport: one of :data:`TRANSPORTS`.
        scheme: the data link that carries the message (and the buffer, for ``zmq``
            and ``staged``): ``"stream"``, ``"ipc"``, ``"tcp_stream"`` or ``"tcp"``
            (see :func:`select_scheme`).
        fallback: the row's first choice could not be used; the caller warns once per peer.
        reason: short human text, e.g. ``"cpu, same node, 40.0 MiB >= shm threshold 256.0 KiB"``.
    """

    transport: str
    scheme: str
    fallback: bool
    reason: str


def select_scheme(src: WorkerInfo, dst: WorkerInfo, *, config: RoutingConfig | None = None) -> str:
    """Choose which of ``dst``'s data endpoints ``src`` connects to.

    Args:
        src: the sender.
        dst: the receiver.
        config: its ``disabled`` set may hold :data:`STREAM` and :data:`TCP_STREAM`.

    Returns:
        ``"stream"`` when both share a node and both have a stream endpoint (and it is
        not disabled), else ``"ipc"`` when they share a node and ``dst`` has an ``ipc``
        endpoint; between nodes ``"tcp_stream"`` when both have a TCP stream endpoint
        (and it is not disabled); else ``"tcp"``.
    """
    cfg = _DEFAULT_CONFIG if config is None else config
    if src.node_id == dst.node_id:
        if STREAM in dst.endpoints and STREAM in src.endpoints and STREAM not in cfg.disabled:
            return STREAM
        if "ipc" in dst.endpoints:
            return "ipc"
    elif TCP_STREAM in dst.endpoints and TCP_STREAM in src.endpoints and TCP_STREAM not in cfg.disabled:
        return TCP_STREAM
    return "tcp"


def select_transport(
    src: WorkerInfo, dst: WorkerInfo, buffer: Any, *, config: RoutingConfig | None = None
) -> Route:
    """Choose how one buffer travels from ``src`` to ``dst``.

    Pure: no I/O, and the environment is not read (build ``config`` once, e.g. with
    :meth:`RoutingConfig.from_settings`). Never raises for a transport choice: when the
    preferred transports are missing or disabled it falls back, ending at ``zmq`` or
    ``staged``, which always work.

    Args:
        src: the sending worker's descriptor.
        dst: the receiving worker's descriptor.
        buffer: a :class:`~rlinf.control.devices.BufferInfo`, or a raw buffer (numpy array,
            buffer-protocol object, torch tensor, cupy array) to describe.
        config: thresholds and disabled transports; defaults to ``RoutingConfig()``.

    Returns:
        The :class:`Route`.

    Raises:
        TypeError: ``buffer`` cannot be described (see :func:`~rlinf.control.devices.describe_buffer`).
    """
    cfg = _DEFAULT_CONFIG if config is None else config
    info = buffer if isinstance(buffer, BufferInfo) else describe_buffer(buffer)
    same_node = src.node_id == dst.node_id
    kind = info.kind
    large = info.nbytes >= (cfg.shm_threshold if same_node else cfg.bulk_threshold)
    scheme = select_scheme(src, dst, config=cfg)
    row = next(r for r in ROUTING_TABLE if r.matches(kind, same_node, large))

    situation = f"{kind}, {'same node' if same_node else 'other node'}"
    if kind == "cpu":
        op = ">=" if large else "<"
        which, threshold = ("shm", cfg.shm_threshold) if same_node else ("bulk", cfg.bulk_threshold)
        situation += f", {_fmt_bytes(info.nbytes)} {op} {which} threshold {_fmt_bytes(threshold)}"
    skipped: list[str] = []
    for name in row.prefer:
        why_not = _unavailable(name, src, dst, same_node, cfg)
        if why_not is None:
            reason = situation if not skipped else f"{situation}; {'; '.join(skipped)}"
            return Route(transport=name, scheme=scheme, fallback=bool(skipped), reason=reason)
        skipped.append(f"{name} {why_not}")
    # Unreachable while every row ends in ALWAYS_AVAILABLE (checked by the tests);
    # kept so a bad table edit degrades to the always-working path, not an exception.
    return Route(transport=STAGED if kind == "cuda" else INLINE, scheme=scheme, fallback=True, reason=situation)


_DEFAULT_CONFIG = RoutingConfig()


def _unavailable(name: str, src: WorkerInfo, dst: WorkerInfo, same_node: bool, cfg: RoutingConfig) -> str | None:
    """Why ``name`` can't carry this buffer, or ``None`` when it can."""
    if name in ALWAYS_AVAILABLE:
        return None
    if name in cfg.disabled:
        return "disabled"
    missing = [w.address for w in (src, dst) if name not in w.transports]
    if missing:
        return f"unavailable on {' and '.join(missing)}"
    if name in (CUDA_IPC, NCCL):
        no_gpu = [w.address for w in (src, dst) if not w.devices]
        if no_gpu:
            return f"needs a GPU on {' and '.join(no_gpu)}"
    if name in (CUDA_IPC, SHM) and not same_node:
        return "needs the same node"
    return None


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
