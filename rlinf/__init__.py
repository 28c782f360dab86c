"""rlinf: asyncio-native messaging for distributed reinforcement learning.

Importing rlinf has no side effects: no sockets, no CUDA, no threads. See
``docs/getting-started.md`` and the public API in ``__all__``.
"""

from __future__ import annotations

from . import policies
from .channel.client import Channel
from .channel.policies import ConsumerInfo, ItemInfo, LoadBalancePolicy
from .channel.stats import ChannelStats
from .launch.cluster import Cluster, WorkerGroup
from .communicator import Communicator, connect
from .sync import SyncCommunicator, init, shutdown
from .errors import (AddressInUseError, AuthenticationError, ClosedError, CommTimeoutError, DecodeError, EncodeError,
                     EndOfChannel, PeerLostError, ProtocolError, RlinfError, TransportUnavailableError,
                     WorkerFailedError, WouldBlock)
from .collectives.group import Group
from .info import DeviceInfo, MembershipEvent, WorkerInfo
from .control.manager import Manager
from .core.stats import CommStats, PeerStats, TransportStats
from .core.work import Work
from .launch.worker import Worker
from .version import __version__


__all__ = [
    "AddressInUseError",
    "AuthenticationError",
    "Channel",
    "ChannelStats",
    "ClosedError",
    "Cluster",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "ConsumerInfo",
    "DecodeError",
    "DeviceInfo",
    "EncodeError",
    "EndOfChannel",
    "Group",
    "ItemInfo",
    "LoadBalancePolicy",
    "Manager",
    "MembershipEvent",
    "PeerLostError",
    "PeerStats",
    "ProtocolError",
    "RlinfError",
    "TransportStats",
    "TransportUnavailableError",
    "Work",
    "Worker",
    "WorkerFailedError",
    "WorkerGroup",
    "WorkerInfo",
    "WouldBlock",
    "SyncCommunicator",
    "connect",
    "init",
    "policies",
    "shutdown",
]
