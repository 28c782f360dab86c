"""How one communicator's GPU buffers travel: the routing table's GPU rows, applied.

A message's GPU buffers go by CUDA IPC (:mod:`rlinf.transports.cuda.ipc`) to a peer of
this node that advertises it and sees their GPU, else they are staged: copied to host
memory and sent as CPU buffers, which the receiver's codec moves to its current device.
:class:`GpuPaths` makes that choice per message, keeps the CUDA IPC session (made on the
first GPU message sent or received, so a process that never touches a GPU never
initialises CUDA) and follows each peer's incarnation, so that a restarted peer starts
from fresh slots.

Buffer lifetime: see :mod:`rlinf.transports.cuda.ipc`; staged buffers are host copies
the caller does not see.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from ..control import client as control, devices
from . import routing, wire
from ..codec import is_device_buffer
from ..errors import ProtocolError
from ..info import WorkerInfo
from ..transports.cuda import CudaIpcSession, CudaPeer, ipc as cuda_ipc

__all__ = ["GpuPaths"]

log = logging.getLogger("rlinf.core.communicator")


class GpuPaths:
    """The GPU side of one communicator (its loop thread only).

    Args:
        address: the communicator's address (for messages).
        roster: the communicator's peers by address (read, never changed here).
        config: its routing config.
        new_session: makes the CUDA IPC session (called once, when first needed).
    """

    def __init__(self, address: str, roster: Mapping[str, WorkerInfo], config: routing.RoutingConfig,
                 new_session: Callable[[], CudaIpcSession]) -> None:
        self.me: WorkerInfo | None = None          # set once the communicator registered
        self.session: CudaIpcSession | None = None
        self._address = address
        self._roster = roster
        self._config = config
        self._new_session = new_session
        self._routes: dict[str, str] = {}          # peer -> CUDA_IPC, or why not
        self._peers: dict[str, WorkerInfo] = {}    # peer -> the incarnation our CUDA IPC state is for
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"<GpuPaths {self._address} session={self.session!r}>"

    def _session(self) -> CudaIpcSession:
        if self.session is None:
            self.session = self._new_session()
        return self.session

    # -- sending
    def prepare(self, buffers: list, dst: str) -> tuple[list, list | None]:
        """Route a message's GPU buffers to ``dst``: ``(host buffers, GPU descriptor)``
        when they go by CUDA IPC (the device buffers are copied into a slot and left out
        of the list), else ``(buffers with the GPU ones staged, None)``."""
        route = self._routes.get(dst)
        if route is None:
            info = self._roster.get(dst)
            if info is None:     # not known yet: nothing says CUDA IPC reaches it
                return self._staged(buffers, dst, "its GPUs are not known yet"), None
            chosen = routing.select_transport(self.me, info, devices.BufferInfo("cuda:0", 1), config=self._config)
            route = self._routes[dst] = chosen.transport if chosen.transport == routing.CUDA_IPC else chosen.reason
        if route != routing.CUDA_IPC:
            return self._staged(buffers, dst, route), None
        info = self._roster.get(dst)
        if info is not None and info is not self._peers.get(dst):
            self._follow(dst, info)
        places = [i for i, b in enumerate(buffers) if type(b) is not memoryview and is_device_buffer(b)]
        peer_device = self._peer_device(dst, cuda_ipc.device_of(buffers[places[0]]))
        if peer_device is None:
            return self._staged(buffers, dst, "it does not see the GPU they are on"), None
        gpu = self._session().export(buffers, places, dst, peer_device)
        if gpu is None:
            why = "its buffers span several devices, or it holds the CUDA IPC cap of our slots"
            return self._staged(buffers, dst, why), None
        taken = set(places)
        return [b for i, b in enumerate(buffers) if i not in taken], gpu

    def discard(self, gpu: list) -> None:
        """The message carrying ``gpu`` was dropped unsent."""
        self.session.sender.discard(gpu)

    def _peer_device(self, dst: str, index: int) -> int | None:
        """Our GPU ``index`` in ``dst``'s numbering (processes may see different sets of
        GPUs, in different orders), found by uuid; None when ``dst`` does not see it."""
        info = self._roster.get(dst)
        ours = next((d for d in self.me.devices if d.index == index), None)
        if info is None or ours is None:
            return None
        if ours.uuid:
            return next((d.index for d in info.devices if d.uuid == ours.uuid), None)
        same = [d.uuid for d in self.me.devices] == [d.uuid for d in info.devices]
        return index if same else None     # no uuids: only the same visible set can be trusted

    def _staged(self, buffers: list, dst: str, why: str) -> list:
        """The staged path: GPU buffers copied to host memory, sent as CPU buffers. It
        waits for the work queued on the current stream (``Tensor.cpu()`` synchronises
        it). Warns once per peer, with the reason."""
        if dst not in self._warned:
            self._warned.add(dst)
            log.warning("rlinf %s: GPU buffers to %s are staged through host memory (%s)", self._address, dst, why)
        staged = []
        for b in buffers:
            if type(b) is memoryview or not is_device_buffer(b):
                staged.append(b)
            elif hasattr(b, "cpu"):          # torch
                staged.append(memoryview(b.cpu().numpy()).cast("B"))
            else:                            # cupy
                staged.append(memoryview(b.get()).cast("B"))
        return staged

    # -- receiving
    def open(self, src: str, incarnation: str, gpu: wire.GpuRef) -> tuple[list, Callable[[], None]]:
        """An entry's device buffers (see :meth:`CudaIpcReader.open`).

        Raises:
            ProtocolError: CUDA IPC is off here or cannot start, or the slot is unusable.
        """
        if routing.CUDA_IPC not in self.me.transports:
            raise ProtocolError("CUDA IPC is not enabled in this process")
        try:
            session = self._session()
        except Exception as exc:      # CUDA cannot start here after all
            raise ProtocolError(f"CUDA IPC cannot start in this process: {exc!r}") from exc
        return session.reader.open(src, incarnation, gpu)

    def refuse(self, src: str, incarnation: str, gpu: wire.GpuRef) -> None:
        """Give back the slot of an entry whose other buffers could not be read."""
        if self.session is not None or gpu.share is not None:
            try:
                self._session().reader.refuse(src, incarnation, gpu)
            except Exception as exc:     # nothing to give back where CUDA cannot start
                log.warning("rlinf %s: CUDA IPC slot of %s not given back: %r", self._address, src, exc)

    def on_notice(self, src: str, items: Any) -> None:
        """A SYSTEM ``"cuda"`` notice (see :meth:`CudaIpcSession.on_notice`)."""
        if self.session is not None:
            self.session.on_notice(src, items)

    # -- membership
    def changed(self, address: str) -> None:
        """``address``'s membership changed: choose its route again."""
        self._routes.pop(address, None)

    def joined(self, address: str, info: WorkerInfo) -> None:
        """``info`` joined: the state of earlier incarnations of its address goes."""
        if self.session is not None:
            self.session.reader.forget_others(address, info.incarnation)
            if address in self._peers:
                self._follow(address, info)

    def gone(self, address: str, incarnation: str, *, left: bool, process_gone: bool) -> None:
        """``address`` (``incarnation``) left or was lost. Its CUDA IPC state goes when it
        left or its process is gone; a peer only taken for lost may come back with it."""
        self._routes.pop(address, None)
        if self.session is not None and (left or process_gone):
            self.session.peer_gone(address, incarnation, process_gone=process_gone)
            self._peers.pop(address, None)

    def _follow(self, address: str, info: WorkerInfo) -> None:
        """``address`` is ``info`` now: when that is another incarnation than the one our
        CUDA IPC state is for, forget that state (it restarted; the old one may not have
        been declared gone here, e.g. while it still ran)."""
        old = self._peers.get(address)
        if old is not None and old.incarnation != info.incarnation and self.session is not None:
            self.session.peer_gone(address, old.incarnation, process_gone=control.process_gone_here(old))
        self._peers[address] = info
