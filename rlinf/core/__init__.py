"""The messaging core: the Communicator facade (:mod:`.communicator`), per-peer sessions
(:mod:`._peer`: a peer incarnation's links, outbox and ordering, dial, failure), the
delivery protocol (:mod:`._delivery`: numbering, acknowledgements, resends), the send
path (:mod:`._send`, :mod:`._outbox`), the receive path (:mod:`._receive`: frame reading
in :mod:`._inbound`, the mailbox in :mod:`._mailbox`, decoding),
membership (:mod:`._membership`), the wire records (:mod:`.wire`), routing (:mod:`.routing`:
the one place a path is chosen), ``Work`` handles and traffic statistics.

Layer: above ``codec``, ``transports`` and ``control``; below ``collectives``,
``channel``, ``launch``. Subsystems use :mod:`.interface` (``comm.internal``), not the
Communicator's private members. See ``docs/architecture.md``.
"""
