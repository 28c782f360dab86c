"""Node identity, device discovery and buffer descriptors.

Everything here is computed on call: importing this module opens no file, touches no
socket and never imports torch or cupy. :func:`discover_devices` imports them lazily and
only asks CUDA for device properties once ``is_available()`` says a GPU exists, so it is
cheap and safe on CPU-only machines.

The results feed :class:`rlinf.info.WorkerInfo` (``node_id``, ``devices``, addresses)
and :func:`rlinf.routing.select_transport` (:class:`BufferInfo`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
import sys
from dataclasses import dataclass
from typing import Any

from ..info import DeviceInfo
from ..transports import leftovers
from ..transports.leftovers import SHM_DIR

__all__ = [
    "BufferInfo",
    "NODE_TOKEN",
    "node_id",
    "node_token",
    "ipc_visible",
    "discover_devices",
    "host_addresses",
    "preferred_address",
    "preferred_peer_address",
    "describe_buffer",
    "data_host",
]

_log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of one interface


# --------------------------------------------------------------------------- identity


def node_id(override: str | None = None) -> str:
    """Return the identity of this node; equal ids mean "same node" to the router.

    ``override`` wins when given and not blank (the communicator passes
    ``RLINF_NODE_ID``, read when it is constructed, so a launcher can set it late).
    Otherwise the id is ``"<hostname>-<hash>"`` where the hash covers the machine id,
    the kernel boot id and the **node token**: random bytes kept in
    ``/dev/shm/rlinf-node-<uid>`` (:data:`NODE_TOKEN`), made by the first process of
    the user that asks (:func:`node_token`).

    Why a file in ``/dev/shm``: "same node" tells the router that the two processes can
    reach each other's shared-memory segments (``/dev/shm``) and sockets. The hostname,
    machine id and boot id do not say that: containers with host networking share the
    hostname (and the kernel, so the boot id, often the machine id too) but each has its
    own ``/dev/shm`` and ``/tmp``. Reading one file is the direct test: two processes see
    the same token exactly when they see the same ``/dev/shm``, whatever their mount or
    PID namespaces (a ``/dev/shm`` bind-mounted into a container counts as shared, as
    it is; the mount namespace or the mount's device number would get both cases
    wrong). The file is per user because segments are made ``0600``: processes of two
    users cannot open each other's. Processes that share ``/dev/shm`` but not ``/tmp``
    (systemd's ``PrivateTmp``) keep one id and shared memory; their socket links fall
    back to TCP (:func:`ipc_visible`).

    Where there is no usable token (no writable ``/dev/shm``: then there is no shared
    memory either), the user and the device of the ``/dev/shm`` (or ``/``) file system
    stand in for it (one tmpfs mount, one device number, on one kernel).

    Returns:
        A non-empty string, stable for the life of the node's ``/dev/shm``.
    """
    if override is not None and override.strip():
        return override.strip()
    return _host_identity()


#: The node token's file in ``/dev/shm`` (``{uid}``: the user's id). Never removed by
#: rlinf's clean-up: its names are ``rlinf-<pid>-...``.
NODE_TOKEN = "rlinf-node-{uid}"
_TOKEN_BYTES = 16


@functools.cache
def _host_identity() -> str:
    parts = [_read_first_line(p) for p in ("/etc/machine-id", "/var/lib/dbus/machine-id")]
    parts.append(_read_first_line("/proc/sys/kernel/random/boot_id"))
    token = node_token()
    parts.append(f"token:{token}" if token is not None else f"mount:{os.getuid()}:{_mount_identity()}")
    hostname = socket.gethostname() or "localhost"
    digest = hashlib.sha1("|".join(parts).encode(), usedforsecurity=False).hexdigest()[:12]
    return f"{hostname}-{digest}"


def node_token(directory: str = SHM_DIR) -> str | None:
    """The node token of this user in ``directory`` (see :func:`node_id`), made if missing.

    Race-free for any number of processes starting at once: the token is written to a
    file of this process's own and then hard-linked to its name, which fails if another
    process got there first (then its token is read): the name never shows a partly
    written token. The file is ``0644`` (the token is no secret: it only names a
    ``/dev/shm``) and is accepted only when it is a regular file of this user holding a
    token, so another user cannot choose it.

    Returns:
        32 hex digits, or None where ``directory`` cannot hold one (missing, read-only)
        or the name is taken by something else (logged).
    """
    path = os.path.join(directory, NODE_TOKEN.format(uid=os.getuid()))
    for _ in range(3):
        token = _read_token(path)
        if token is not None:
            return token or None
        try:
            token = _make_token(directory, path)
        except OSError as exc:
            _log.debug("rlinf: no node token in %s: %s", directory, exc)
            return None
        if token is not None:
            return token
    return None


def _read_token(path: str) -> str | None:
    """The token at ``path``; None when there is no file; "" when the name is unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:      # a symlink (ELOOP), no permission
        _log.warning("rlinf: cannot read the node token %s (%s); node identity falls back to the /dev/shm "
                     "mount", path, exc)
        return ""
    try:
        st = os.fstat(fd)
        data = os.read(fd, 2 * _TOKEN_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    token = data.decode("ascii", "replace").strip()
    if st.st_uid != os.getuid() or len(token) != 2 * _TOKEN_BYTES or any(c not in "0123456789abcdef" for c in token):
        _log.warning("rlinf: %s is not a node token of this user; node identity falls back to the /dev/shm "
                     "mount", path)
        return ""
    return token


def _make_token(directory: str, path: str) -> str | None:
    """Publish a new token at ``path``; None when another process published one first."""
    token = secrets.token_hex(_TOKEN_BYTES)
    # named as this process's leftovers: removed if it dies before unlinking it
    draft = os.path.join(directory, f"{leftovers.prefix()}node-{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        try:
            os.fchmod(fd, 0o644)       # whatever the umask
            os.write(fd, token.encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(draft, path)
        except FileExistsError:
            return None
        return token
    finally:
        os.unlink(draft)


def _mount_identity() -> str:
    """The device of the ``/dev/shm`` (else ``/``) file system: unique per mount on one kernel."""
    for path in (SHM_DIR, "/"):
        try:
            return f"{path}:{os.stat(path).st_dev}"
        except OSError:
            continue
    return ""


def ipc_visible(endpoint: str) -> bool:
    """Whether a ZeroMQ ``ipc://`` endpoint's socket file exists in this process's view
    of the file system (True for any other endpoint). A peer with this node's id whose
    ``/tmp`` is not ours (another mount namespace) advertises one we cannot see: ZeroMQ
    would wait for it forever, so the caller takes the peer's ``tcp://`` endpoint."""
    scheme, sep, path = endpoint.partition("://")
    if scheme != "ipc" or not sep or path.startswith("@"):    # "@": abstract, no file
        return True
    return os.path.exists(path)


def _read_first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------- devices


def discover_devices(*, no_torch: bool = False, visible: str | None = None) -> tuple[DeviceInfo, ...]:
    """List the CUDA devices this process can use.

    Tries torch first (skipped with ``no_torch``, ``RLINF_NO_TORCH``, or when torch is not
    installed), then cupy. Indices are the process's logical ones, so
    ``CUDA_VISIBLE_DEVICES`` is honoured (the CUDA runtime reads it). Neither library is
    imported when ``visible`` (that variable's value, which the caller reads with
    :func:`rlinf.config.visible_devices`) hides every GPU (``""`` or ``"-1"``) or, on
    Linux, when no NVIDIA device node exists — so on a CPU-only machine this costs a few
    ``stat`` calls. Device properties are read only
    after ``torch.cuda.is_available()`` (which creates no CUDA context) reports a GPU,
    so a CPU-only machine never initialises CUDA. Where a GPU exists, reading its
    properties does initialise the CUDA runtime in this process (torch's lazy init), so
    call this in the worker itself, not in a parent that later forks CUDA users.

    Args:
        no_torch: do not try torch (``RLINF_NO_TORCH``).
        visible: ``CUDA_VISIBLE_DEVICES`` as set, ``None`` when unset.

    Returns:
        One :class:`~rlinf.info.DeviceInfo` per visible GPU, in index order; ``()`` when
        there is none or no library can see one.
    """
    if visible is not None and visible.strip() in ("", "-1"):
        return ()
    if not _gpu_may_exist():
        return ()
    if not no_torch and importlib.util.find_spec("torch") is not None:
        devices = _torch_devices()
        if devices is not None:
            return devices
    if importlib.util.find_spec("cupy") is not None:
        return _cupy_devices()
    return ()


# Any of these exists wherever the NVIDIA driver can reach a GPU (/dev/dxg: WSL2).
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")


def _gpu_may_exist() -> bool:
    """Cheap pre-check so CPU-only Linux hosts never pay for importing torch."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in _GPU_NODES)


def _torch_devices() -> tuple[DeviceInfo, ...] | None:
    """Devices via torch; ``None`` when torch is unusable, so cupy gets a try."""
    try:
        import torch
    except (ImportError, OSError) as exc:  # a broken install (missing .so) is OSError
        _log.debug("torch not usable for device discovery: %s", exc)
        return None
    try:
        if not torch.cuda.is_available():
            return ()
        devices = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            uuid = str(getattr(props, "uuid", "") or "")
            if uuid and not uuid.startswith("GPU-"):  # nvidia-smi's spelling, as cupy's path gives
                uuid = f"GPU-{uuid}"
            devices.append(DeviceInfo(kind="cuda", index=index, uuid=uuid, total_memory=int(props.total_memory)))
        return tuple(devices)
    except (RuntimeError, AssertionError) as exc:  # torch reports driver trouble both ways
        _log.warning("torch sees a GPU but could not read its properties: %s", exc)
        return None


def _cupy_devices() -> tuple[DeviceInfo, ...]:
    try:
        import cupy
    except (ImportError, OSError) as exc:
        _log.debug("cupy not usable for device discovery: %s", exc)
        return ()
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
        devices = []
        for index in range(count):
            props = runtime.getDeviceProperties(index)
            uuid = props.get("uuid", b"")
            if isinstance(uuid, bytes):
                uuid = _format_uuid(uuid)
            devices.append(
                DeviceInfo(kind="cuda", index=index, uuid=str(uuid), total_memory=int(props.get("totalGlobalMem", 0)))
            )
        return tuple(devices)
    except runtime.CUDARuntimeError as exc:  # no driver / no device
        _log.debug("cupy found no usable GPU: %s", exc)
        return ()


def _format_uuid(raw: bytes) -> str:
    if len(raw) != 16:
        return raw.hex()
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# --------------------------------------------------------------------------- addresses


def host_addresses() -> list[str]:
    """Return this host's IPv4 addresses, most useful first.

    Sources, all without a subprocess: the address of the default route (a UDP socket
    ``connect`` sends no packet), every interface's address (Linux ``SIOCGIFADDR``),
    and what the hostname resolves to. Loopback addresses come last, and ``127.0.0.1``
    is always present.

    Returns:
        Distinct dotted-quad strings; the first non-loopback one, if any, is the
        default-route interface's.
    """
    found: list[str] = []
    for source in (_default_route_address, _interface_addresses, _hostname_addresses):
        found.extend(source())
    seen: set[str] = set()
    routable: list[str] = []
    loopback: list[str] = []
    for addr in found + [_LOOPBACK]:
        ip = _parse_ipv4(addr)
        if ip is None or ip.is_unspecified or addr in seen:
            continue
        seen.add(addr)
        (loopback if ip.is_loopback else routable).append(addr)
    loopback.sort(key=lambda a: a != _LOOPBACK)  # 127.0.0.1 first among loopbacks
    return routable + loopback


def _default_route_address() -> list[str]:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1; a UDP connect only picks a route
            return [s.getsockname()[0]]
    except OSError:
        return []


def _interface_addresses() -> list[str]:
    if not hasattr(socket, "if_nameindex"):
        return []
    try:
        import fcntl
    except ImportError:  # not a POSIX platform
        return []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address, or not Linux
                continue
            out.append(socket.inet_ntoa(packed[20:24]))
    return out


def _hostname_addresses() -> list[str]:
    try:
        return socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:  # unresolvable hostname (gaierror/herror are OSError)
        return []


def _parse_ipv4(addr: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(addr)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        return None


def _best_match(ours: list[str], theirs: list[str], min_prefix: int) -> tuple[str, str] | None:
    """The (ours, theirs) pair with the longest common prefix; ties go to the earlier of ours."""
    if not 0 <= min_prefix <= 32:
        raise ValueError(f"min_prefix must be within 0..32, got {min_prefix}")
    mine = [(a, int(ip)) for a in ours if (ip := _parse_ipv4(a)) is not None and not ip.is_loopback]
    other = [(a, int(ip)) for a in theirs if (ip := _parse_ipv4(a)) is not None and not ip.is_loopback]
    best: tuple[str, str] | None = None
    best_len = min_prefix - 1
    for a, av in mine:
        for b, bv in other:
            common = 32 - (av ^ bv).bit_length()
            if common > best_len:  # strict, so earlier entries keep ties
                best, best_len = (a, b), common
    return best


def preferred_address(peer_addresses: list[str], local_addresses: list[str], *, min_prefix: int = 16) -> str | None:
    """Pick the local address on the peer's subnet (DESIGN §1 item 9).

    The score of a (local, peer) pair is the length of their common bit prefix, so a
    shared /24 beats a shared /16. Loopback and non-IPv4 entries are ignored on both
    sides: they are right only on the same node, which uses ``ipc://`` instead.

    Args:
        peer_addresses: the peer's IPv4 addresses (e.g. its registered ``host_addresses()``).
        local_addresses: ours, most preferred first; ties go to the earlier one.
        min_prefix: the fewest shared leading bits that count as "the same subnet".

    Returns:
        The best local address, or ``None`` when none shares ``min_prefix`` bits with
        any peer address — then the caller should let the OS route.

    Raises:
        ValueError: ``min_prefix`` is outside 0..32.
    """
    pair = _best_match(local_addresses, peer_addresses, min_prefix)
    return pair[0] if pair else None


def preferred_peer_address(
    peer_addresses: list[str], local_addresses: list[str], *, min_prefix: int = 16
) -> str | None:
    """Pick which of the peer's addresses to connect to: the one on a subnet of ours.

    Same scoring as :func:`preferred_address`, seen from the other side.

    Args:
        peer_addresses: the peer's IPv4 addresses, most preferred first.
        local_addresses: ours.
        min_prefix: the fewest shared leading bits that count as "the same subnet".

    Returns:
        The best peer address, or ``None`` when no pair shares ``min_prefix`` bits.

    Raises:
        ValueError: ``min_prefix`` is outside 0..32.
    """
    pair = _best_match(peer_addresses, local_addresses, min_prefix)
    return pair[0] if pair else None


# --------------------------------------------------------------------------- buffers


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """What the router needs to know about one buffer.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        nbytes: size of the buffer's data in bytes.
        shared: the memory is already in a shared segment (a torch tensor after
            ``share_memory_()``), so same-node peers can map it without a copy.
    """

    device: str
    nbytes: int
    shared: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {self.nbytes!r}")
        if self.device != "cpu":
            kind, sep, index = str(self.device).partition(":")
            if kind != "cuda" or not sep or not index.isdigit():
                raise ValueError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")

    @property
    def kind(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self.device.partition(":")[0]

    @property
    def index(self) -> int | None:
        """The CUDA device index, or ``None`` for a CPU buffer."""
        _, _, index = self.device.partition(":")
        return int(index) if index else None


def describe_buffer(buf: Any) -> BufferInfo:
    """Describe a buffer for routing without importing torch or cupy.

    Torch and cupy objects are recognised by ``type(buf).__module__`` and read through
    their attributes, so neither library is imported here. Anything else must be a
    numpy array or support the buffer protocol (bytes, bytearray, memoryview, mmap, ...).

    Args:
        buf: a numpy array, a buffer-protocol object, a torch tensor (CPU or CUDA) or a
            cupy array.

    Returns:
        A :class:`BufferInfo`. ``nbytes`` counts the elements' bytes (for a torch view,
        ``numel() * element_size()``, not the whole storage).

    Raises:
        TypeError: ``buf`` is none of the above, or a tensor on a device other than
            CPU or CUDA (move it with ``.cpu()`` first).
    """
    module = type(buf).__module__ or ""
    if module.startswith("torch") and hasattr(buf, "element_size"):
        return _describe_torch(buf)
    if module.startswith("cupy") and hasattr(buf, "device"):
        return BufferInfo(device=f"cuda:{int(buf.device.id)}", nbytes=int(buf.nbytes))
    if module.startswith("numpy") and hasattr(buf, "nbytes"):
        return BufferInfo(device="cpu", nbytes=int(buf.nbytes))
    try:
        with memoryview(buf) as view:
            return BufferInfo(device="cpu", nbytes=view.nbytes)
    except TypeError:
        raise TypeError(
            f"cannot describe a buffer of type {type(buf).__qualname__}: expected a numpy array, "
            "a torch tensor, a cupy array or an object supporting the buffer protocol"
        ) from None


def _describe_torch(t: Any) -> BufferInfo:
    nbytes = int(t.numel()) * int(t.element_size())
    kind = t.device.type
    if kind == "cuda":
        index = t.device.index if t.device.index is not None else t.get_device()
        return BufferInfo(device=f"cuda:{index}", nbytes=nbytes)
    if kind == "cpu":
        return BufferInfo(device="cpu", nbytes=nbytes, shared=bool(t.is_shared()))
    raise TypeError(f"rlinf moves CPU and CUDA tensors only; this one is on {t.device} (call .cpu() first)")


def data_host(manager: str, host: str | None = None) -> tuple[str, str]:
    """``(bind host, advertised host)`` for a worker's data TCP listener: ``host``
    (``RLINF_HOST``) when given; loopback when the manager is local; else every
    interface, advertising the address on the manager's subnet."""
    if host:
        return host, host
    manager_host = manager.split("://", 1)[-1].rsplit(":", 1)[0]
    if manager.startswith("ipc://") or manager_host.startswith("127.") or manager_host in ("localhost", "[::1]"):
        return "127.0.0.1", "127.0.0.1"
    local = preferred_address([manager_host], host_addresses()) or socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", local
