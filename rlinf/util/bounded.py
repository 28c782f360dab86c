"""Bookkeeping that stays bounded in long-lived processes: keys remembered to drop what
arrives late for them (:class:`Recent`), and when to look for dead entries again
(:class:`Doubling`)."""

from __future__ import annotations

from typing import Any

__all__ = ["Recent", "Doubling"]


class Recent(dict):
    """The keys added, oldest first (a ``dict`` of keys to a value, None by default:
    ``key in recent`` costs what a dict lookup costs, on a receive path). :meth:`add`
    forgets the oldest beyond its ``limit``: what is forgotten is old enough that nothing
    more arrives for it."""

    __slots__ = ()

    def add(self, key: Any, limit: int, value: Any = None) -> Any:
        """Remember ``key`` (as the newest, with ``value``); keep at most ``limit`` keys.
        Returns the key forgotten to make room, or None."""
        self.pop(key, None)
        self[key] = value
        if len(self) > limit:
            oldest = next(iter(self))
            del self[oldest]
            return oldest
        return None

    def discard(self, key: Any) -> None:
        self.pop(key, None)


class Doubling:
    """When to look again for dead entries of a collection that may keep growing: once
    it has doubled since the last look. Dead entries then stay fewer than live ones, and
    each entry costs O(1) checks in all (looking at every growth would be quadratic)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = 2

    def due(self, n: int) -> bool:
        return n >= 2 * self._last

    def looked(self, n: int) -> None:
        self._last = max(n, 2)
