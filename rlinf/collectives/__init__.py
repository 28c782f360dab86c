"""Collectives over groups formed on the fly: :class:`.group.Group` (broadcast, gather,
scatter, all_gather, all_to_all, barrier, all_reduce), the collective engine
(:mod:`._engine`: calls, ids, aborts) and M->N batch resharding (:mod:`.reshard`).

Layer: above ``core``; reaches its workings only through :mod:`rlinf.core.interface`
(``comm.internal``), besides the public ``Work``.
"""
