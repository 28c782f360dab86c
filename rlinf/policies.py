"""Public alias of :mod:`rlinf.channel.policies`, so that ``import rlinf.policies`` and
``from rlinf.policies import FIFO`` work as ``rlinf.policies.FIFO`` does: the
channel's load-balancing policies."""

from .channel.policies import *  # noqa: F401,F403
from .channel.policies import __all__  # noqa: F401
