"""Public alias of :mod:`rlinf.control.manager`, so that ``python -m rlinf.manager
--bind tcp://0.0.0.0:5555 --token SECRET`` runs a standalone manager."""

from .control.manager import *  # noqa: F401,F403
from .control.manager import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
