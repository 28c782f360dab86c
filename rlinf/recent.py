"""Keys remembered to drop what arrives late for them, bounded by forgetting the oldest."""

from __future__ import annotations

from typing import Any

__all__ = ["Recent"]


class Recent(dict):
    """The keys added, oldest first (a ``dict`` of keys to None: ``key in recent`` costs
    what a dict lookup costs, on a receive path). :meth:`add` forgets the oldest beyond
    its ``limit``: what is forgotten is old enough that nothing more arrives for it."""

    __slots__ = ()

    def add(self, key: Any, limit: int) -> None:
        """Remember ``key`` (as the newest); keep at most ``limit`` keys."""
        self[key] = None
        if len(self) > limit:
            del self[next(iter(self))]

    def discard(self, key: Any) -> None:
        self.pop(key, None)
