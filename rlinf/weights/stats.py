"""A snapshot of a weight store, as ``await ws.stats()`` returns it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WeightStats"]


@dataclass(frozen=True)
class WeightStats:
    """What a weight store holds and has moved (a frozen snapshot; ``print`` it).

    The store-wide fields come from its directory (the holder of shard 0); they are
    empty while no version was ever published. The ``this_*`` fields are this handle's.

    Attributes:
        name: the store. latest: the newest complete version (None: none yet).
        num_shards: shards per version (None: none published yet).
        versions: version -> ``{"complete", "bytes", "readers", "shards", "lost"}``, for
            each version held now (the newest, those being read, those being
            published; ``lost``: a holder of one of its shards died, it is kept only
            for the pulls still reading it).
        subscribers: addresses of the handles that pulled (and have not left).
        waiting: pulls waiting for a newer version now.
        publishes, pulls: complete versions published, pulls granted (store-wide).
        bytes_by_path: bytes pulled, store-wide, by path (``"shm"``: same node, from
            the holder's shared memory; ``"net"``: from another node).
        last_publish, last_pull: wall-clock times (``time.time()``), or None.
        this_pulls, this_bytes_by_path, this_last_pull: this handle's pulls.
        this_published: the last version this handle published (None: none).
    """

    name: str
    latest: int | None = None
    num_shards: int | None = None
    versions: dict[int, dict[str, Any]] = field(default_factory=dict)
    subscribers: list[str] = field(default_factory=list)
    waiting: int = 0
    publishes: int = 0
    pulls: int = 0
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    last_publish: float | None = None
    last_pull: float | None = None
    this_pulls: int = 0
    this_bytes_by_path: dict[str, int] = field(default_factory=dict)
    this_last_pull: float | None = None
    this_published: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], **local: Any) -> WeightStats:
        """From the directory's plain-data snapshot (``{}``: none) and this handle's fields."""
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["versions"] = {int(k): v for k, v in fields.get("versions", {}).items()}
        fields.setdefault("name", local.pop("name", ""))
        local.pop("name", None)
        return cls(**fields, **local)

    def __str__(self) -> str:
        now = time.time()

        def ago(t: float | None) -> str:
            return "never" if t is None else f"{now - t:.1f} s ago"

        def sizes(by_path: dict[str, int]) -> str:
            return ", ".join(f"{p} {_size(n)}" for p, n in sorted(by_path.items())) or "none"

        held = "; ".join(f"v{n}: {_size(v['bytes'])}, {v['readers']} reading"
                         + ("" if v["complete"] else f", {v['shards']}/{self.num_shards} shards")
                         + (", lost" if v.get("lost") else "")
                         for n, v in self.versions.items()) or "none"
        return "\n".join([
            f"weight store {self.name!r}: latest version {self.latest}, {self.num_shards or '-'} shard(s)",
            f"  versions held: {held}",
            f"  published {self.publishes} version(s), last {ago(self.last_publish)}",
            f"  pulls {self.pulls}, last {ago(self.last_pull)}; {self.waiting} waiting; bytes moved: "
            f"{sizes(self.bytes_by_path)}",
            f"  subscribers: {', '.join(self.subscribers) or 'none'}",
            f"  this handle: {self.this_pulls} pull(s), last {ago(self.this_last_pull)}; bytes: "
            f"{sizes(self.this_bytes_by_path)}; last published {self.this_published}",
        ])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
