"""Data channels: named, load-balanced queues served by their own worker process.

``ch = await comm.create_channel(name, maxsize=0, policy="fifo")`` starts one;
``ch = await comm.channel(name)`` finds it; see :class:`Channel` and ``docs/channel.md``.
"""

from __future__ import annotations

from . import policies
from .client import Channel
from .policies import (FIFO, ConsumerInfo, ItemInfo, LoadBalancePolicy, MostFreeMemory, PerformanceAware, RoundRobin,
                       ShortestQueue, SpeedMeter, WeightedRoundRobin, make_policy)
from .stats import ChannelStats, ConsumerStats, KeyStats

__all__ = [
    "policies",
    "Channel",
    "ChannelStats",
    "ConsumerStats",
    "KeyStats",
    "ItemInfo",
    "ConsumerInfo",
    "LoadBalancePolicy",
    "FIFO",
    "RoundRobin",
    "WeightedRoundRobin",
    "ShortestQueue",
    "PerformanceAware",
    "MostFreeMemory",
    "SpeedMeter",
    "make_policy",
]

