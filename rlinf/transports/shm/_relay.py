"""Forwarding received shared memory by reference (relaying).

A process that received buffers as views of another process's slot (say a channel
server holding a producer's item) and sends them on to a third process on the same
node (the consumer) need not copy them into a slot of its own: it sends a reference to
the place in the original slot, and the receiver maps that. The data is written once,
by its producer; only descriptors pass through the relaying process.

How it stays safe:

* **Lifetime.** The relaying process keeps its own views (a *hold*) until the receiver
  releases the relayed slot; only then can its own release reach the owner, so the
  owner never rewrites a slot that anyone still reads.
* **Owner death.** The relaying process names the owner's segment file by a hard link
  of its own (``rlinf-<its pid>-...``, like its pool's segments), so the file outlives
  the owner's sweep until nobody needs it; the link goes once no hold needs it and the
  owner's name is gone, when the receiver is gone, or when the relaying process closes.
* **Isolation.** The receiver maps a relayed slot copy-on-write (``MAP_PRIVATE``): its
  writes stay its own, so an item that goes back to the queue (its consumer died) is
  still the producer's bytes.
* Only slots mapped shared (one reader) are relayed; a copy-on-write view may hold this
  process's own writes, which the file does not have. The same slot is never relayed
  twice to the same receiver at once (its releases could not be told apart).
* **Reuse after send.** ``send`` returns at once, and the sender may then reuse (write)
  its buffers. So before a slot is relayed, this process's mapping of it is made
  copy-on-write in place (``ShmReader.privatize``): its later writes stay its own, and
  the receiver reads the bytes as they were when sent. (The slot is then relayed once.)
  A process that never writes into what it forwards (the channel process:
  ``Communicator(forwards_unchanged=True)``) skips this: the remap costs ~6 ms per
  64 MiB once the mapping's pages are present.
* **A receiver that leaves alive.** A receiver that closed its communicator but still
  runs may keep its views; the holds for it are then kept (the owner's slot stays
  busy, never rewritten) until this process closes. Those of a receiver whose process
  is gone are dropped.

On the wire, a relayed buffer's layout item is ``[r, offset, nbytes]``: the place in the
entry's relay ``r``, ``[segment, slot_offset, slot_size, relay_id]``
(see :func:`rlinf.transports.descriptors.unpack_relays`). The receiver's release names ``[segment, relay_id]``.

The same plan sends torch tensors that already live in shared memory by handle (see
:mod:`._fdshare`): their relay is ``[fd, dev, ino, size, hold_id]``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import numpy as np

from ...util.bounded import Doubling
from ._fdshare import FD_RELEASE, FdShares, shared_storages

__all__ = ["Relay"]

log = logging.getLogger("rlinf.transports.shm")


class _Link:
    __slots__ = ("name", "path", "original", "holds", "mapped_by")

    def __init__(self, name: str, path: str, original: str) -> None:
        self.name, self.path, self.original = name, path, original
        self.holds = 0
        self.mapped_by: set[str] = set()   # receivers that mapped it (they keep the mapping)


class Relay:
    """The relaying side: which buffers can go by reference, and the holds.

    Args:
        locate: ``locate(address, nbytes) -> (SlotRef, offset) | None`` (the reader's).
        names: this process's pool: ``link(segment) -> (name, path)`` makes a name of
            ours for a segment, ``unlink_link(path)`` removes it (see ``ShmPool``).
        live: ``live() -> bool``: whether ``locate`` could find anything (a shortcut).
        fds: where torch storages already in shared memory are held while they travel
            by handle; None sends them as copies.
        privatize: ``privatize(segment, path) -> bool`` (the reader's): make our mapping
            of a segment copy-on-write before relaying it; None: relay as mapped.
    """

    def __init__(self, locate: Callable[[int, int], Any], names: Any, *,
                 live: Callable[[], bool] | None = None, fds: FdShares | None = None,
                 privatize: Callable[[str, str], bool] | None = None) -> None:
        self._locate = locate
        self._privatize = privatize
        self._kept: list = []      # holds for receivers that left alive (see the module docstring)
        self._names = names
        self._live = live
        self.fds = fds
        self._links: dict[str, _Link] = {}                       # owner's segment -> our link
        self._looked = Doubling()                                 # when to sweep idle links again
        self._holds: dict[tuple[str, int], tuple[_Link, tuple[str, int], list]] = {}
        self._inflight: set[tuple[str, str, int]] = set()       # (receiver, segment, slot offset)
        self._unconfirmed: set[tuple[str, str]] = set()
        self._ids = 0

    def __repr__(self) -> str:
        return f"<Relay links={len(self._links)} holds={len(self._holds)}>"

    @property
    def holds(self) -> int:
        return len(self._holds)

    def plan(self, buffers: Sequence[Any], sizes: Sequence[int], dst: str) -> tuple[dict[int, list], list] | None:
        """Which of ``buffers`` go to ``dst`` by reference.

        Returns:
            ``(places, relays)``: ``places[i] = [r, offset, nbytes]`` for each relayed
            buffer ``i`` and the entry's ``relays`` list; None when none can be relayed.
            The holds are taken: the caller must send the entry, or :meth:`cancel` it.
        """
        shared = shared_storages(buffers) if self.fds is not None else ()
        live = self._live is None or self._live()
        if not shared and not live:
            return None
        places: dict[int, list] = {}
        relays: list[list] = []
        index: dict[Any, int] = {}
        for i, (b, n) in enumerate(zip(buffers, sizes)):
            if not n:
                continue
            address = np.frombuffer(b, np.uint8, 0).ctypes.data
            if shared and self._by_handle(i, address, n, shared, dst, places, relays, index):
                continue
            found = self._locate(address, n) if live else None
            if found is None:
                continue
            slot, offset = found
            key = (slot.segment, slot.offset)
            r = index.get(key)
            if r is None:
                if (dst, *key) in self._inflight:
                    continue
                link = self._link(slot.segment)
                if link is None:
                    continue
                if self._privatize is not None and not self._privatize(slot.segment, link.path):
                    self._tidy(link)      # cannot guard it from our writes: copy instead
                    continue
                r = index[key] = len(relays)
                self._ids += 1
                relays.append([link.name, slot.offset, slot.size, self._ids])
                link.holds += 1
                self._inflight.add((dst, *key))
                if dst not in link.mapped_by:   # a receiver says so once, when it first maps it
                    self._unconfirmed.add((dst, link.name))
                self._holds[(dst, self._ids)] = (link, key, [])
            self._holds[(dst, relays[r][3])][2].append(b)
            places[i] = [r, offset, n]
        return (places, relays) if relays else None

    def _by_handle(self, i: int, address: int, n: int, shared: list, dst: str, places: dict,
                   relays: list, index: dict) -> bool:
        """Plan buffer ``i`` by handle if it lies in one of the ``shared`` storages."""
        for storage in shared:
            if storage.start <= address and address + n <= storage.end:
                break
        else:
            return False
        r = index.get(storage)
        if r is None:
            try:
                ref = self.fds.reference(storage, dst)
            except OSError as exc:   # cannot describe it: copy instead
                log.debug("rlinf: shared tensor sent as a copy: %s", exc)
                return False
            r = index[storage] = len(relays)
            relays.append(ref)
        places[i] = [r, address - storage.start, n]
        return True

    def _link(self, segment: str) -> _Link | None:
        link = self._links.get(segment)
        if link is None:
            self._tidy_idle()
            try:
                name, path = self._names.link(segment)
            except OSError as exc:   # the owner's name is gone already: send a copy instead
                log.debug("rlinf: cannot relay %s: %s", segment, exc)
                return None
            link = self._links[segment] = _Link(name, path, os.path.join(os.path.dirname(path), segment))
        return link

    def cancel(self, dst: str, relays: list) -> None:
        """The entry planned for ``dst`` was not sent: drop its holds."""
        for relay in relays:
            if len(relay) == 5:
                self.fds.release(dst, FD_RELEASE, relay[4])
            else:
                self.release(dst, relay[0], relay[3])

    def release(self, reader: str, segment: Any, relay_id: Any) -> bool:
        """``reader`` released relay ``relay_id``; False if it matches no hold of ours."""
        if segment == FD_RELEASE:
            return self.fds is not None and self.fds.release(reader, segment, relay_id)
        held = self._holds.pop((reader, relay_id), None) if type(relay_id) is int else None
        if held is None or held[0].name != segment:
            if held is not None:   # not its relay: put it back
                self._holds[(reader, relay_id)] = held
            return False
        link, key, _views = held   # the views go now: our own release may follow
        self._inflight.discard((reader, *key))
        link.holds -= 1
        self._tidy(link)
        return True

    def confirm(self, reader: str, segment: Any) -> None:
        """``reader`` mapped link ``segment`` (it no longer needs the file)."""
        self._unconfirmed.discard((reader, segment))
        for link in self._links.values():
            if link.name == segment:
                link.mapped_by.add(reader)
                break

    def unconfirmed(self) -> list[str]:
        """Receivers still to map a relayed file (what closing waits for)."""
        held = {(dst, link.name) for (dst, _), (link, _, _) in self._holds.items()}
        return sorted({dst for dst, name in self._unconfirmed if (dst, name) in held})

    def reader_gone(self, reader: str, *, alive: bool = False) -> None:
        """``reader`` left or died: drop what we held for it, or, when its process may
        still run (``alive``: it may keep views of what we relayed), keep the views until
        we close, so the owner never rewrites those slots."""
        if self.fds is not None:
            self.fds.reader_gone(reader)
        for dst, relay_id in [k for k in self._holds if k[0] == reader]:
            link, key, views = self._holds.pop((dst, relay_id))
            self._inflight.discard((dst, *key))
            if alive:
                self._kept.append(views)
                continue
            link.holds -= 1
        self._unconfirmed = {u for u in self._unconfirmed if u[0] != reader}
        for link in list(self._links.values()):
            self._tidy(link)

    def _tidy_idle(self) -> None:
        """Unlink the idle links whose owner dropped its segment since (it does so after
        our release, so :meth:`_tidy` at that release found its name still there). Done
        when a new link is made, once the links have doubled since the last time: idle
        links stay under the live ones, at O(1) checks per link."""
        if not self._looked.due(len(self._links)):
            return
        for link in list(self._links.values()):
            self._tidy(link)
        self._looked.looked(len(self._links))

    def _tidy(self, link: _Link) -> None:
        """Unlink our name once nothing is held through it and the owner's name is gone
        (while the owner's name exists, keeping ours costs nothing: same file)."""
        if link.holds == 0 and not os.path.exists(link.original):
            self._unlink(link)

    def _unlink(self, link: _Link) -> None:
        self._links.pop(os.path.basename(link.original), None)
        self._names.unlink_link(link.path)

    def close(self) -> None:
        """Drop every hold and unlink every link (mapped views stay valid). Idempotent."""
        if self.fds is not None:
            self.fds.close()
        self._holds.clear()
        self._kept.clear()
        self._inflight.clear()
        self._unconfirmed.clear()
        for link in list(self._links.values()):
            self._unlink(link)

