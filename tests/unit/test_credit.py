"""The sender's side of flow control (``rlinf.core._credit``), without processes: when a
message may go, what an acknowledgement frees, and what a late report may not undo."""

from __future__ import annotations

import asyncio
import types

from rlinf.core._credit import BULK_BYTES, Credit, Window

MiB = 1 << 20


def _msg(nbytes: int, future=None, tag=0):
    return types.SimpleNamespace(nbytes=nbytes, future=future, discard=None, counted=False, tag=tag)


def test_messages_go_while_the_window_has_room_then_wait_in_order():
    credit = Credit(Window(msgs=3, nbytes=1000))
    for _ in range(3):
        assert credit.open_to(100, 0)
        credit.take(100)
    assert not credit.open_to(100, 0)                  # 3 messages outstanding: the window is full
    waiting = [_msg(100), _msg(100)]
    for m in waiting:
        credit.wait(m)
    assert list(credit.admit()) == []               # nothing freed yet
    credit.give_back(1, 100)                        # one acknowledged, and its receiver took it
    credit.report(1, 0, 0)
    assert list(credit.admit()) == waiting[:1]      # room for one: the first, in order
    assert credit.in_flight == 3 and list(credit.waiting) == waiting[1:]
    credit.give_back(1, 100)
    assert list(credit.admit()) == waiting[1:]


def test_room_counts_what_the_receiver_holds_and_what_is_in_flight():
    credit = Credit(Window(msgs=10, nbytes=1000))
    credit.take(300)
    credit.report(5, 2, 600)                        # it holds 2 messages, 600 bytes: 900 used
    assert credit.room(100)                         # the one that fills the window goes (even larger)
    credit.take(100)
    assert not credit.room(1)                       # full
    credit.report(7, 0, 0)                          # its application took them
    assert credit.room(700)
    credit.report(8, 8, 10)                         # 10 messages outstanding: full in messages
    assert not credit.room(1)


def test_a_message_larger_than_the_window_goes_while_the_window_is_not_full():
    """Not only when nothing is outstanding: a small message on another tag that the
    receiver reads later must not hold back a large one it reads first."""
    credit = Credit(Window(msgs=10, nbytes=1000))
    credit.take(10)
    credit.give_back(1, 10)
    credit.report(1, 1, 10)                         # a small one waits unread at the receiver
    assert credit.room(5000)
    credit.take(5000)
    assert not credit.room(1)
    credit.give_back(1, 5000)
    credit.report(2, 2, 5010)                       # acknowledged, not yet received
    assert not credit.room(1)
    credit.report(3, 0, 0)
    assert credit.room(5000)


def test_a_late_report_does_not_undo_a_newer_one():
    """A frame set that crossed a later one on another link carries an older count:
    taking it would forget what arrived since."""
    credit = Credit(Window(msgs=10, nbytes=1000))
    credit.report(20, 4, 400)
    credit.report(12, 1, 100)                       # older acknowledgement: ignored
    assert (credit.held, credit.held_bytes) == (4, 400)
    credit.report(20, 2, 200)                       # same acknowledgement, fewer held: taken
    assert (credit.held, credit.held_bytes) == (2, 200)
    credit.report(20, 4, 400)                       # same one, sealed earlier (a bulk frame set that
    assert (credit.held, credit.held_bytes) == (2, 200)   # started long ago): ignored


def test_a_send_cancelled_while_waiting_is_dropped_and_never_counted():
    loop = asyncio.new_event_loop()
    try:
        credit = Credit(Window(msgs=1, nbytes=1000))
        credit.take(10)
        cancelled, kept = _msg(10, loop.create_future()), _msg(10, loop.create_future())
        discarded = []
        cancelled.discard = lambda: discarded.append(True)
        credit.wait(cancelled)
        credit.wait(kept)
        cancelled.future.cancel()                   # its send timed out
        credit.give_back(1, 10)
        assert list(credit.admit()) == [kept] and discarded == [True]
        assert (credit.in_flight, credit.in_flight_bytes) == (1, 10)
        assert credit.waits == 2
    finally:
        loop.close()


def test_bulk_messages_and_small_ones_have_a_lane_each():
    """A bulk transfer filling its lane (in flight, then held unread) leaves the small
    lane open: a 64 B ping does not wait for a 40 MiB message to be received."""
    credit = Credit(Window(msgs=10, nbytes=8 * MiB))
    credit.take(40 * MiB)
    assert not credit.room(BULK_BYTES) and credit.room(64)
    credit.take(64)
    credit.give_back(1, 0, 40 * MiB)                # acknowledged ...
    credit.report(1, 1, 0, 40 * MiB)                # ... and held unread: the bulk lane stays full
    assert not credit.room(2 * MiB) and credit.room(64)
    credit.take(7 * MiB)                            # counted in its lane (bulk: 1 MiB or more)
    assert credit.in_flight_bulk == 7 * MiB and credit.in_flight_bytes == 64
    credit.report(2, 0, 0, 0)
    credit.give_back(1, 0, 7 * MiB)
    assert credit.room(BULK_BYTES) and credit.used == (1, 64)


def test_a_message_passes_those_waiting_only_with_another_tag():
    credit = Credit(Window(msgs=10, nbytes=8 * MiB))
    credit.take(40 * MiB)                           # a bulk message in flight: its lane is full
    big = _msg(40 * MiB, tag=0)
    credit.wait(big)
    assert not credit.open_to(64, 0)                # same tag: behind it
    assert credit.open_to(64, 1)                    # another tag: goes now
    same, other = _msg(64, tag=0), _msg(64, tag=1)
    credit.wait(same)
    credit.wait(other)
    assert list(credit.admit()) == [other]          # admitted past the bulk one, not past its tag
    assert list(credit.waiting) == [big, same]
    credit.give_back(1, 0, 40 * MiB)
    assert list(credit.admit()) == [big, same]      # then in order
