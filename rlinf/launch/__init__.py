"""Starting workers: :class:`.cluster.Cluster` (embedded manager, local processes), the
launcher interface and worker groups (:mod:`.base`), the worker runtime a rank runs
(:mod:`.worker`) and the Ray launcher (:mod:`.ray`, imported only when used).

Layer: above :mod:`rlinf.communicator` (so above ``core``, ``collectives`` and ``channel``).
"""
