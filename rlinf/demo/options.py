"""The demo's choices, importable without the demo's heavy parts (``rlinf --help``
stays fast)."""

__all__ = ["POLICIES"]

#: The channel policies ``rlinf demo --policy`` accepts.
POLICIES = ("fifo", "round_robin", "weighted_round_robin", "shortest_queue", "performance_aware")
