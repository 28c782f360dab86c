"""Forgetting the per-key state of keys no longer used (a channel keyed by episode or
request id sees each key for a while, then never again). No I/O."""

from __future__ import annotations

from typing import Any

__all__ = ["forget_idle_keys"]


def forget_idle_keys(core: Any) -> None:
    """Forget the keys under which nothing is queued, in flight or waited for. A
    channel keyed by episode or request id sees each key for a while, then never
    again: its per-key state must not grow for good. (A consumer with ``prefetch``
    keeps the credit of every key it got from, so its keys are kept.) A key used
    again starts afresh: its consumers join it with their next get."""
    for key in [k for k, n in core.live.items() if n == 0]:
        members = core.consumers.get(key, ())
        if core.shared.get(key) or any(h.wants(key) or h.assigned.get(key) for h in members):
            continue
        for h in members:
            h.keys.discard(key)
            h.requests.pop(key, None)
            h.assigned.pop(key, None)
            h.credit.pop(key, None)
            h.last_sent.pop(key, None)
        for table in (core.shared, core.consumers, core.wanting, core.key_len, core.key_weight, core.live,
                      core.pacing.stale_by_key):
            table.pop(key, None)
    core.keys_looked.looked(len(core.live))
