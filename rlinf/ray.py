"""Public alias of :mod:`rlinf.launch.ray`: ``import rlinf.ray`` (needs Ray), then
``rlinf.ray.init()``, ``rlinf.ray.RayLauncher``, ``rlinf.ray.node_id()``."""

from .launch.ray import *  # noqa: F401,F403
from .launch.ray import __all__  # noqa: F401
