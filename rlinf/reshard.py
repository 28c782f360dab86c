"""Public alias of :mod:`rlinf.collectives.reshard`
(``rlinf.reshard.reshard(comm, shard, src=..., dst=..., dim=0)``): M->N batch resharding."""

from .collectives.reshard import *  # noqa: F401,F403
from .collectives.reshard import __all__  # noqa: F401
