# Public alias of rlinf.channel.policies, so that ``import rlinf.policies`` and
# ``from rlinf.policies import FIFO`` work as ``rlinf.policies.FIFO`` does (its docstring
# is the channel policies' own: help() and docs/api.md show that).
from .channel.policies import *  # noqa: F401,F403
from .channel.policies import __all__, __doc__  # noqa: F401
