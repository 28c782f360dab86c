"""Pickled messages over a driver<->child pipe, on an event loop.

A driver and each of its children (worker processes, channel processes, a Ray actor's
worker thread) talk over a ``multiprocessing.Pipe()``, a socketpair. Its
``Connection.send_bytes``/``recv_bytes`` are blocking calls, and a loop watching the
fd makes it non-blocking (uvloop's ``add_reader`` does), after which they fail part-way
on any message larger than the socket buffer. :class:`MessagePipe` does the I/O
itself, so that neither side ever blocks its loop and two sides sending large messages
to each other at once cannot deadlock.

Framing is multiprocessing's, so a plain ``Connection`` at the other end (the Ray
actor's relay, ``rlinf.ray``) reads and writes the same bytes: a 4-byte big-endian
signed length, or -1 and an 8-byte length from 2 GiB on, then the payload. The payload
is plain ``pickle`` by value: multiprocessing's own pickler would pass torch tensors as
shared-memory file descriptors, which the receiver cannot open once the sender has
exited (a worker's return value is sent just before it exits). Plain pickle copies them.

A message whose receiver cannot unpickle it is lost: nothing in it can be read, not even
which request it answers. So a user's value (a call's arguments, its reply, a worker's
result) travels pickled once more, as bytes inside the message (:func:`dump_value`),
and the receiver unpickles it where it can report a failure (:func:`load_value`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import pickle
import struct
from typing import Any, Callable

__all__ = ["MessagePipe", "dump_value", "load_value"]

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_SHORT_MAX = 0x7fffffff
#: Bytes asked of one ``os.read`` (a socketpair buffers about 200 KiB).
_CHUNK = 256 * 1024
#: Bytes one readable callback reads at most, so that a flood on one pipe cannot keep
#: the loop from everything else (the rest is read on the next callback).
_READ_BUDGET = 4 * 1024 * 1024
#: Buffers given to one ``os.writev``.
_IOV = 64


def dump_value(value: Any) -> bytes:
    """``value`` pickled, to travel as bytes inside a message (see the module docstring).

    Raises:
        pickle.PicklingError, TypeError, AttributeError, ...: it cannot be pickled.
    """
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def load_value(data: bytes, what: str) -> Any:
    """The value :func:`dump_value` made ``data`` of; ``what`` names it in the error.

    Raises:
        ValueError: it cannot be unpickled in this process (a class that is not
            importable here, say); the message says what and why.
    """
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise ValueError(f"{what} cannot be unpickled in this process: {exc!r}") from exc


def _frame(message: Any) -> tuple[bytes, bytes]:
    """The frame header and the payload of ``message`` (pickling errors raise here)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    header = _SHORT.pack(n) if n <= _SHORT_MAX else _SHORT.pack(-1) + _LONG.pack(n)
    return header, payload


class MessagePipe:
    """One end of a driver<->child pipe carrying pickled messages, in order.

    Owns ``conn`` (a ``multiprocessing`` ``Connection`` or a socket: anything with
    ``fileno()`` and ``close()``) and its fd, which it keeps non-blocking; nothing else
    may read or write them. :meth:`close` closes ``conn``.

    Started on a loop (:meth:`start`), it reads whatever arrives and hands each
    complete message to ``on_message``, in order, from the loop's reader callback (on the
    loop's thread); :meth:`send` queues a message, writes what the fd takes now and
    writes the rest when the fd is writable. Not started, :meth:`send` only queues and
    :meth:`send_blocking` writes everything queued and its message, blocking: for the
    end of a process, after its loop has finished.

    The other side's end closing (EOF, or an error reading) means it is gone: reading
    stops, ``on_eof`` is called once, and later sends raise ``BrokenPipeError``.
    A message the other side wrote before it closed its end is still delivered first.

    Buffers: a message is pickled when it is sent, so the caller may change or drop it
    at once; the pipe owns the pickled bytes until they are written. Nothing bounds that
    queue: the pipe carries requests, replies and results, bulk data goes through the
    communicator. Each message given to ``on_message`` is a fresh object, the callback's
    to keep.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._fd: int = conn.fileno()
        os.set_blocking(self._fd, False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[Any], None] | None = None
        self._on_eof: Callable[[], None] | None = None
        self._in = bytearray()                                   # received, not yet a whole frame
        self._out: collections.deque[memoryview] = collections.deque()   # queued, not yet written
        self._pending = 0                                        # bytes in _out
        self._writer = False                                     # add_writer is in effect
        self._gone: OSError | None = None                        # set once the other side is gone
        self._closed = False

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "gone" if self._gone else
                 "started" if self._loop is not None else "stopped")
        return f"<MessagePipe fd={self._fd} {state} pending={self._pending}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def pending(self) -> int:
        """Bytes queued and not yet written."""
        return self._pending

    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
              on_eof: Callable[[], None] | None = None) -> None:
        """Watch the fd on ``loop`` (running in this thread) and write what is queued.

        Args:
            on_message: called with each message, on the loop, in the order sent. An
                exception it raises (or one unpickling a message) goes to the loop's
                exception handler; the messages behind it are still delivered.
            on_eof: called once when the other side is gone, after the messages it sent.
        """
        if self._closed:
            raise ValueError("the pipe is closed")
        if self._loop is not None:
            raise RuntimeError("the pipe is started already")
        self._loop, self._on_message, self._on_eof = loop, on_message, on_eof
        if self._gone is None:
            loop.add_reader(self._fd, self._on_readable)
            with contextlib.suppress(OSError):   # recorded; the reader reports the end
                self._write()

    def stop(self) -> None:
        """Stop watching the fd; no callback runs after this. What is queued stays queued
        (for :meth:`send_blocking`), what was received stays buffered. Idempotent."""
        if self._loop is None:
            return
        self._loop.remove_reader(self._fd)
        if self._writer:
            self._loop.remove_writer(self._fd)
            self._writer = False
        self._loop = None

    def close(self) -> None:
        """Stop, drop what is queued or buffered, and close ``conn``. Idempotent."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        self._out.clear()
        self._pending = 0
        self._in.clear()
        self._conn.close()

    def send(self, message: Any) -> None:
        """Queue ``message`` and, if started, write what the fd takes now (never blocks).

        ``message`` is pickled at once: it may be changed afterwards.

        Raises:
            pickle.PicklingError, TypeError, ...: it cannot be pickled (nothing is queued).
            BrokenPipeError / OSError: the other side is gone.
            ValueError: the pipe is closed.
        """
        self._queue(message)
        if self._loop is not None and not self._writer:
            self._write()

    def send_blocking(self, message: Any) -> None:
        """Write everything queued and then ``message``, blocking until all is written:
        for when no loop runs (a worker's result, after its loop has finished).

        Raises:
            RuntimeError: the pipe is started (this would block its loop).
            pickle.PicklingError, TypeError, ...: it cannot be pickled (nothing is queued).
            BrokenPipeError / OSError: the other side is gone.
            ValueError: the pipe is closed.
        """
        if self._loop is not None:
            raise RuntimeError("send_blocking() on a started pipe would block its loop: stop() it first")
        self._queue(message)
        os.set_blocking(self._fd, True)
        try:
            self._write()
        finally:
            os.set_blocking(self._fd, False)

    def drain(self) -> None:
        """If started, read and deliver now everything readable, up to EOF or until the
        fd would block (with no budget). For when the other side has exited: what it
        wrote before is all in the socket by then."""
        if self._loop is not None:
            self._read(None)

    # -- writing ------------------------------------------------------------------------
    def _queue(self, message: Any) -> None:
        if self._closed:
            raise ValueError("the pipe is closed")
        if self._gone is not None:
            raise BrokenPipeError("the other side of the pipe is gone") from self._gone
        header, payload = _frame(message)
        self._out.append(memoryview(header))
        self._out.append(memoryview(payload))
        self._pending += len(header) + len(payload)

    def _write(self) -> None:
        """Write until everything is written or the fd would block; while something is
        left and the pipe is started, write again when the fd is writable."""
        try:
            while self._out:
                self._written(os.writev(self._fd, list(itertools.islice(self._out, _IOV))))
        except BlockingIOError:
            pass
        except OSError as exc:
            # The other side is gone. Reading goes on: what it sent before is still to be read.
            self._gone = exc
            self._out.clear()
            self._pending = 0
            raise
        finally:
            self._watch_writable(bool(self._out) and self._loop is not None)

    def _written(self, n: int) -> None:
        self._pending -= n
        while n:
            head = self._out[0]
            if n < len(head):
                self._out[0] = head[n:]
                return
            n -= len(head)
            self._out.popleft()

    def _watch_writable(self, want: bool) -> None:
        if want == self._writer or self._loop is None:
            return
        if want:
            self._loop.add_writer(self._fd, self._on_writable)
        else:
            self._loop.remove_writer(self._fd)
        self._writer = want

    def _on_writable(self) -> None:
        with contextlib.suppress(OSError):   # recorded: the next send raises it; the reader reports the end
            self._write()

    # -- reading ------------------------------------------------------------------------
    def _on_readable(self) -> None:
        self._read(_READ_BUDGET)

    def _read(self, budget: int | None) -> None:
        eof = False
        got = 0
        while budget is None or got < budget:
            try:
                chunk = os.read(self._fd, _CHUNK)
            except BlockingIOError:
                break
            except OSError:   # reset: as good as closed
                eof = True
                break
            if not chunk:
                eof = True
                break
            self._in += chunk
            got += len(chunk)
        self._deliver()
        if eof:
            self._ended()

    def _deliver(self) -> None:
        while self._loop is not None:   # a callback may stop or close the pipe
            try:
                frame = self._next_frame()
            except ValueError as exc:
                self._loop.call_exception_handler({"message": "rlinf: garbage on a pipe", "exception": exc,
                                                   "pipe": self})
                self._ended()
                return
            if frame is None:
                return
            try:
                self._on_message(pickle.loads(frame))
            except Exception as exc:   # one bad message must not hold up the ones behind it
                self._loop.call_exception_handler({"message": "rlinf: handling a message from a pipe failed",
                                                   "exception": exc, "pipe": self})

    def _next_frame(self) -> memoryview | bytearray | None:
        """Take the first complete frame's payload out of the receive buffer."""
        buf = self._in
        if len(buf) < _SHORT.size:
            return None
        size, = _SHORT.unpack_from(buf)
        start = _SHORT.size
        if size == -1:
            if len(buf) < start + _LONG.size:
                return None
            size, = _LONG.unpack_from(buf, start)
            start += _LONG.size
        if size < -1:
            raise ValueError(f"a frame of length {size}: the other side does not speak this protocol")
        end = start + size
        if len(buf) < end:
            return None
        if end == len(buf):   # the common case for a large message: hand the buffer over, no copy
            self._in = bytearray()
            return memoryview(buf)[start:]
        frame = buf[start:end]
        del buf[:end]   # cheap: bytearray drops a prefix by moving its start
        return frame

    def _ended(self) -> None:
        """The other side is gone: stop, drop a message it left unfinished, tell the owner."""
        if self._gone is None:
            self._gone = BrokenPipeError("the other side of the pipe closed its end")
        self._out.clear()
        self._pending = 0
        self._in.clear()
        on_eof = self._on_eof if self._loop is not None else None
        self.stop()
        if on_eof is not None:
            on_eof()
