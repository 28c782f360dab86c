"""A channel's calls into its load-balancing policy, guarded: a user policy's bug must
not stop the channel, nor flood its log once per item."""

from __future__ import annotations

import logging

from .policies import ConsumerInfo, ItemInfo, LoadBalancePolicy, select_checked

__all__ = ["PolicyGuard"]

log = logging.getLogger("rlinf.channel")


class PolicyGuard:
    """Calls ``policy`` for channel ``channel``; a call that raises or answers badly is
    counted in :attr:`errors` (``stats().policy_errors``), and only the first is logged,
    as a warning with its traceback.

    Args:
        channel: the channel's name (for the log).
        policy: the channel's policy.
    """

    __slots__ = ("channel", "policy", "errors")

    def __init__(self, channel: str, policy: LoadBalancePolicy) -> None:
        self.channel = channel
        self.policy = policy
        self.errors = 0

    def select(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int | None:
        """The index of the consumer the policy chose for ``item``, or None when it raised
        or returned a bad value (the item then goes to the shared queue)."""
        try:
            return select_checked(self.policy, item, consumers)
        except Exception:
            self._failed(f"select_consumer failed; item {item.item_id} goes to the shared queue")
            return None

    def select_batch(self, items: list[ItemInfo], consumers: list[ConsumerInfo]) -> list[int] | None:
        """The policy's ``assign_batch`` answer, checked: one valid index per item; None
        when it has none, raised or answered badly (the items then stay shared)."""
        try:
            answer = self.policy.assign_batch(items, consumers)
            if answer is None:
                return None
            choices = [int(i) for i in answer]
            if len(choices) != len(items) or not all(0 <= i < len(consumers) for i in choices):
                raise ValueError(f"assign_batch returned {len(choices)} indices for {len(items)} items "
                                 f"and {len(consumers)} consumers (or one out of range)")
            return choices
        except Exception:
            self._failed(f"assign_batch failed; {len(items)} items stay in the shared queue")
            return None

    def consumed(self, consumer: str, item: ItemInfo, seconds: float) -> None:
        """Tell the policy ``consumer`` finished ``item`` in ``seconds``."""
        try:
            self.policy.on_consumed(consumer, item, seconds)
        except Exception:
            self._failed("on_consumed failed")

    def _failed(self, what: str) -> None:   # called inside an ``except``: logs its traceback
        self.errors += 1
        if self.errors == 1:
            log.warning("channel %s: policy %s: %s (logged once; stats().policy_errors counts every failure)",
                        self.channel, self.policy.name, what, exc_info=True)
