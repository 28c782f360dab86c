"""The messaging core: the Communicator facade, per-peer sessions (send side: outbox,
ordering, shared-memory and pull bookkeeping; receive side: frame reading, arrival
order), the mailbox that matches messages to receivers, the wire records, routing (the
one place a path is chosen), ``Work`` handles and traffic statistics.

Layer: above ``codec``, ``transports`` and ``control``; below ``collectives``,
``channel``, ``launch``. Subsystems use :mod:`.interface`, not the Communicator's
private members. See ``docs/architecture.md``.
"""
