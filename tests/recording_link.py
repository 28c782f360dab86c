"""A data link that accepts every frame set at once and keeps a copy of it: the tests
drive a real :class:`rlinf.core._outbox.Outbox` through it, with no sockets."""

from __future__ import annotations

from rlinf.transports.base import Link


class RecordingLink(Link):
    """Accepts every frame set at once and keeps a copy of it (in ``sent``)."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def try_send(self, frames: list, *, track: bool = False) -> None:
        self.sent.append([bytes(f) for f in frames])

    async def wait_writable(self) -> None:
        pass

    async def released(self, tracker) -> None:
        pass

    def close(self, exc: BaseException | None = None) -> None:
        pass

    def close_gracefully(self, linger_ms: int, exc: BaseException | None = None) -> None:
        pass
