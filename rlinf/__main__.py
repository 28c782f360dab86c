"""``python -m rlinf``: the same as the ``rlinf`` command."""

from __future__ import annotations

if __name__ == "__main__":
    from .tools.cli import main

    raise SystemExit(main())
