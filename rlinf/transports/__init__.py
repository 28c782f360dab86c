"""Transport plug-ins: how a buffer moves between two processes.

* :mod:`.base` — the contract (``available()``, ``listen()``, ``connect()``, a ``Link``
  with ``send(header, buffers)``) every transport implements and states its
  buffer-lifetime rule against.
* :mod:`.zeromq` — ZeroMQ ``ipc://`` (same node) and ``tcp://`` (across nodes).
* :mod:`.shm` — same-node shared memory: pooled slots, one copy, zero-copy views.
* :mod:`.stream` — same-node frame sets over a Unix stream socket the event loops
  write and read (no I/O thread in between).
* :mod:`.tcp_bulk` — large payloads between nodes over a TCP stream of their own.
* :mod:`.cuda_ipc` — GPU buffers to another process of the node: pooled device slots
  shared once, interprocess events for ordering (used through :mod:`rlinf.core._gpu_paths`).

Which one carries a buffer is decided only by :func:`rlinf.routing.select_transport`;
``docs/transports.md`` has the table and the lifetime rules. Importing this package
imports no transport (and so no optional dependency).
"""
