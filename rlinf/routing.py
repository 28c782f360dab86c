"""Public alias of :mod:`rlinf.core.routing` (DESIGN.md names
``rlinf.routing.select_transport``): the one pure function that picks a transport."""

from .core.routing import *  # noqa: F401,F403
from .core.routing import __all__  # noqa: F401
