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
same way. A message withdrawn while it waited for credit was never queued, so it is not
counted. Messages that follow each other closely (within :data:`RUN_GAP_NS`, with the
same peer, tag and path, nothing else noted between them: a burst) share one event, a
run: ``n`` is its first message, ``count`` how many, ``bytes`` their sum, and its span
runs from the first to the last. This is what keeps a trace of a message flood cheap:
noting a message that joins a run is a few attribute updates, and only runs are
formatted and written.
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
_PULL = 7    # where a pull entry holds its descriptor (see wire.pull_entry)
_USER, _KIND, _TAG, _INLINE, _STREAM = wire.USER, wire.KIND, wire.TAG, routing.INLINE, routing.STREAM
# an event: [lane, start ns, duration ns, peer, tag, bytes, path, n, outbox or incarnation, count]
_PEER, _BYTES, _PATH, _N, _EXTRA, _COUNT = 3, 5, 6, 7, 8, 9
_PENDING = "?"     # the path of an inline message sent before its link was dialled, until known
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
        self._notes: list[tuple | list] = []     # what was noted since the last batch (see sent)
        #: the number of the next message and the time of the last, of each (peer, tag)
        #: sent to and (peer, incarnation, tag) received from
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
        return f"<Recorder {self.path} buffered={len(self._notes)}>"

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
    # A small inline message is noted as a tuple and nothing more: numbering it, finding
    # its path and joining it to a run wait for the batch (:meth:`_take`), where the same
    # work for a thousand messages in one loop costs a third of what it costs spread out.

    def sent(self, outbox: Any, msg: Any) -> None:
        """``msg`` (an :class:`~rlinf.core._outmsg.OutMessage`) queued on ``outbox``."""
        if msg.large or msg.transport != _INLINE:
            self._sent_held(outbox, msg)
            return
        notes = self._notes
        notes.append((_time_ns(), outbox, msg.entry, msg.nbytes, outbox.link))   # (the link: now, not later)
        if len(notes) >= BATCH:
            self._write_batch()

    def _sent_held(self, outbox: Any, msg: Any) -> None:
        """A message whose buffers we hold until it is through (large, or in shared
        memory, ...): its span lasts until they are free."""
        entry = msg.entry
        if entry[_KIND] != _USER:
            return
        path = msg.transport
        if path == routing.SHM and len(entry) > _PULL and entry[_PULL] is not None:
            path = "pull"
        event = [_SEND, _time_ns(), 0, outbox.address, entry[_TAG], msg.nbytes, path, 0,
                 outbox if path == _INLINE else None, 1]
        if msg.future is not None:
            msg.future.add_done_callback(functools.partial(_ended, event))
        self._add(event)

    def received(self, src: str, incarnation: str, entry: wire.Entry, nbytes: int) -> None:
        """A user-kind message ``entry`` from ``src`` delivered to the mailbox."""
        notes = self._notes
        notes.append((_time_ns(), src, incarnation, entry, nbytes))
        if len(notes) >= BATCH:
            self._write_batch()

    def now(self) -> int:
        """The clock of this trace (``time.time_ns()``), for :meth:`span`'s ``start``."""
        return _time_ns()

    def span(self, lane: str, name: str, start: int, **args: Any) -> None:
        """An operation of ``lane`` (``"collective"`` or ``"channel"``) that began at
        ``start`` (:meth:`now`) and ends now; ``args``: plain values shown with it."""
        self._add([_COLLECTIVE if lane == "collective" else _CHANNEL, start, _time_ns() - start, name, args])

    def _add(self, event: list) -> None:
        notes = self._notes
        notes.append(event)
        if len(notes) >= BATCH:
            self._write_batch()

    # -- writing ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was noted, now: before the links close, so that the messages
        noted before their link was known learn it from their outbox."""
        if self._notes:
            self._write_batch()

    def _write_batch(self) -> None:
        """Make events of what is noted and format them here, and hand the text to the
        writer thread. (Here: formatting in that thread would make it take the GIL for
        milliseconds, and the loop, woken by a message, would wait for it; the write
        itself lets go of the GIL.)"""
        if self._closed:       # (a late message, after the last batch: not kept)
            self._notes.clear()
            return
        self._writer.submit(self._write, self._text(self._take(), self._clock()))

    def _take(self) -> list[list]:
        """The events of what was noted since the last batch, in order, the notes
        emptied: messages numbered, inline ones given the link their outbox has now
        (or, closed meanwhile, the one later sends to that peer took), bursts joined."""
        notes, self._notes = self._notes, []
        events: list[list] = []
        last: list | None = None     # the event a message may join, and of it:
        last_outbox = last_link = last_counted = None     # a send's outbox and link; its numbering
        pending: list[tuple[list, Any]] = []
        kinds = self._kinds
        for note in notes:
            if type(note) is not tuple:      # an event already: a span, a message we held
                if note[0] == _SEND:
                    outbox, note[_EXTRA] = note[_EXTRA], None
                    if outbox is not None:      # (a large message's link: the one it goes on)
                        note[_PATH] = self._link_kind(outbox.link, note[_PEER])
                    note[_N] = self._count(self._sent, (note[_PEER], note[4]), note[1])[0] - 1
                events.append(note)
                last = None
                continue
            now = note[0]
            if type(note[1]) is not str:      # a small inline message sent (else received from note[1])
                _, outbox, entry, nbytes, link = note
                if last is not None and outbox is last_outbox and link is last_link and entry[_TAG] == last[4] \
                        and now - last[1] - last[2] < RUN_GAP_NS and entry[_KIND] == _USER:
                    last[2] = now - last[1]
                    last[_BYTES] += nbytes
                    last[_COUNT] += 1
                    last_counted[0] += 1
                    continue
                if entry[_KIND] != _USER:
                    continue
                peer, tag = outbox.address, entry[_TAG]
                path = _PENDING if link is None else kinds.get(peer) if link is last_link else \
                    self._link_kind(link, peer)
                last_counted = self._count(self._sent, (peer, tag), now)
                last = [_SEND, now, 0, peer, tag, nbytes, path, last_counted[0] - 1, None, 1]
                last_outbox, last_link = outbox, link
                if link is None:
                    pending.append((last, outbox))
            else:
                _, peer, incarnation, entry, nbytes = note
                inline = entry.slot is None and entry.pull is None and entry.gpu is None and entry.relays is None
                if last is not None and inline and last[0] == _RECV and peer == last[_PEER] and entry.tag == last[4] \
                        and incarnation == last[_EXTRA] and last[_PATH] == "" and now - last[1] - last[2] < RUN_GAP_NS:
                    last[2] = now - last[1]
                    last[_BYTES] += nbytes + len(entry.codec_header)
                    last[_COUNT] += 1
                    last_counted[0] += 1
                    continue
                path = "" if inline else "pull" if entry.pull is not None else \
                    "cuda" if entry.gpu is not None else "shm"
                last_counted = self._count(self._received, (peer, incarnation, entry.tag), now)
                last = [_RECV, now, 0, peer, entry.tag, nbytes + len(entry.codec_header), path, last_counted[0] - 1,
                        incarnation, 1]
                last_outbox = last_link = None
            events.append(last)
        for event, outbox in pending:   # sent before the link was dialled: what later ones took
            event[_PATH] = kinds.get(event[_PEER]) or self._link_kind(outbox.link, event[_PEER])
        for numbers in (self._sent, self._received):
            if len(numbers) > MAX_KEYS:
                _forget_idle(numbers)
        if len(self._middles) > MAX_KEYS:
            self._middles.clear()
        return events

    @staticmethod
    def _count(numbers: dict[tuple, list], key: tuple, now: int) -> list:
        """``[next n, last time]`` of ``key`` (a peer and tag), one message counted."""
        counted = numbers.get(key)
        if counted is None:
            counted = numbers[key] = [1, now]
        else:
            counted[0] += 1
            counted[1] = now
        return counted

    def _link_kind(self, link: Any, peer: str) -> str:
        """``"stream"`` or ``"zmq"``: ``link``'s kind (kept as ``peer``'s), or, when None
        (closed), the last seen for ``peer``."""
        if link is None:
            return self._kinds.get(peer, _INLINE)
        kind = self._kinds[peer] = _STREAM if type(link) is StreamLink else _INLINE   # (an ABC: isinstance
        return kind                                                                     # is slow)

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
    event[2] = time.time_ns() - event[1]


def _forget_idle(numbers: dict[tuple, list]) -> None:
    """Forget the half of ``numbers`` (key -> [next n, last time]) idle longest."""
    cut = sorted(counted[1] for counted in numbers.values())[len(numbers) // 2]
    for key in [k for k, counted in numbers.items() if counted[1] < cut]:
        del numbers[key]
