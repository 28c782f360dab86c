"""rlinf: asyncio-native messaging for distributed reinforcement learning.

Importing rlinf has no side effects: no sockets, no CUDA, no threads. See
``docs/getting-started.md`` and the public API in ``__all__``.
"""

from __future__ import annotations

#: The distribution (``pip install aiorlinf``) that provides this package. The name
#: ``rlinf`` on the package index belongs to another project, the RLinf framework, whose
#: import name is also ``rlinf``: the two cannot share one environment.
_DISTRIBUTION = "aiorlinf"
_SUMMARY = "Asyncio-native messaging for distributed reinforcement learning"


def _refuse_the_other_rlinf() -> None:
    """Raise ImportError when the environment also holds the RLinf framework's ``rlinf``.

    Both install files into ``site-packages/rlinf/``: whichever came last overwrote the
    other's, so what imports is a mix. Checked before anything else is imported, so the
    error is this one, not a confusing failure deep inside. An install of this project
    made before the distribution was renamed (name ``rlinf``, our summary) is fine, and so
    is a source tree on PYTHONPATH with no ``rlinf`` distribution installed at all.
    """
    from importlib import metadata

    try:
        other = metadata.distribution("rlinf")
    except metadata.PackageNotFoundError:
        return
    summary = other.metadata["Summary"] or ""
    if summary.startswith(_SUMMARY):
        return
    raise ImportError(
        f"this environment has the distribution 'rlinf' {other.version} installed ({summary!r}), which is "
        f"the RLinf framework, not the asyncio messaging library (distribution {_DISTRIBUTION!r}). Both use "
        f"the import name 'rlinf' and cannot share one environment: run 'pip uninstall rlinf' and reinstall "
        f"'{_DISTRIBUTION}', or use a separate virtual environment for each.", name="rlinf")


_refuse_the_other_rlinf()

from . import policies  # noqa: E402  (after the check above, on purpose)
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
from .tools.trace import trace
from .weights import WeightStats, WeightStore
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
    "WeightStats",
    "WeightStore",
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
    "trace",
]
