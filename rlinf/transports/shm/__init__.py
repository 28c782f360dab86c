"""Same-node shared memory: large CPU buffers cross with one copy, as pooled slots.

Design (see ``docs/transports.md`` for the whole picture):

* **Pool** (:class:`ShmPool`, the sender's side). Each process owns files in
  ``/dev/shm`` named ``rlinf-<pid>-<token>-<n>``, one *slot* per file, in size classes
  (eighth-of-a-power-of-two steps, >= 64 KiB). A file is created on demand, reserved
  with ``posix_fallocate`` (a full ``/dev/shm`` is an error here, never a SIGBUS later),
  mapped once and pre-faulted (``MADV_POPULATE_WRITE``, else a write per page), then
  reused: writing into pages already mapped runs ~10x faster than into fresh ones. The
  pool grows up to a cap (``RLINF_SHM_CAP``, default min(4 GiB, half of ``/dev/shm``)),
  evicting free slots first; past the cap :meth:`ShmPool.acquire` returns None and the
  caller sends inline (ZeroMQ) instead. Nothing fails for lack of shared memory.
* **Export.** The sender copies the message's buffers once into a free slot (placed by
  :func:`rlinf.transports.descriptors.slot_layout`) and sends only a small descriptor
  (:class:`rlinf.transports.descriptors.SlotRef`). The slot is *busy* until every reader released it.
* **Views** (:class:`ShmReader`, the receiver's side). The receiver maps each sender
  segment once (cached, pre-faulted) and gets writable zero-copy views. A weak
  reference to the object that exports them fires when the last view is
  garbage-collected (on whatever thread) and reports the release; the communicator
  batches releases into one SYSTEM message per sender, sent with the next message to
  that sender or within ``NOTICE_DELAY`` (:mod:`._shm_session`). A slot is
  never rewritten while a reader holds a view into it: only a release frees it, and
  one from a peer it was not sent to, or for an older use of the slot, is ignored.
* **Several readers** (multicast): the slot carries a reader count and is mapped
  copy-on-write (``MAP_PRIVATE``) by each reader, so one reader's writes stay its own.
  On release the reader drops the pages it wrote (its private copies, found through
  ``/proc/self/pagemap``; ``MADV_DONTNEED``) so the next use of the slot reads the new
  data; pages it only read stay mapped and already show it.
* **Cleanup.** Closing unlinks the pool's files (after the readers of in-flight slots
  confirmed they mapped them, bounded by a timeout). A reader that leaves or dies
  makes the sender retire the slots it held (unlinked, never reused: a departed
  process may still hold views). A sender that dies is swept (:func:`sweep`) by the
  survivors that notice and by the manager of its machine; ``atexit`` unlinks too.

Buffer lifetime: :meth:`ShmPool.fill` copies, so the caller may reuse its buffers once
it returns. Views from :meth:`ShmReader.open` stay valid (and the slot stays busy) for
as long as any of them, or any array decoded over them, is referenced.

:class:`ShmTransport` packages the same pieces behind the :mod:`.base` contract (a
carrier transport moves the descriptors and the releases), for the conformance suite and
for tools; the communicator uses the pool and reader directly, per message.

This module is the public face; the parts live in ``_shm_common`` (settings, sweep),
``_shm_pool`` (slots, recycler), ``_shm_reader`` (views), ``_shm_session`` (a
communicator's state), ``_relay`` (forwarding by reference), ``_fdshare`` (torch
tensors already in shared memory, by handle), ``_pagemap`` and ``_shm_transport``
(the contract).
"""

from __future__ import annotations

from ._relay import Relay
from ._common import DEFAULT_OFFLOAD, MIN_SLOT, SHM_DIR, SegmentGone, available, default_cap, sweep
from ._common import _PAGE, _slot_size  # noqa: F401  (the tests' view of the size classes)
from ._pool import Recycler, ShmPool, copy_out
from ._pull import PullPeer, PullSession
from ._reader import ShmReader
from ._session import ShmPeer, ShmSession
from ._transport import ShmLink, ShmListener, ShmTransport

__all__ = ["ShmPool", "ShmReader", "ShmSession", "ShmTransport", "ShmLink", "ShmListener", "Recycler", "Relay",
           "PullSession", "ShmPeer", "PullPeer", "SegmentGone", "available", "sweep", "default_cap", "copy_out", "SHM_DIR", "MIN_SLOT",
           "DEFAULT_OFFLOAD"]
