"""Plain records that describe workers and membership changes.

These are frozen snapshots: the manager keeps a roster of :class:`WorkerInfo`, every
communicator caches a copy, and :func:`rlinf.routing.select_transport` reads them to
choose a path. They travel over the control plane as msgpack maps (``to_wire`` /
``from_wire``), so they hold only plain values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DeviceInfo", "WorkerInfo", "MembershipEvent", "parse_address"]


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"group:rank"`` into ``(group, rank)``.

    Raises:
        TypeError: ``address`` is not a str.
        ValueError: it is not of the form ``name:non-negative-int``.
    """
    if not isinstance(address, str):
        raise TypeError(f"a worker address must be a str like 'rollout:3', got {type(address).__name__}")
    group, sep, rank = address.rpartition(":")
    if not sep or not group or not rank.isdigit():
        raise ValueError(f"a worker address must look like 'group:rank' (e.g. 'rollout:3'), got {address!r}")
    return group, int(rank)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One accelerator of a worker: ``kind`` ("cuda"), its index and a stable uuid."""

    kind: str
    index: int
    uuid: str = ""
    total_memory: int = 0

    @property
    def name(self) -> str:
        """``"cuda:0"``-style name."""
        return f"{self.kind}:{self.index}"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Where a worker lives and how to reach it (one incarnation of an address).

    Attributes:
        address: ``"group:rank"``.
        incarnation: random id of this process's registration; a restart under the same
            address gets a new one, and frames from an old one are dropped.
        node_id: host identity (``RLINF_NODE_ID`` overrides it); equal ids mean "same node".
        host, pid: where the process runs.
        endpoints: data endpoints by scheme, e.g. ``{"ipc": "ipc:///tmp/..", "tcp": "tcp://.."}``.
        devices: the accelerators the worker can use.
        transports: names of the transports available in that process.
        start_time: registration time (seconds since the epoch, the manager's clock).
        meta: free-form extra data (e.g. ``{"kind": "channel", "channel": "rollouts"}``).
    """

    address: str
    incarnation: str
    node_id: str
    host: str = ""
    pid: int = 0
    endpoints: dict[str, str] = field(default_factory=dict)
    devices: tuple[DeviceInfo, ...] = ()
    transports: tuple[str, ...] = ("zmq",)
    start_time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire = dataclasses.asdict(self)
        wire["devices"] = [dataclasses.asdict(d) for d in self.devices]
        wire["transports"] = list(self.transports)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WorkerInfo:
        """Build from a control-plane map. Raises ``ValueError`` / ``TypeError`` on bad fields."""
        if not isinstance(wire, dict):
            raise TypeError("worker info must be a map")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in wire.items() if k in known}
        kwargs["devices"] = tuple(DeviceInfo(**d) for d in wire.get("devices", ()))
        kwargs["transports"] = tuple(wire.get("transports", ("zmq",)))
        info = cls(**kwargs)
        parse_address(info.address)
        return info


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """A change in the cluster's membership, as seen from ``comm.events()``.

    ``kind`` is ``"joined"`` (registered), ``"left"`` (deregistered cleanly) or
    ``"lost"`` (stopped heartbeating or its process died).
    """

    kind: Literal["joined", "left", "lost"]
    address: str
    incarnation: str = ""
    info: WorkerInfo | None = None


def socket_dirs(info: WorkerInfo | None) -> list[str]:
    """The private directories of a worker's socket files (its ``ipc://`` and ``unix://``
    endpoints), which whoever started it removes if it dies before it can."""
    dirs = set()
    for endpoint in (info.endpoints.values() if info is not None else ()):
        scheme, _, path = endpoint.partition("://")
        if scheme in ("ipc", "unix") and path:
            dirs.add(path.rsplit("/", 1)[0])
    return sorted(dirs)
