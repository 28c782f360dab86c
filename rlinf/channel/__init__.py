"""Data channels: named, load-balanced queues served by their own worker process."""

from __future__ import annotations

from . import policies
from .policies import (
    FIFO,
    ConsumerInfo,
    ItemInfo,
    LoadBalancePolicy,
    MostFreeMemory,
    PerformanceAware,
    RoundRobin,
    ShortestQueue,
    SpeedMeter,
    WeightedRoundRobin,
    make_policy,
)

__all__ = [
    "policies",
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
