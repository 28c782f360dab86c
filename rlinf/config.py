"""Settings: every ``RLINF_*`` environment variable, parsed once into one frozen object.

Build it once where a process starts (``Settings.from_env()``: the Communicator does, in
its constructor, unless given ``settings=``) and pass it down; code below reads fields,
never the environment. This module is the only one that reads ``os.environ``: it also
holds :class:`LaunchEnv` (the variables torchrun and Slurm set, which ``rlinf.init``
reads) and :func:`visible_devices` (``CUDA_VISIBLE_DEVICES``). The launcher only writes
the environment of the processes it starts (``rlinf/launch/``). Everything else takes a
:class:`Settings` (or one of its values) as an argument, so a test builds the one it
needs from a plain dict::

    settings = Settings.from_env({"RLINF_SHM_CAP": "512M", "RLINF_SHM_FD": "off"})
    settings.shm_cap                      # 536870912
    settings.replace(peer_timeout=10.0)   # a changed copy

Each kind of value has one parser, shared by every variable of that kind:

* size: bytes, or a number with ``K``/``M``/``G``/``T`` (also ``KiB``, ``KB``, any
  case; powers of 1024), e.g. ``64K``, ``16M``, ``4G``, ``1.5G``;
* bool: ``1/0``, ``true/false``, ``yes/no``, ``on/off``, any case;
* duration: a number of seconds (or microseconds, where the variable says so), finite
  and > 0 unless the variable lets 0 turn something off;
* int: a whole number; names: comma- or space-separated lower-case names; str: text.

An empty (or blank) variable counts as unset, so it takes the default. A bad value
raises ``ValueError`` naming the variable and the value, e.g.
``RLINF_SHM_CAP='4X': not a size (use bytes or 64K/16M/4G)``.

Each field's metadata (:class:`Knob`: the variable, its kind, its default and a
one-sentence meaning) is the single source of ``docs/configuration.md``
(``scripts/gen_config_docs.py``). Standard library only: importing this is cheap.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Mapping

__all__ = ["Settings", "DEFAULTS", "Knob", "knobs", "LaunchEnv", "visible_devices", "parse_size", "parse_bool",
           "parse_duration", "parse_int", "parse_names", "parse_str", "format_size"]

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_SCALE = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB}

# A number, then an optional unit: K/M/G/T with an optional "B"/"iB", or a lone "B".
_SIZE_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?:(?P<unit>[kmgt])(?:i?b)?|(?P<bytes>b))?", re.IGNORECASE)
_INT_RE = re.compile(r"[+-]?\d+")
_NAME_RE = re.compile(r"[a-z0-9_]+")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


# --------------------------------------------------------------------------- parsers
# One per kind of value. Each takes the variable's name (for the message) and its raw
# text, which is never empty here: from_env gives unset and blank variables their default.

def parse_size(name: str, raw: str, *, minimum: int = 0, off: bool = False) -> int:
    """A byte count: plain bytes or a number with a K/M/G/T suffix (powers of 1024).

    Args:
        name: the variable, for the error message.
        raw: its text, e.g. ``"4096"``, ``"64K"``, ``"16MiB"``, ``"1.5g"``. A fraction
            needs a unit and is rounded down to whole bytes.
        minimum: the smallest value allowed.
        off: also accept ``off``/``no``/``false`` (for variables where 0 turns a
            feature off), meaning 0.

    Returns:
        The number of bytes.

    Raises:
        ValueError: not a size, or below ``minimum``; the message names both.
    """
    text = raw.strip()
    if off and text.lower() in _FALSE:
        return 0
    match = _SIZE_RE.fullmatch(text)
    if match is None or ("." in match["num"] and not match["unit"]):
        raise ValueError(f"{name}={raw!r}: not a size (use bytes or 64K/16M/4G)")
    scale = _SCALE[(match["unit"] or match["bytes"] or "").lower()]
    value = int(Decimal(match["num"]) * scale)
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: must be at least {minimum} bytes ({format_size(minimum)})")
    return value


def parse_bool(name: str, raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, in any case, blanks around ignored.

    Raises:
        ValueError: anything else; the message names the variable and the value.
    """
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: not a boolean (use 1/0, true/false, yes/no or on/off)")


def parse_duration(name: str, raw: str, *, allow_zero: bool = False, unit: str = "s") -> float:
    """A finite, non-negative number of ``unit`` (seconds unless the variable says else).

    Args:
        name: the variable, for the error message.
        raw: its text, e.g. ``"2.5"``.
        allow_zero: whether 0 is allowed (it turns something off); else it must be > 0.
        unit: ``"s"`` or ``"us"``, only for the message: the value is returned as given.

    Raises:
        ValueError: not a number, negative, NaN or infinite, or 0 where not allowed.
    """
    words = {"s": "seconds", "us": "microseconds"}[unit]
    example = "1000" if unit == "us" else "2.5"
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={raw!r}: not a duration (use {words} {bound}, e.g. {example})")
    return value


def parse_int(name: str, raw: str, *, minimum: int | None = None) -> int:
    """A whole number (decimal digits, optionally signed).

    Raises:
        ValueError: not a whole number, or below ``minimum``.
    """
    text = raw.strip()
    if _INT_RE.fullmatch(text) is None:
        raise ValueError(f"{name}={raw!r}: not a whole number")
    value = int(text)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r}: must be a whole number >= {minimum}")
    return value


def parse_names(name: str, raw: str) -> frozenset[str]:
    """Names separated by commas and/or blanks, lower-cased (``"nccl, CUDA_IPC"``).

    Which names are known is checked by the code that uses them (the routing config
    for transports), not here.

    Raises:
        ValueError: a name is not made of letters, digits and ``_``.
    """
    names = raw.replace(",", " ").lower().split()
    if not all(_NAME_RE.fullmatch(n) for n in names):
        raise ValueError(f"{name}={raw!r}: not a list of names (use comma-separated names such as shm,nccl)")
    return frozenset(names)


def parse_str(name: str, raw: str) -> str:
    """Text, blanks around it removed."""
    return raw.strip()


def format_size(value: int) -> str:
    """``value`` bytes in the form :func:`parse_size` reads: the largest exact unit (``"256K"``)."""
    for suffix, scale in (("T", TIB), ("G", GIB), ("M", MIB), ("K", KIB)):
        if value and value % scale == 0:
            return f"{value // scale}{suffix}"
    return str(value)


# --------------------------------------------------------------------------- metadata


@dataclass(frozen=True, slots=True)
class Knob:
    """What one :class:`Settings` field reads and means (its ``metadata["knob"]``).

    Attributes:
        env: the environment variable, e.g. ``"RLINF_SHM_CAP"``.
        kind: ``"size"``, ``"bool"``, ``"duration"``, ``"int"``, ``"names"`` or ``"str"``.
        default: the field's default (``None``: unset, or decided at the use site by
            the rule ``shown`` states).
        meaning: one sentence, for the documentation.
        shown: the default as the documentation shows it, where the value alone is not
            enough (a rule such as ``min(4G, half of /dev/shm)``).
        minimum: the smallest value allowed (sizes and ints).
        off: 0 turns the feature off (sizes also accept ``off``; durations accept 0).
        unit: ``"s"`` or ``"us"`` for durations.
        name: the :class:`Settings` field's name.
    """

    env: str
    kind: str
    default: Any
    meaning: str
    shown: str | None = None
    minimum: int | None = None
    off: bool = False
    unit: str = "s"
    name: str = ""

    def parse(self, raw: str) -> Any:
        """The value of ``raw`` (non-blank text of :attr:`env`) for this knob.

        Raises:
            ValueError: the text is not a valid value; the message names the variable.
        """
        if self.kind == "size":
            return parse_size(self.env, raw, minimum=self.minimum or 0, off=self.off)
        if self.kind == "duration":
            return parse_duration(self.env, raw, allow_zero=self.off, unit=self.unit)
        if self.kind == "int":
            return parse_int(self.env, raw, minimum=self.minimum)
        return _SIMPLE_PARSERS[self.kind](self.env, raw)

    def format(self, value: Any) -> str:
        """``value`` as text this knob's parser reads back (the documentation's default)."""
        if value is None:
            return self.shown or "unset"
        if self.kind == "size":
            return format_size(value)
        if self.kind == "bool":
            return "on" if value else "off"
        if self.kind == "names":
            return ",".join(sorted(value)) if value else "none"
        if self.kind == "duration":
            return f"{value:g}"
        return str(value)

    def check(self, value: Any) -> Any:
        """``value`` (given in Python, not parsed) normalised, or ``ValueError``/``TypeError``."""
        where = f"Settings.{self.name}"
        if value is None:
            if self.default is None:
                return None
            raise TypeError(f"{where} cannot be None")
        if self.kind in ("size", "int"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{where} must be an int, got {type(value).__name__}")
            if value < (self.minimum or 0):
                raise ValueError(f"{where} must be >= {self.minimum or 0}, got {value}")
        elif self.kind == "duration":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{where} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (value == 0 and not self.off):
                raise ValueError(f"{where} must be a finite number {'>= 0' if self.off else '> 0'}, got {value}")
            value = float(value)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{where} must be a bool, got {type(value).__name__}")
        elif self.kind == "names":
            if isinstance(value, str):
                raise TypeError(f"{where} must be a collection of names, not a str")
            value = frozenset(value)
            if not all(isinstance(n, str) and _NAME_RE.fullmatch(n) for n in value):
                raise ValueError(f"{where} must hold lower-case names, got {sorted(map(str, value))}")
        elif not isinstance(value, str):
            raise TypeError(f"{where} must be a str, got {type(value).__name__}")
        return value


_SIMPLE_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "bool": parse_bool, "names": parse_names, "str": parse_str,
}


def _knob(env: str, kind: str, default: Any, meaning: str, *, shown: str | None = None,
          minimum: int | None = None, off: bool = False, unit: str = "s", secret: bool = False) -> Any:
    knob = Knob(env=env, kind=kind, default=default, meaning=meaning, shown=shown,
                minimum=minimum, off=off, unit=unit)
    return field(default=default, repr=not secret, metadata={"knob": knob})


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every ``RLINF_*`` knob, parsed once (see the module docstring and
    ``docs/configuration.md``). Frozen: use :meth:`replace` for a changed copy.

    Fields whose default is ``None`` are unset (the launcher variables) or decided where
    they are used by the rule in their metadata (``shm_cap``, ``copy_threads``). The
    token is left out of ``repr()``.
    """

    # routing
    shm_threshold: int = _knob(
        "RLINF_SHM_THRESHOLD", "size", 256 * KIB,
        "Smallest CPU payload that goes to a process on the same node through shared memory "
        "(smaller ones travel inline).")
    bulk_threshold: int = _knob(
        "RLINF_BULK_THRESHOLD", "size", MIB,
        "Smallest CPU payload that goes to another node over the bulk TCP stream "
        "(smaller ones travel inline).")
    disable_transports: frozenset[str] = _knob(
        "RLINF_DISABLE_TRANSPORTS", "names", frozenset(),
        "Transports never chosen, such as `shm`, `bulk`, `stream`, `tcp_stream`, `cuda_ipc` or `nccl` "
        "(`zmq` and `staged` cannot be disabled).")
    # shared memory
    shm_cap: int | None = _knob(
        "RLINF_SHM_CAP", "size", None,
        "Most shared memory one process's slot pool holds.",
        shown="min(4G, half of /dev/shm)")
    shm_views: bool = _knob(
        "RLINF_SHM_VIEWS", "bool", True,
        "Received arrays (and GPU tensors from CUDA IPC) are views of the sender's slot; "
        "off: owned copies (the default of `shm_views` in `rlinf.connect`).")
    shm_offload: int = _knob(
        "RLINF_SHM_OFFLOAD", "size", 16 * MIB,
        "Copies (and pulls) of at least this many bytes run in an executor thread, "
        "not on the event loop.")
    shm_pull: int = _knob(
        "RLINF_SHM_PULL", "size", MIB,
        "Payload from which a copy-out receiver (`shm_views` off) reads a same-node sender's "
        "buffers straight from its memory instead of through a slot (0 or off: never).",
        off=True)
    shm_fd: bool = _knob(
        "RLINF_SHM_FD", "bool", True,
        "Tensors already in shared memory are passed by file handle; off: copied like others.")
    shm_fd_cache: int = _knob(
        "RLINF_SHM_FD_CACHE", "size", 2 * GIB,
        "Bytes of senders' shared tensors a receiver keeps mapped for reuse.")
    copy_threads: int | None = _knob(
        "RLINF_COPY_THREADS", "int", None,
        "Threads one copy into or out of a slot uses once it reaches 8 MiB, the caller "
        "included (1: never split).",
        shown="2, or 1 on a 1-CPU machine", minimum=1)
    # GPU
    cuda_ipc_cap: int = _knob(
        "RLINF_CUDA_IPC_CAP", "size", 2 * GIB,
        "Bytes of CUDA IPC slots one sender keeps per receiver (at least 256K); past it, "
        "GPU messages to that receiver are staged through host memory.",
        minimum=256 * KIB)
    no_torch: bool = _knob(
        "RLINF_NO_TORCH", "bool", False,
        "Do not use torch to discover GPUs (cupy is tried instead).")
    # receiving
    busy_poll_us: float = _knob(
        "RLINF_BUSY_POLL", "duration", 1000.0,
        "Longest a receive polls before it sleeps, in microseconds (0: never poll).",
        off=True, unit="us")
    window_bytes: int = _knob(
        "RLINF_WINDOW_BYTES", "size", 8 * MIB,
        "Bytes of user messages one sender may have waiting in this receiver's memory, not yet "
        "received by its application (its credit window: sends wait for room; the message that "
        "fills it may overrun it, however large).", minimum=1)
    window_msgs: int = _knob(
        "RLINF_WINDOW_MSGS", "int", 4096,
        "User messages one sender may have waiting in this receiver's memory, not yet received by its "
        "application (its credit window: sends wait for room).", minimum=1)
    # liveness
    peer_timeout: float = _knob(
        "RLINF_PEER_TIMEOUT", "duration", 2.5,
        "Seconds of silence before a remote peer is declared lost, by the manager and by a "
        "worker while the manager is silent.")
    timeout: float | None = _knob(
        "RLINF_TIMEOUT", "duration", None,
        "Default timeout, in seconds, of every operation that takes `timeout=` when the "
        "caller passes none (sends, receives, collectives, channel calls, `group.join`): "
        "expiry raises `CommTimeoutError`, as an explicit timeout does, which wins over it.",
        shown="unset: wait forever")
    heartbeat_interval: float = _knob(
        "RLINF_HEARTBEAT_INTERVAL", "duration", 0.25,
        "Seconds between a worker's heartbeats to the manager.")
    # security
    tcp_stream: bool = _knob(
        "RLINF_TCP_STREAM", "bool", True,
        "Frame sets to other nodes (all but bulk payloads) go over a TCP stream link that the event loops "
        "write and read, sealed like bulk links, instead of ZeroMQ tcp:// (off: ZeroMQ carries them, as "
        "`RLINF_DISABLE_TRANSPORTS=tcp_stream` does; docs/benchmarks.md, P1x/P2x).")
    tcp_encryption: bool = _knob(
        "RLINF_TCP_ENCRYPTION", "bool", True,
        "TCP data links are encrypted (CURVE for ZeroMQ, AEGIS-256 for bulk and TCP stream links); "
        "off: authenticated only.")
    # where this process is
    host: str | None = _knob(
        "RLINF_HOST", "str", None,
        "The IP a worker binds its TCP data socket on and advertises to peers (unset: "
        "loopback when the manager is on loopback, else all interfaces, advertising an "
        "address on the manager's subnet).")
    node_id: str | None = _knob(
        "RLINF_NODE_ID", "str", None,
        "Which node this process is on, equal ids meaning the same node (unset: derived from "
        "the host name, machine id, boot id and a token file in /dev/shm, so processes that "
        "do not share /dev/shm never share an id).")
    # observing
    trace: str | None = _knob(
        "RLINF_TRACE", "str", None,
        "Directory where every rlinf process writes a timeline of its sends, receives, collectives "
        "and channel puts and gets, one Chrome trace (Perfetto) JSON file each; `rlinf trace merge` "
        "joins them (see `docs/troubleshooting.md`).",
        shown="unset: no trace")
    # launcher to child
    address: str | None = _knob(
        "RLINF_ADDRESS", "str", None,
        "This worker's address `<group>:<rank>`, unique in the cluster (the default of "
        "`rlinf.connect`).")
    manager: str | None = _knob(
        "RLINF_MANAGER", "str", None,
        "The endpoint of the manager to join, such as `tcp://10.0.0.1:5555`.")
    token: str | None = _knob(
        "RLINF_TOKEN", "str", None,
        "The cluster token every connection is authenticated with (keep it secret).",
        secret=True)

    def __post_init__(self) -> None:
        for knob in knobs():
            value = getattr(self, knob.name)
            checked = knob.check(value)
            if checked is not value:
                object.__setattr__(self, knob.name, checked)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse every knob from ``environ``.

        Args:
            environ: the variables to read; ``os.environ`` when ``None``. Only the
                ``RLINF_*`` names of :func:`knobs` are read; others are ignored.

        Returns:
            The settings; a variable that is unset, empty or blank takes its default.

        Raises:
            ValueError: a variable's value is not valid for its kind; the message names
                the variable and the value.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for knob in knobs():
            raw = env.get(knob.env)
            if raw is not None and raw.strip():
                values[knob.name] = knob.parse(raw)
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (field names to values), checked like the original.

        Raises:
            TypeError: an unknown field, or a value of the wrong type.
            ValueError: a value out of range.
        """
        return dataclasses.replace(self, **changes)


def knobs() -> tuple[Knob, ...]:
    """The :class:`Knob` of every :class:`Settings` field, in field order."""
    return _KNOBS


_KNOBS: tuple[Knob, ...] = tuple(dataclasses.replace(f.metadata["knob"], name=f.name)
                                 for f in dataclasses.fields(Settings))


#: The settings when no variable is set: the defaults of the code that takes these values
#: as arguments (one source for each default).
DEFAULTS: Settings = Settings()


# --------------------------------------------------------------------------- other launchers


def _text(env: Mapping[str, str], name: str) -> str | None:
    """``name`` in ``env`` without the blanks around it; ``None`` when unset or blank."""
    raw = env.get(name)
    if raw is None:
        return None
    return raw.strip() or None


def _whole(env: Mapping[str, str], name: str) -> int | None:
    raw = _text(env, name)
    return None if raw is None else parse_int(name, raw)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """What torchrun (and Slurm) tell a process, for ``rlinf.init`` (``rlinf.sync``).

    Not ``RLINF_*`` knobs: other launchers set these, and only the torch.distributed-style
    facade reads them. As for :class:`Settings`, an empty or blank variable counts as
    unset, and a bad number raises ``ValueError`` naming the variable.

    Attributes:
        rank: ``RANK``.
        world_size: ``WORLD_SIZE``.
        master_addr: ``MASTER_ADDR``, the host of rank 0.
        master_port: ``MASTER_PORT``.
        agent_store: ``TORCHELASTIC_USE_AGENT_STORE`` is ``"True"``: torchrun's agent
            already serves its store on ``MASTER_PORT``.
        run_id: ``TORCHELASTIC_RUN_ID``.
        restart_count: ``TORCHELASTIC_RESTART_COUNT`` (``"0"`` when unset).
        slurm_job_id: ``SLURM_JOB_ID``.
    """

    rank: int | None = None
    world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    run_id: str | None = None
    restart_count: str = "0"
    slurm_job_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Read the variables from ``environ`` (``os.environ`` when ``None``).

        Raises:
            ValueError: ``RANK``, ``WORLD_SIZE`` or ``MASTER_PORT`` is not a whole number.
        """
        env = os.environ if environ is None else environ
        return cls(rank=_whole(env, "RANK"), world_size=_whole(env, "WORLD_SIZE"),
                   master_addr=_text(env, "MASTER_ADDR"), master_port=_whole(env, "MASTER_PORT"),
                   agent_store=_text(env, "TORCHELASTIC_USE_AGENT_STORE") == "True",
                   run_id=_text(env, "TORCHELASTIC_RUN_ID"),
                   restart_count=_text(env, "TORCHELASTIC_RESTART_COUNT") or "0",
                   slurm_job_id=_text(env, "SLURM_JOB_ID"))


def visible_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (``None``: unset; blank stays blank, as CUDA reads
    it: no device). The CUDA runtime applies it itself; rlinf only looks whether it hides
    every GPU, to skip importing torch (:func:`rlinf.control.devices.discover_devices`)."""
    env = os.environ if environ is None else environ
    return env.get("CUDA_VISIBLE_DEVICES")
