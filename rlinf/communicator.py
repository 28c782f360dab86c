"""The public :class:`Communicator`: the messaging core plus the entry points of the
subsystems built on it (groups, resharding, channels, the weight store).

The core (:class:`rlinf.core.communicator.CoreCommunicator`) knows nothing of the
layers above it; this class sits above them and forwards ``group``, ``reshard``,
``create_channel`` and ``channel`` to them, typed against the core's internal
interface (:mod:`rlinf.core.interface`). It is what ``rlinf.connect``,
``Cluster.connect``, spawned workers and ``rlinf.init`` give users.

Layer: above ``collectives``, ``channel`` and ``weights``; below ``launch`` and ``sync``.
"""

from __future__ import annotations

from typing import Any

from .channel.client import create_channel, open_channel
from .collectives.group import Group
from .collectives.reshard import reshard
from .core.communicator import CoreCommunicator
from .weights.store import open_store

__all__ = ["Communicator", "connect"]


class Communicator(CoreCommunicator):
    """A worker's endpoint: point-to-point messaging, membership, groups and channels.

    Use it as an async context manager (see :func:`connect`). All methods run on the
    loop that entered it, except ``blocking_*`` (any other thread). Every operation
    that takes ``timeout=`` (its own, its groups', its channels') treats None as
    ``RLINF_TIMEOUT`` (``settings.timeout``) if set, else as "wait forever"; a timeout
    given to the call wins. Leaving the ``async with`` block because of an exception
    closes it all the same; its peers then see it ``failed`` (with the exception's
    one-line summary) instead of ``left``.

    Args:
        address: this worker's ``"group:rank"`` (default ``$RLINF_ADDRESS``).
        manager: the manager's endpoint (default ``$RLINF_MANAGER``).
        token: the cluster token (default ``$RLINF_TOKEN``).
        codec: the codec to encode/decode messages with (default ``Codec()``).
        connect_timeout: seconds to wait for the manager at start.
        meta: extra registration data (shown by ``rlinf top``): plain data (None, bool,
            numbers, str, bytes, and lists and maps of them, at most 16 deep).
        shm_views: arrays received through shared memory are zero-copy views of the
            sender's slot (True, the default; the slot returns to the sender when they are
            garbage-collected), or owned copies (False: nothing of the sender's is held;
            a large same-node message is then read straight from the sender's memory
            when it arrives, one copy, where the kernel allows it, else copied out of
            the slot at receive time: see ``RLINF_SHM_PULL`` in ``docs/transports.md``).
            Default ``$RLINF_SHM_VIEWS`` (``0`` for copies), else True. The same holds for
            GPU tensors received through CUDA IPC (views of the sender's device slot, or
            owned copies).
        exclusive: join only if no live worker holds ``address`` (else ``start``
            raises :class:`~rlinf.AddressInUseError`). By default a second worker under
            a live address replaces the first, as a restarted worker does.
        manager_host: the address of the worker whose process also runs the manager, if
            one does (``rlinf.init`` passes rank 0's). Lost peers are reported by the
            manager; while it is silent for the peer timeout, this communicator reports
            lost, by itself, that worker and the peers on its own machine whose process
            is gone (operations on them fail with ``PeerLostError`` instead of waiting
            for a manager that may never come back).
        disable: transports this communicator never uses, added to
            ``$RLINF_DISABLE_TRANSPORTS`` (names of :data:`rlinf.routing.TRANSPORTS`).
        forwards_unchanged: this process never writes into arrays it received and then
            forwards (a relay such as the channel process). Forwarded views of another
            process's shared memory then go by reference as they are, without first
            making this process's mapping copy-on-write (which guards their receiver
            from later writes here, at the cost of a remap per forwarded slot).
        settings: every ``RLINF_*`` knob (:class:`rlinf.config.Settings`; see
            ``docs/configuration.md``). Default ``Settings.from_env()``, read when the
            communicator is constructed (a bad value raises ``ValueError`` naming the
            variable). The ``$RLINF_*`` defaults above are its fields: ``address``,
            ``manager``, ``token`` and ``shm_views`` given here win over them, and
            ``disable`` adds to its ``disable_transports``.
    """

    # -- subsystems (each lives in its own package; these forward to it) ------------------
    def group(self, addresses: list[str], *, name: str = ""):
        """A collective group over ``addresses`` (same list, any order, on every member),
        and ``name`` (the same on every member: after a member restarted, use a new one).

        See :class:`rlinf.collectives.group.Group`. No setup call is needed on the other members.
        """
        return Group(self, addresses, name)

    async def reshard(self, shard: Any, *, src: list[str], dst: list[str], dim: int = 0,
                      timeout: float | None = None) -> Any:
        """M->N batch resharding; see :func:`rlinf.collectives.reshard.reshard`."""
        return await reshard(self, shard, src=src, dst=dst, dim=dim, timeout=timeout)

    async def create_channel(self, name: str, *, maxsize: int = 0, policy: Any = "fifo", **options: Any):
        """Start a channel server process named ``name`` and return a handle to it."""
        return await create_channel(self, name, maxsize=maxsize, policy=policy, **options)

    async def channel(self, name: str, **options: Any):
        """A handle to the existing channel ``name`` (waits for it to appear)."""
        return await open_channel(self, name, **options)

    async def weights(self, name: str):
        """This communicator's handle to the versioned weight store ``name`` (cluster-wide;
        its first publish creates it); see :class:`rlinf.weights.WeightStore`."""
        return await open_store(self, name)


def connect(address: str | None = None, manager: str | None = None, token: str | None = None,
            **options: Any) -> Communicator:
    """A communicator for ``address``; use it as ``async with rlinf.connect(...) as comm``.

    Defaults come from ``RLINF_ADDRESS``, ``RLINF_MANAGER`` and ``RLINF_TOKEN``.
    """
    return Communicator(address, manager=manager, token=token, **options)
