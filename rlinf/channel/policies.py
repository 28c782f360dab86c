"""Load-balancing policies of a data channel: which consumer gets the next item.

A policy is a small, pure object: the channel server shows it a snapshot of the item
(:class:`ItemInfo`) and of every live consumer (:class:`ConsumerInfo`), and it returns the
index of the consumer that should process the item. Policies do no I/O and never await;
they run inside the channel process, once per ``put``, so they must be cheap.

Built in (names accepted by :func:`make_policy`):

- ``"fifo"`` (:class:`FIFO`, the default): no pre-assignment; consumers compete for one
  queue and whichever waiting consumer asks first gets the head.
- ``"round_robin"`` (:class:`RoundRobin`): consumers in turn.
- ``"weighted_round_robin"`` (:class:`WeightedRoundRobin`): equal total weight each.
- ``"shortest_queue"`` (:class:`ShortestQueue`): least pending weight.
- ``"performance_aware"`` (:class:`PerformanceAware`): earliest expected finish, using
  each consumer's measured speed (:class:`SpeedMeter`).
- ``"most_free_memory"`` (:class:`MostFreeMemory`): most free device memory.

A user policy subclasses :class:`LoadBalancePolicy` and implements
:meth:`~LoadBalancePolicy.select_consumer`. Policy objects travel to the channel process,
so keep them picklable (plain attributes, a module-level class).
"""

from __future__ import annotations

import inspect
import math
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
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
    "select_checked",
    "POLICY_NAMES",
]


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """What a policy sees of one item.

    Attributes:
        item_id: the channel's id of the item (unique within the channel).
        weight: the cost of processing it, in the producer's units (``put(weight=...)``).
        key: the sub-queue key given to ``put``, or None.
        nbytes: payload size in bytes (0 when unknown).
        producer: address of the producer (``"group:rank"``), or "" when unknown.
    """

    item_id: int
    weight: float
    key: object | None = None
    nbytes: int = 0
    producer: str = ""


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """A snapshot of one consumer, built by the channel server for each decision.

    Attributes:
        address: the consumer's address (``"group:rank"``); unique among the consumers.
        node_id: the consumer's node.
        pending_count, pending_weight: items assigned to it and not yet consumed.
        consumed_count, consumed_weight: items it has finished so far.
        speed: measured processing speed in weight units per second (an EWMA, see
            :class:`SpeedMeter`), or None until measured.
        busy_fraction: share of recent wall time it spent processing, in [0, 1].
        free_device_memory: bytes free on its device as last reported, or None.
        waiting: True while it has an outstanding ``get()``.
    """

    address: str
    node_id: str = ""
    pending_count: int = 0
    pending_weight: float = 0.0
    consumed_count: int = 0
    consumed_weight: float = 0.0
    speed: float | None = None
    busy_fraction: float = 0.0
    free_device_memory: int | None = None
    waiting: bool = False


class SpeedMeter:
    """Exponentially weighted moving average of a consumer's speed (weight / second).

    Each sample is ``weight / seconds`` for one finished item (or batch); the first sample
    sets the value, each later one moves it by ``alpha`` of the difference:
    ``value = value + alpha * (sample - value)``.

    Args:
        alpha: smoothing factor in (0, 1]; 1 keeps only the latest sample.

    Raises:
        ValueError: ``alpha`` is outside (0, 1].
    """

    __slots__ = ("alpha", "count", "_value")

    def __init__(self, alpha: float = 0.3) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"SpeedMeter alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.count = 0
        self._value: float | None = None

    @property
    def value(self) -> float | None:
        """The current speed estimate, or None before the first usable sample."""
        return self._value

    def update(self, weight: float, seconds: float) -> float | None:
        """Add one measurement.

        Samples that carry no information about speed are skipped: zero weight, or zero
        seconds (the clock did not tick).

        Args:
            weight: weight processed, >= 0.
            seconds: wall time it took, >= 0.

        Returns:
            The updated estimate (None if no usable sample has been seen yet).

        Raises:
            ValueError: ``weight`` or ``seconds`` is negative or not finite.
        """
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if weight == 0 or seconds == 0:
            return self._value
        sample = weight / seconds
        if self._value is None:
            self._value = sample
        else:
            self._value += self.alpha * (sample - self._value)
        self.count += 1
        return self._value

    def reset(self) -> None:
        """Forget every measurement."""
        self.count = 0
        self._value = None

    def __repr__(self) -> str:
        return f"<SpeedMeter alpha={self.alpha} value={self._value!r} samples={self.count}>"


class LoadBalancePolicy(ABC):
    """Base class of every load-balancing policy.

    Subclasses implement :meth:`select_consumer`; :meth:`on_consumed` and :meth:`reset`
    are optional. ``name`` defaults to the class name of a subclass that does not set it.

    Attributes:
        name: the policy's name (as shown in ``channel.stats()``).
        assigns: True when the server assigns each item to a consumer at ``put`` time;
            False (FIFO only) when consumers compete for one queue instead.
        steals: work stealing is on by default (``create_channel(work_stealing=None)``)
            with this policy: True for the policies that place by load or speed, where
            which consumer gets an item carries no meaning of its own.
    """

    name: ClassVar[str] = "policy"
    assigns: ClassVar[bool] = True
    steals: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    @abstractmethod
    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Choose the consumer for ``item``.

        Args:
            item: the item to place.
            consumers: a snapshot of every live consumer, in the server's order.

        Returns:
            An index into ``consumers``.

        Raises:
            ValueError: ``consumers`` is empty (``"no consumers"``).
        """

    def assign_batch(self, items: list[ItemInfo], consumers: list[ConsumerInfo]) -> list[int] | None:
        """Hook: place the items put together (in one message of a producer, or waiting
        in the shared queue) at once; a policy that knows them all can do better than
        one at a time. Default: None (one at a time with :meth:`select_consumer`).

        A policy that implements it is a *batch* policy: the channel then serves the
        items FIFO to whoever asks (competition) until every consumer of the key has a
        measured ``speed``, and places what is waiting once they have.

        Args:
            items: the items, in put order.
            consumers: a snapshot of every live consumer, every ``speed`` measured.

        Returns:
            One index into ``consumers`` per item, or None.
        """
        return None

    def on_consumed(self, consumer: str, item: ItemInfo, seconds: float) -> None:  # noqa: B027
        """Hook: ``consumer`` finished ``item`` in ``seconds`` of wall time. Default: no-op.

        Args:
            consumer: the consumer's address.
            item: the finished item.
            seconds: time from hand-out to completion.
        """

    def reset(self) -> None:  # noqa: B027
        """Forget any state (e.g. when the channel restarts). Default: no-op."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"


def _require(consumers: list[ConsumerInfo]) -> int:
    n = len(consumers)
    if n == 0:
        raise ValueError("no consumers")
    return n


class FIFO(LoadBalancePolicy):
    """Consumers compete for one queue: the first waiting ``get()`` takes the head.

    Items are not pre-assigned (``assigns = False``). :meth:`select_consumer` is only a
    fallback for the server: the first consumer with an outstanding ``get()``, else 0.
    """

    name = "fifo"
    assigns = False

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the first waiting consumer, or 0 if none waits.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        n = _require(consumers)
        for i in range(n):
            if consumers[i].waiting:
                return i
        return 0


class RoundRobin(LoadBalancePolicy):
    """Consumers in turn, in the server's order.

    The turn is kept by address, not by index, so consumers joining or leaving do not
    make it skip or repeat anyone: the next consumer is the one after the last one served;
    if that one has left, the first of its successors (in the order last seen) still
    present.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None
        self._order: tuple[str, ...] = ()

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the consumer whose turn it is.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        n = _require(consumers)
        addresses = [c.address for c in consumers]
        position = {a: i for i, a in enumerate(addresses)}
        choice = 0
        if self._last in position:
            choice = (position[self._last] + 1) % n
        elif self._last is not None and self._last in self._order:
            # The last one served has left: continue with its first surviving successor.
            start = self._order.index(self._last)
            m = len(self._order)
            for step in range(1, m):
                successor = self._order[(start + step) % m]
                if successor in position:
                    choice = position[successor]
                    break
        self._last = addresses[choice]
        self._order = tuple(addresses)
        return choice

    def reset(self) -> None:
        """Start the next cycle at the first consumer."""
        self._last = None
        self._order = ()


class WeightedRoundRobin(LoadBalancePolicy):
    """Equal total weight per consumer: least ``consumed_weight + pending_weight``.

    Ties go to the lowest index. Speeds are ignored, so this balances *work handed out*,
    not *time spent*.
    """

    name = "weighted_round_robin"

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the consumer with the least weight assigned so far.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        _require(consumers)
        return min(
            range(len(consumers)),
            key=lambda i: consumers[i].consumed_weight + consumers[i].pending_weight,
        )


def _shortest_queue_key(consumers: list[ConsumerInfo], i: int) -> tuple[float, int, int]:
    c = consumers[i]
    return (c.pending_weight, c.pending_count, i)


class ShortestQueue(LoadBalancePolicy):
    """Least pending weight; ties go to fewer pending items, then to the lowest index."""

    name = "shortest_queue"
    steals = True

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the consumer with the least pending weight.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        _require(consumers)
        return min(range(len(consumers)), key=lambda i: _shortest_queue_key(consumers, i))


def _usable_speed(speed: float | None) -> bool:
    return speed is not None and math.isfinite(speed) and speed > 0


class PerformanceAware(LoadBalancePolicy):
    """Earliest expected finish: least ``(pending_weight + item.weight) / speed``.

    ``speed`` is the consumer's measured EWMA speed from its snapshot; when the snapshot
    has none, the policy's own :class:`SpeedMeter` fed by :meth:`on_consumed`; when
    neither exists yet, the mean of the known speeds (``default_speed`` if none is
    known). Counting the item itself is what keeps a large item off a slow consumer.
    Ties go to the faster consumer, then to the lowest index.

    Args:
        alpha: smoothing factor of the policy's own speed meters.
        default_speed: speed assumed while no consumer has been measured, > 0.

    Raises:
        ValueError: ``alpha`` outside (0, 1] or ``default_speed`` not > 0.
    """

    name = "performance_aware"
    steals = True

    def __init__(self, *, alpha: float = 0.3, default_speed: float = 1.0) -> None:
        SpeedMeter(alpha)  # validates alpha with the meter's own message
        if not _usable_speed(default_speed):
            raise ValueError(f"default_speed must be a finite number > 0, got {default_speed!r}")
        self.alpha = float(alpha)
        self.default_speed = float(default_speed)
        self._meters: dict[str, SpeedMeter] = {}

    def speeds(self, consumers: list[ConsumerInfo]) -> list[float]:
        """The speed this policy assumes for each consumer (see the class docstring).

        Args:
            consumers: consumer snapshots.

        Returns:
            One positive speed per consumer, in order.
        """
        raw: list[float | None] = []
        for c in consumers:
            speed = c.speed
            if not _usable_speed(speed):
                meter = self._meters.get(c.address)
                speed = meter.value if meter is not None else None
            raw.append(speed if _usable_speed(speed) else None)
        known = [s for s in raw if s is not None]
        fallback = math.fsum(known) / len(known) if known else self.default_speed
        return [fallback if s is None else s for s in raw]

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the consumer expected to finish ``item`` first.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        _require(consumers)
        speeds = self.speeds(consumers)
        weight = max(item.weight, 0.0)
        return min(
            range(len(consumers)),
            key=lambda i: ((consumers[i].pending_weight + weight) / speeds[i], -speeds[i], i),
        )

    def assign_batch(self, items: list[ItemInfo], consumers: list[ConsumerInfo]) -> list[int]:
        """Longest processing time first: the heaviest item first, each to the consumer
        expected to finish it first (its pending work counted), so consumers of unequal
        speed end a batch together, within about one light item.

        Returns:
            One index into ``consumers`` per item, in the order of ``items``.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        _require(consumers)
        speeds = self.speeds(consumers)
        ends = [c.pending_weight / s for c, s in zip(consumers, speeds)]
        out = [0] * len(items)
        for j in sorted(range(len(items)), key=lambda j: -max(items[j].weight, 0.0)):
            weight = max(items[j].weight, 0.0)
            i = min(range(len(consumers)), key=lambda i: (ends[i] + weight / speeds[i], -speeds[i], i))
            ends[i] += weight / speeds[i]
            out[j] = i
        return out

    def on_consumed(self, consumer: str, item: ItemInfo, seconds: float) -> None:
        """Feed the consumer's own speed meter (used when a snapshot carries no speed)."""
        meter = self._meters.get(consumer)
        if meter is None:
            meter = self._meters[consumer] = SpeedMeter(self.alpha)
        meter.update(item.weight, seconds)

    def reset(self) -> None:
        """Forget every speed measured through :meth:`on_consumed`."""
        self._meters.clear()


class MostFreeMemory(LoadBalancePolicy):
    """Most free device memory; consumers without a report count as 0 bytes free.

    Ties follow the :class:`ShortestQueue` rule (least pending weight, fewer pending
    items, lowest index).
    """

    name = "most_free_memory"

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
        """Return the index of the consumer with the most free device memory.

        Raises:
            ValueError: ``consumers`` is empty.
        """
        _require(consumers)

        def key(i: int) -> tuple[int, float, int, int]:
            free = consumers[i].free_device_memory or 0
            return (-free, *_shortest_queue_key(consumers, i))

        return min(range(len(consumers)), key=key)


_BUILTIN: dict[str, type[LoadBalancePolicy]] = {
    cls.name: cls
    for cls in (FIFO, RoundRobin, WeightedRoundRobin, ShortestQueue, PerformanceAware, MostFreeMemory)
}

#: Names accepted by :func:`make_policy`.
POLICY_NAMES: tuple[str, ...] = tuple(_BUILTIN)


def make_policy(
    spec: str | LoadBalancePolicy | type[LoadBalancePolicy] | None = None,
) -> LoadBalancePolicy:
    """Build a policy from a name, a class or an instance.

    Args:
        spec: None (FIFO), a built-in name (case-insensitive; ``-`` or spaces may stand
            for ``_``), a :class:`LoadBalancePolicy` subclass (instantiated with no
            arguments) or an instance (returned as is).

    Returns:
        A policy instance.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
        TypeError: anything else, or a class that is not a :class:`LoadBalancePolicy`
            subclass or cannot be instantiated without arguments, or a policy whose
            ``select_consumer`` cannot be called as ``select_consumer(item, consumers)``
            (checked as soon as it is built).
    """
    if spec is None:
        return FIFO()
    if isinstance(spec, LoadBalancePolicy):
        return _check_policy(spec)
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_").replace(" ", "_")
        cls = _BUILTIN.get(key)
        if cls is None:
            raise ValueError(
                f"unknown load-balancing policy {spec!r}; valid names: {', '.join(POLICY_NAMES)} "
                "(or pass a LoadBalancePolicy subclass or instance)"
            )
        return cls()
    if isinstance(spec, type):
        if not issubclass(spec, LoadBalancePolicy):
            raise TypeError(f"policy class {spec.__qualname__} does not subclass rlinf.LoadBalancePolicy")
        if "select_consumer" in getattr(spec, "__abstractmethods__", ()):
            raise TypeError(f"policy class {spec.__qualname__} does not implement {_SELECT}")
        try:
            policy = spec()
        except TypeError as exc:
            raise TypeError(
                f"cannot build policy {spec.__qualname__}() without arguments ({exc}); "
                "pass an instance instead"
            ) from exc
        return _check_policy(policy)
    raise TypeError(
        f"policy must be None, a name ({', '.join(POLICY_NAMES)}), a LoadBalancePolicy "
        f"subclass or instance, got {type(spec).__name__}"
    )


_SELECT = "select_consumer(self, item, consumers) -> int"


def _check_policy(policy: LoadBalancePolicy) -> LoadBalancePolicy:
    """Check, before any item is placed, that ``policy.select_consumer`` can be called as
    ``select_consumer(item, consumers)``: a callable, not a coroutine function (a policy
    never awaits), taking those two arguments.

    Args:
        policy: a policy instance.

    Returns:
        ``policy``.

    Raises:
        TypeError: it cannot be called that way; the message says why.
    """
    method = getattr(policy, "select_consumer", None)
    what = f"policy {type(policy).__qualname__}"
    if not callable(method):
        raise TypeError(f"{what} does not implement {_SELECT} (select_consumer is {method!r})")
    if inspect.iscoroutinefunction(method):
        raise TypeError(f"{what}: select_consumer is a coroutine function; a policy runs once per item "
                        f"and never awaits: define it with plain def, as {_SELECT}")
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):    # a callable without introspectable signature: checked per call
        return policy
    try:
        signature.bind(None, None)
    except TypeError as exc:
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty)
        raise TypeError(f"{what}: select_consumer{bare} cannot be called as "
                        f"select_consumer(item, consumers) ({exc}); define {_SELECT}") from None
    return policy


def select_checked(policy: LoadBalancePolicy, item: ItemInfo, consumers: list[ConsumerInfo]) -> int:
    """Call ``policy.select_consumer`` and check its answer (for user policies).

    Args:
        policy: the policy to ask.
        item: the item to place.
        consumers: the consumer snapshots (non-empty).

    Returns:
        A valid index into ``consumers``.

    Raises:
        ValueError: ``consumers`` is empty, or the policy returned an out-of-range index.
        TypeError: the policy returned something other than an integer (a bool, a float...).
    """
    _require(consumers)
    answer = policy.select_consumer(item, consumers)
    try:   # any integer (numpy's too: ``np.argmax``), not a bool
        choice = operator.index(answer)
    except TypeError:
        choice = None
    if choice is None or isinstance(answer, bool):
        raise TypeError(
            f"policy {policy.name!r} returned {type(answer).__name__} {answer!r}; "
            "select_consumer must return an index into consumers"
        )
    if not 0 <= choice < len(consumers):
        raise ValueError(
            f"policy {policy.name!r} returned index {choice} for {len(consumers)} consumers"
        )
    return choice
