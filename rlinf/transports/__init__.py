"""Transport plug-ins: how a buffer moves between two processes.

* :mod:`.base` — the contract every transport implements: ``available()``,
  ``listen()``, ``connect()`` and the :class:`~.base.Link` the session layer drives
  (``try_send`` until :class:`~rlinf.errors.WouldBlock`, ``wait_writable``, ``released``
  for zero-copy sends, ``close_gracefully``, ``close``; ``send`` composes them), each
  method with its buffer-lifetime rule. Transports raise only rlinf errors.
* :mod:`.descriptors` — the buffer descriptors transports put on the wire (shared-memory
  slots, shared files, CUDA IPC slots, pulls), how each is checked before use, and the
  size limits every transport enforces.
* :mod:`.zeromq` — ZeroMQ ``ipc://`` (same node) and ``tcp://`` (across nodes).
* :mod:`.shm` — same-node shared memory: pooled slots, one copy, zero-copy views.
* :mod:`.stream` — same-node frame sets over a Unix stream socket the event loops
  write and read (no I/O thread in between).
* :mod:`.tcp_bulk` — large payloads between nodes over a TCP stream of their own.
* :mod:`.cuda.ipc` — GPU buffers to another process of the node: pooled device slots
  shared once, interprocess events for ordering (used through :mod:`rlinf.core._gpu_paths`).

Transports move bytes and buffers: they import nothing above them (no message format,
no control plane). Which one carries a buffer is decided only by
:func:`rlinf.routing.select_transport`; ``docs/transports.md`` has the table and the
lifetime rules. Importing this package imports no transport (and so no optional
dependency).
"""
