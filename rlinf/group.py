"""Public alias of :mod:`rlinf.collectives.group` (``rlinf.group.Group``, as the docs
once named it): collective groups formed on the fly."""

from .collectives.group import *  # noqa: F401,F403
from .collectives.group import __all__  # noqa: F401
