"""Small helpers for asyncio futures, shared by every layer."""

from __future__ import annotations

import asyncio

__all__ = ["retrieve"]


def retrieve(future: asyncio.Future) -> None:
    """Mark ``future``'s exception as retrieved (a done-callback for a future whose
    failure is reported elsewhere, or moot): asyncio then does not log it as "never
    retrieved"."""
    if not future.cancelled():
        future.exception()
