"""Public alias of :mod:`rlinf.transports.leftovers` (``rlinf.leftovers.remove_orphans()``,
which you may call yourself): shared-memory files and socket folders of dead processes."""

from .transports.leftovers import *  # noqa: F401,F403
from .transports.leftovers import __all__  # noqa: F401
