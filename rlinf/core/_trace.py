"""The trace recorder: one communicator's timeline, as Chrome trace (Perfetto) JSON.

With ``RLINF_TRACE=DIR`` (``Settings.trace``) each communicator owns a :class:`Recorder`
that notes every user-kind message it queues to a peer (``send``) and every one it takes
off the wire (``recv``), the collectives it runs and the channel puts and gets it makes,
with their bytes and the path taken. The parts that note them hold the recorder in an
attribute that is None when tracing is off: off, the hot path pays one attribute check.

On, noting an event appends a short list to a buffer (no formatting, no I/O); every
:data:`BATCH` events, and once a second from the event loop, the buffer is swapped for an
empty one and formatted and appended to the file by the recorder's own writer thread;
:meth:`Recorder.close` writes the rest.

The file, ``DIR/<group>_<rank>-<pid>-<incarnation>.json``, is the JSON array form of the
Chrome trace format (which tools accept unterminated, so the file of a process that died
is still read): one event per line, first the process's metadata (``process_name``,
``thread_name`` of each lane, and ``rlinf_process``: address, incarnation, host), last
``rlinf_clock``: this process's clock offset to the manager's (see
:class:`rlinf.control.clock.ClockSync`), written again with every batch so the last one
in the file is the best. Timestamps are this process's ``time.time_ns()`` in whole
microseconds; ``rlinf trace merge`` (:mod:`rlinf.tools.trace`) moves them to the
manager's clock.

Sends and receives carry the key that matches them: the sender numbers its messages per
destination and tag (``n``) in queueing order, which is the order the receiver delivers
them in per source and tag (messages with other tags may overtake, see
:mod:`rlinf.core._outbox`, never those with the same tag), and the receiver counts the
same way. A send withdrawn before it went out (cancelled while waiting for credit)
shifts the numbering of its tag: the merge then leaves the rest of that tag unmatched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import re
import socket
import time
from typing import Any, Callable

from ..transports.stream import StreamLink
from . import routing, wire

__all__ = ["BATCH", "LANES", "Recorder", "trace_file"]

#: Events buffered before a batch is written.
BATCH = 4096
#: Seconds between writes of what is buffered, when fewer than :data:`BATCH` events came.
FLUSH_INTERVAL = 1.0
#: The timeline's lanes (Chrome "threads") of one process: its tid -> name.
LANES = {1: "send", 2: "recv", 3: "collective", 4: "channel"}
_SEND, _RECV, _COLLECTIVE, _CHANNEL = 1, 2, 3, 4
#: The path of a message as the sender's outbox queued it -> the name in the trace.
_PATHS = {routing.INLINE: "zmq", routing.SHM: "shm", routing.BULK: "bulk", routing.CUDA_IPC: "cuda"}
_PULL = 7    # where a pull entry holds its descriptor (see wire.pull_entry)


def trace_file(directory: str, address: str, incarnation: str) -> str:
    """The path of one process's trace in ``directory``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", address)
    return os.path.join(directory, f"{safe}-{os.getpid()}-{incarnation[:8]}.json")


class Recorder:
    """The trace of one communicator (loop thread only, but for its writer thread).

    Args:
        directory: where the file goes (created if missing).
        address, incarnation: the communicator's.
        clock: ``() -> (offset, round_trip) | None``, seconds: our clock against the
            manager's (:attr:`rlinf.control.clock.ClockSync.offset`).

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, directory: str, address: str, incarnation: str,
                 clock: Callable[[], tuple[float, float] | None] = lambda: None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = trace_file(directory, address, incarnation)
        self.address = address
        self._clock = clock
        self._pid = os.getpid()
        self._events: list[tuple | list] = []
        self._sent: dict[tuple[str, Any], int] = {}
        self._received: dict[tuple[str, str, Any], int] = {}
        self._kinds: dict[str, str] = {}      # peer -> the link inline messages took (zmq or stream)
        # the JSON that events share, formatted once: of each lane; of a peer, tag and path
        self._heads = {lane: f'{{"ph":"X","cat":"rlinf","pid":{self._pid},"tid":{lane},' for lane in LANES}
        self._middles: dict[tuple, str] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlinf-trace")
        self._writing: concurrent.futures.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        meta = {"address": address, "incarnation": incarnation, "host": socket.gethostname(), "pid": self._pid}
        head = [{"ph": "M", "pid": self._pid, "tid": 0, "name": "process_name", "args": {"name": address}},
                {"ph": "M", "pid": self._pid, "tid": 0, "name": "rlinf_process", "args": meta}]
        head += [{"ph": "M", "pid": self._pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
                 for tid, name in LANES.items()]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write("[\n" + "".join(json.dumps(e) + ",\n" for e in head))

    def __repr__(self) -> str:
        return f"<Recorder {self.path} buffered={len(self._events)}>"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write what is buffered about once a second from ``loop`` (else only every
        :data:`BATCH` events and at close)."""
        self._timer = loop.call_later(FLUSH_INTERVAL, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._closed:
            return
        if self._events:
            self._write_batch()
        self._timer = loop.call_later(FLUSH_INTERVAL, self._tick, loop)

    # -- noting events (the traced paths call these only when tracing is on) ----------------
    def sent(self, outbox: Any, msg: Any) -> None:
        """``msg`` (an :class:`~rlinf.core._outmsg.OutMessage`) queued on ``outbox``."""
        entry = msg.entry
        if entry[wire.KIND] != wire.USER:
            return
        tag = entry[wire.TAG]
        key = (outbox.address, tag)
        n = self._sent.get(key, 0)
        self._sent[key] = n + 1
        path = "pull" if len(entry) > _PULL and entry[_PULL] is not None else msg.transport
        link = None
        if path == routing.INLINE:     # ZeroMQ or a stream: the link says (not dialled yet: later)
            link = outbox.link
            if link is not None:
                path, link = (routing.STREAM if isinstance(link, StreamLink) else path), None
            else:
                link = outbox
        if msg.future is None and link is None:    # (a tuple: the garbage collector soon skips it)
            self._add((_SEND, time.time_ns(), 0, outbox.address, tag, msg.nbytes, path, n, None))
            return
        event = [_SEND, time.time_ns(), 0, outbox.address, tag, msg.nbytes, path, n, link]
        if msg.future is not None:     # its span: until the caller's buffers are free again
            msg.future.add_done_callback(functools.partial(_ended, event))
        self._add(event)

    def received(self, src: str, incarnation: str, entry: wire.Entry, nbytes: int) -> None:
        """A user-kind message ``entry`` from ``src`` delivered to the mailbox."""
        tag = entry.tag
        key = (src, incarnation, tag)
        n = self._received.get(key, 0)
        self._received[key] = n + 1
        path = "pull" if entry.pull is not None else "cuda" if entry.gpu is not None else \
            "shm" if entry.slot is not None or entry.relays is not None else ""
        self._add((_RECV, time.time_ns(), 0, src, tag, nbytes + len(entry.codec_header), path, n, incarnation))

    def now(self) -> int:
        """The clock of this trace (``time.time_ns()``), for :meth:`span`'s ``start``."""
        return time.time_ns()

    def span(self, lane: str, name: str, start: int, **args: Any) -> None:
        """An operation of ``lane`` (``"collective"`` or ``"channel"``) that began at
        ``start`` (:meth:`now`) and ends now; ``args``: plain values shown with it."""
        self._add((_COLLECTIVE if lane == "collective" else _CHANNEL, start, time.time_ns() - start, name, args))

    def _add(self, event: tuple | list) -> None:
        events = self._events
        events.append(event)
        if len(events) >= BATCH and not self._closed:
            self._write_batch()

    # -- writing ------------------------------------------------------------------------------
    def _write_batch(self) -> None:
        """Hand what is buffered to the writer thread (the loop goes on at once)."""
        self._writing = self._writer.submit(self._append, self._take(), self._clock())

    def _take(self) -> list[list]:
        """The buffered events, the buffer emptied. An inline send queued before its
        link was dialled gets its path here, on the loop thread: its outbox's link, or
        (that link closed meanwhile) the one later sends to that peer took."""
        batch, self._events = self._events, []
        kinds = self._kinds
        for event in batch:
            if event[0] == _SEND and event[8] is None and event[6] in (routing.INLINE, routing.STREAM):
                kinds[event[3]] = event[6]
        for event in batch:
            if event[0] == _SEND and event[8] is not None:
                outbox, event[8] = event[8], None
                link = outbox.link
                event[6] = kinds.get(event[3], routing.INLINE) if link is None else \
                    routing.STREAM if isinstance(link, StreamLink) else routing.INLINE
        return batch

    def _append(self, batch: list[list], clock: tuple[float, float] | None, last: bool = False) -> None:
        lines = [self._format(event) for event in batch]
        if clock is not None or last:
            offset, rtt = clock if clock is not None else (None, None)
            record = json.dumps({"ph": "M", "pid": self._pid, "tid": 0, "name": "rlinf_clock",
                                 "args": {"offset_us": None if offset is None else offset * 1e6,
                                          "rtt_us": None if rtt is None else rtt * 1e6}})
            lines.append(record + ("\n]\n" if last else ",\n"))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(lines))

    def _format(self, event: tuple | list) -> str:
        # whole microseconds: formatting a float of 16 digits costs more than the event
        lane, ts, dur = event[0], event[1] // 1000, event[2] // 1000 or 1    # (a slice of no length is not drawn)
        head = self._heads[lane]
        if lane == _SEND or lane == _RECV:
            key = (lane, event[3], event[4], event[6], event[8])
            middle = self._middles.get(key)
            if middle is None:
                middle = self._middles[key] = self._middle(*key)
            return f'{head}"ts":{ts},"dur":{dur},{middle}{event[5]},"n":{event[7]}}}}},\n'
        return (f'{head}"ts":{ts},"dur":{dur},"name":{json.dumps(event[3])},'
                f'"args":{json.dumps(event[4], default=str)}}},\n')

    @staticmethod
    def _middle(lane: int, peer: str, tag: Any, path: str, inc: str | None) -> str:
        """What the events of one peer, tag and path share, up to their byte count."""
        args = {"peer": peer, "tag": tag, "path": _PATHS.get(path, path) if lane == _SEND else path}
        if inc is not None:
            args["inc"] = inc
        return f'"name":"{"send" if lane == _SEND else "recv"}","args":{json.dumps(args)[:-1]},"bytes":'

    async def aclose(self) -> None:
        """Write what is left and end the file (idempotent). Safe to cancel: the
        writing goes on in the recorder's thread."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        last = self._writer.submit(self._append, self._take(), self._clock(), True)
        self._writer.shutdown(wait=False)    # (the thread ends once the last batch is written)
        await asyncio.shield(asyncio.wrap_future(last))


def _ended(event: list, _future: asyncio.Future) -> None:
    event[2] = time.time_ns() - event[1]
