"""Process liveness on this machine, from ``/proc`` (no signals sent)."""

from __future__ import annotations

__all__ = ["process_gone"]


def process_gone(pid: int) -> bool:
    """True when ``pid`` does not run on this machine (missing or a zombie).

    Used by the manager (liveness of local workers) and the shared-memory sweeper.
    """
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # the state is the field after the parenthesised command name
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X")
