"""The versioned weight store: trainers publish, rollout workers pull into their own tensors.

``ws = await comm.weights(name)``; ``await ws.publish(tree, version)``;
``await ws.pull(into=tree, newer_than=v)``; see :class:`WeightStore` and ``docs/weights.md``.
"""

from __future__ import annotations

from .stats import WeightStats
from .store import WeightStore, open_store

__all__ = ["WeightStore", "WeightStats", "open_store"]
