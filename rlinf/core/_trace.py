"""The trace recorder: one communicator's timeline, as Chrome trace (Perfetto) JSON.

With ``RLINF_TRACE=DIR`` (``Settings.trace``) each communicator owns a :class:`Recorder`
that notes every user-kind message it queues to a peer (``send``) and every one it takes
off the wire (``recv``), the collectives it runs and the channel puts and gets it makes,
with their bytes and the path taken. The parts that note them hold the recorder in an
attribute that is None when tracing is off: off, the hot path pays one attribute check.

On, noting a message that joins the event before it (see runs, below) is a few
comparisons and additions; another appends a short list to a buffer (no formatting, no
I/O). Every :data:`BATCH` events, once a second, and when the communicator closes
(:meth:`Recorder.flush`, :meth:`Recorder.aclose`), the loop formats the buffer, and the
recorder's own thread appends the text to the file (only the write: formatting there
would hold the GIL against the loop). (Noting every message as a tuple and making the
runs per batch was tried: it cost twice as much, measured in P2.)

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
same way. A message withdrawn while it waited for credit was never queued, so it is not
counted. Messages that follow each other closely (within :data:`RUN_GAP_NS`, with the
same peer, tag and path, nothing else noted between them: a burst) share one event, a
run: ``n`` is its first message, ``count`` how many, ``bytes`` their sum, and its span
runs from the first to the last. This is what keeps a trace of a message flood cheap:
only runs are formatted and written. A message whose buffers we hold until it is
through (large, or in shared memory, pulled, in CUDA IPC) is an event of its own, whose
span ends when they are free.
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

from . import routing, wire

__all__ = ["BATCH", "LANES", "Recorder", "trace_file"]

#: Events buffered before a batch is written (formatting one takes the loop ~0.5 ms).
BATCH = 1024
#: Seconds between writes of what is buffered, when fewer than :data:`BATCH` events came.
FLUSH_INTERVAL = 1.0
#: A message noted within this many nanoseconds of the previous one, of the same lane,
#: peer, tag and path, joins its event (a run: ``n`` is its first, ``count`` how many).
RUN_GAP_NS = 100_000
#: Peers and tags numbered at most; past it, those idle longest are forgotten (internal
#: tags such as a collective call's are used once).
MAX_KEYS = 1 << 16
#: The timeline's lanes (Chrome "threads") of one process: its tid -> name.
LANES = {1: "send", 2: "recv", 3: "collective", 4: "channel"}
_SEND, _RECV, _COLLECTIVE, _CHANNEL = 1, 2, 3, 4
#: The path of a message as the sender's outbox queued it -> the name in the trace.
_PATHS = {routing.INLINE: "zmq", routing.SHM: "shm", routing.BULK: "bulk", routing.CUDA_IPC: "cuda"}
_USER, _KIND, _TAG, _INLINE, _STREAM = wire.USER, wire.KIND, wire.TAG, routing.INLINE, routing.STREAM
# an event: [lane, start ns, duration ns, peer, tag, bytes, path, n, link or incarnation, count,
# the outbox a send run is for (None: it grows no more)]
_PEER, _BYTES, _PATH, _N, _EXTRA, _COUNT, _OUTBOX = 3, 5, 6, 7, 8, 9, 10
_time_ns = time.time_ns


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
        self._events: list[list] = []
        self._last: list | None = None        # the last event noted, while a message may join it
        #: the last event of each (peer, tag) sent to / (peer, incarnation, tag) received
        #: from: its ``n + count`` numbers the next message
        self._sent: dict[tuple, list] = {}
        self._received: dict[tuple, list] = {}
        self._kinds: dict[str, str] = {}      # peer -> the link inline messages took (zmq or stream)
        # the JSON that events share, formatted once: of each lane; of a peer, tag and path
        self._heads = {lane: f'{{"ph":"X","cat":"rlinf","pid":{self._pid},"tid":{lane},' for lane in LANES}
        self._middles: dict[tuple, str] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlinf-trace")
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
        self.flush()
        self._timer = loop.call_later(FLUSH_INTERVAL, self._tick, loop)

    # -- noting events (the traced paths call these only when tracing is on) ----------------
    def sent(self, outbox: Any, msg: Any) -> None:
        """``msg`` (an :class:`~rlinf.core._outmsg.OutMessage`) queued on ``outbox``."""
        entry = msg.entry
        now = _time_ns()
        last = self._last
        # the hot case first: a small inline message in a burst to one peer and tag
        if last is not None and last[_OUTBOX] is outbox and entry[_TAG] == last[4] and msg.transport == _INLINE \
                and not msg.large and entry[_KIND] == _USER and now - last[1] - last[2] < RUN_GAP_NS:
            last[2] = now - last[1]
            last[_BYTES] += msg.nbytes
            last[_COUNT] += 1
            return
        if entry[_KIND] != _USER:
            return
        peer, tag = outbox.address, entry[_TAG]
        path = msg.transport
        # the span of a message whose buffers we still hold (large, or in shared memory
        # being copied or pulled, ...) lasts until they are free; a small inline one's
        # future only said it waited for credit, and it has just been admitted
        runs = path == _INLINE and not msg.large
        link = None
        if path == _INLINE:     # ZeroMQ or a stream: the link says (not dialled yet: when written)
            link = outbox.link
            if link is not None:
                path, link = link.kind, None
            else:
                link = outbox
        key = (peer, tag)
        sent = self._sent
        before = sent.get(key)
        event = [_SEND, now, 0, peer, tag, msg.nbytes, path, 0 if before is None else before[_N] + before[_COUNT],
                 link, 1, outbox if runs else None]
        sent[key] = event
        self._last = event if runs else None
        if not runs and msg.future is not None:     # its span: until the caller's buffers are free again
            msg.future.add_done_callback(functools.partial(_ended, event))
        self._add(event)
        if len(sent) > MAX_KEYS:
            _forget_idle(sent)

    def received(self, src: str, incarnation: str, entry: wire.Entry, nbytes: int) -> None:
        """A user-kind message ``entry`` from ``src`` delivered to the mailbox."""
        now = _time_ns()
        tag = entry.tag
        nbytes += len(entry.codec_header)
        inline = entry.slot is None and entry.pull is None and entry.gpu is None and entry.relays is None
        last = self._last
        if last is not None and inline and last[_PEER] == src and last[4] == tag and last[_EXTRA] == incarnation \
                and last[0] == _RECV and last[_PATH] == "" and now - last[1] - last[2] < RUN_GAP_NS:
            last[2] = now - last[1]
            last[_BYTES] += nbytes
            last[_COUNT] += 1
            return
        path = "" if inline else "pull" if entry.pull is not None else "cuda" if entry.gpu is not None else "shm"
        key = (src, incarnation, tag)
        received = self._received
        before = received.get(key)
        event = [_RECV, now, 0, src, tag, nbytes, path, 0 if before is None else before[_N] + before[_COUNT],
                 incarnation, 1, None]
        received[key] = self._last = event
        self._add(event)
        if len(received) > MAX_KEYS:
            _forget_idle(received)

    def now(self) -> int:
        """The clock of this trace (``time.time_ns()``), for :meth:`span`'s ``start``."""
        return _time_ns()

    def span(self, lane: str, name: str, start: int, **args: Any) -> None:
        """An operation of ``lane`` (``"collective"`` or ``"channel"``) that began at
        ``start`` (:meth:`now`) and ends now; ``args``: plain values shown with it."""
        self._last = None
        self._add([_COLLECTIVE if lane == "collective" else _CHANNEL, start, _time_ns() - start, name, args])

    def _add(self, event: list) -> None:
        events = self._events
        events.append(event)
        if len(events) >= BATCH:
            if self._closed:     # (late, after the last batch: not kept)
                events.clear()
            else:
                self._write_batch()

    # -- writing ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was noted, now: before the links close, so that the messages
        noted before their link was known learn it from their outbox."""
        if self._events:
            self._write_batch()

    def _write_batch(self) -> None:
        """Format what is buffered here, and hand the text to the writer thread. (Here:
        formatting in that thread would make it take the GIL for milliseconds, and the
        loop, woken by a message, waits for it; the write itself lets go of the GIL.)"""
        text = self._text(self._take(), self._clock())
        self._writer.submit(self._write, text)

    def _take(self) -> list[list]:
        """The buffered events, the buffer emptied. An inline send queued before its
        link was dialled gets its path here, on the loop thread: its outbox's link, or
        (that link closed meanwhile) the one later sends to that peer took."""
        batch, self._events, self._last = self._events, [], None    # (a written event grows no more)
        kinds = self._kinds
        for event in batch:
            if event[0] == _SEND:
                event[_OUTBOX] = None     # (the last event of each peer and tag is kept: not its outbox)
                if event[_EXTRA] is None and event[_PATH] in (_INLINE, _STREAM):
                    kinds[event[_PEER]] = event[_PATH]
        for event in batch:
            if event[0] == _SEND and event[_EXTRA] is not None:
                outbox, event[_EXTRA] = event[_EXTRA], None
                link = outbox.link
                event[_PATH] = kinds.get(event[_PEER], _INLINE) if link is None else link.kind
        if len(self._middles) > MAX_KEYS:
            self._middles.clear()
        return batch

    def _text(self, batch: list[list], clock: tuple[float, float] | None, last: bool = False) -> str:
        lines = [self._format(event) for event in batch]
        if clock is not None or last:
            offset, rtt = clock if clock is not None else (None, None)
            record = json.dumps({"ph": "M", "pid": self._pid, "tid": 0, "name": "rlinf_clock",
                                 "args": {"offset_us": None if offset is None else offset * 1e6,
                                          "rtt_us": None if rtt is None else rtt * 1e6}})
            lines.append(record + ("\n]\n" if last else ",\n"))
        return "".join(lines)

    def _write(self, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def _format(self, event: list) -> str:
        # whole microseconds: formatting a float of 16 digits costs more than the event
        lane, ts, dur = event[0], event[1] // 1000, event[2] // 1000 or 1    # (a slice of no length is not drawn)
        head = self._heads[lane]
        if lane == _SEND or lane == _RECV:
            key = (lane, event[3], event[4], event[6], event[8])
            middle = self._middles.get(key)
            if middle is None:
                middle = self._middles[key] = self._middle(*key)
            return f'{head}"ts":{ts},"dur":{dur},{middle}{event[5]},"n":{event[7]},"count":{event[9]}}}}},\n'
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
        last = self._writer.submit(self._write, self._text(self._take(), self._clock(), True))
        self._writer.shutdown(wait=False)    # (the thread ends once the last batch is written)
        await asyncio.shield(asyncio.wrap_future(last))


def _ended(event: list, _future: asyncio.Future) -> None:
    event[2] = _time_ns() - event[1]


def _forget_idle(last: dict[tuple, list]) -> None:
    """Forget the half of ``last`` (key -> its last event) idle longest."""
    ends = sorted(event[1] + event[2] for event in last.values())
    cut = ends[len(ends) // 2]
    for key in [k for k, event in last.items() if event[1] + event[2] < cut]:
        del last[key]
