"""Unknown addresses and the default timeout, as a new user meets them (issue 28).

A send to an address nobody registered used to wait forever, silently, and with a
timeout said only that it "did not complete". ``wait_for_peer=False`` now fails it at
once; by default it still waits (a worker that joins late gets its messages), with a
warning after a while and a timeout that names the cause. ``RLINF_TIMEOUT`` is the
timeout of every call that takes ``timeout=`` and is given none; an explicit one wins.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import rlinf
from rlinf.config import Settings
from rlinf.core import _peer

pytestmark = pytest.mark.multiproc


async def _took(operation) -> float:
    """Seconds until ``operation`` raised ``CommTimeoutError`` (it must)."""
    start = time.monotonic()
    with pytest.raises(rlinf.CommTimeoutError):
        await operation
    return time.monotonic() - start


# -- wait_for_peer ---------------------------------------------------------------------------
async def test_a_send_to_a_never_registered_address_fails_at_once_with_wait_for_peer_false(cluster, driver):
    async with asyncio.timeout(20):
        start = time.monotonic()
        with pytest.raises(rlinf.PeerLostError, match="ghost:0 has never registered") as caught:
            await driver.send("boo", "ghost:0", wait_for_peer=False)
        assert time.monotonic() - start < 1.0
        assert caught.value.peer == "ghost:0"
        with pytest.raises(rlinf.PeerLostError, match="ghost:0 has never registered"):
            await driver.async_send("boo", "ghost:0", tag=3, wait_for_peer=False)
        with pytest.raises(rlinf.PeerLostError, match="ghost:0 has never registered"):
            await asyncio.to_thread(driver.blocking_send, "boo", "ghost:0", timeout=10, wait_for_peer=False)
        assert driver._sessions.get("ghost:0") is None      # no lookup is left running for it
        # a registered peer (known here or not yet) and ourselves are sent to as always
        async with cluster.connect("real:0") as real:
            await driver.send("hi", "real:0", wait_for_peer=False)
            await driver.send("me", "driver:0", wait_for_peer=False)
            assert await real.recv("driver:0", timeout=10) == "hi"
            assert await driver.recv("driver:0", timeout=10) == "me"


async def test_sends_that_wait_are_not_disturbed_by_one_that_does_not(cluster, driver):
    """The refused message is taken back; those around it, which wait for the peer
    (the default), reach it in call order once it registers."""
    async with asyncio.timeout(30):
        first = driver.async_send("first", "late:0")
        with pytest.raises(rlinf.PeerLostError, match="late:0 has never registered"):
            await driver.send("refused", "late:0", wait_for_peer=False)
        second = driver.async_send("second", "late:0")
        assert not first.done() and not second.done()
        async with cluster.connect("late:0") as late:
            assert await late.recv("driver:0", timeout=10) == "first"
            assert await late.recv("driver:0", timeout=10) == "second"
            await first
            await second
            with pytest.raises(rlinf.CommTimeoutError):
                await late.recv("driver:0", timeout=0.3)      # "refused" never came


async def test_a_timed_out_send_says_the_address_never_registered(driver):
    async with asyncio.timeout(20):
        with pytest.raises(rlinf.CommTimeoutError,
                           match=r"send to ghost:1 did not complete within 1\.0 s: ghost:1 has never registered"):
            await driver.send("boo", "ghost:1", timeout=1)
        assert driver._sessions.get("ghost:1") is None      # withdrawn: nothing waits for it now


async def test_a_send_that_waits_for_an_unknown_address_warns_once(driver, monkeypatch, caplog):
    monkeypatch.setattr(_peer, "UNREGISTERED_WARNING", 0.1)
    caplog.set_level(logging.WARNING, logger="rlinf.core.communicator")
    async with asyncio.timeout(20):
        for _ in range(2):                                   # two sessions, one after the other
            with pytest.raises(rlinf.CommTimeoutError, match="ghost:2 has never registered"):
                await driver.send("boo", "ghost:2", timeout=1)
    warnings = [r for r in caplog.records if "ghost:2" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING and warnings[0].name == "rlinf.core.communicator"
    assert "no worker with that address has registered" in warnings[0].getMessage()


class _Seen(logging.Handler):
    """Sets ``event`` when a record naming ``what`` is logged (on the loop's thread)."""

    def __init__(self, what: str) -> None:
        super().__init__(logging.WARNING)
        self.what, self.event = what, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.what in record.getMessage():
            self.event.set()


async def test_a_send_to_an_address_that_registers_later_still_succeeds(cluster, driver, monkeypatch):
    monkeypatch.setattr(_peer, "UNREGISTERED_WARNING", 0.1)
    seen = _Seen("tardy:0")
    logger = logging.getLogger("rlinf.core.communicator")
    logger.addHandler(seen)
    try:
        async with asyncio.timeout(30):
            sending = asyncio.ensure_future(driver.send("hello", "tardy:0", timeout=20))
            await seen.event.wait()          # warned that it waits; the worker then starts late
            assert not sending.done()
            async with cluster.connect("tardy:0") as tardy:
                assert await tardy.recv("driver:0", timeout=10) == "hello"
                await sending
    finally:
        logger.removeHandler(seen)


# -- RLINF_TIMEOUT ----------------------------------------------------------------------------
async def test_the_default_timeout_bounds_calls_given_none_and_an_explicit_one_wins(cluster):
    async with asyncio.timeout(60):
        async with cluster.connect("quiet:0", settings=Settings(timeout=1.0)) as quiet, \
                cluster.connect("silent:0") as silent:
            assert 0.9 <= await _took(quiet.recv("silent:0")) < 5
            assert 0.9 <= await _took(quiet.recv_any(tag=4)) < 5
            # a collective (the silent member never calls) and a channel get
            assert 0.9 <= await _took(quiet.group(["quiet:0", "silent:0"]).barrier()) < 5
            await silent.create_channel("hushed", in_process=True)
            channel = await quiet.channel("hushed")
            assert 0.9 <= await _took(channel.get()) < 5
            assert 0.9 <= await _took(channel.get_batch(max_items=4)) < 5
            # an explicit timeout wins, shorter ...
            assert await _took(quiet.recv("silent:0", timeout=0.2)) < 0.9
            assert await _took(channel.get(timeout=0.2)) < 0.9
            # ... or longer: this receive outlives the default
            patient = asyncio.ensure_future(quiet.recv("silent:0", tag=5, timeout=30))
            await _took(quiet.recv("silent:0", tag=6))          # the default passed meanwhile
            assert not patient.done()
            await silent.send("late", "quiet:0", tag=5)
            assert await patient == "late"


async def time_out_quietly(comm) -> dict[str, float]:
    """A worker started with RLINF_TIMEOUT=1 in its environment: how long its waits
    on a silent driver take when they pass no timeout (and one that passes its own)."""
    took = {}
    channel = await comm.channel("quiet")
    for name, wait in (("recv", lambda: comm.recv("driver:0")), ("get", channel.get),
                       ("explicit", lambda: comm.recv("driver:0", timeout=0.2))):
        start = time.monotonic()
        try:
            await wait()
        except rlinf.CommTimeoutError:
            took[name] = time.monotonic() - start
    await comm.send(took, "driver:0", tag=1)
    await comm.recv("driver:0", tag=2, timeout=60)           # until the driver has joined once
    return took


async def test_rlinf_timeout_in_the_environment(monkeypatch):
    """Set for the driver (its cluster, communicator and groups) and, inherited, for
    the worker it spawns."""
    monkeypatch.setenv("RLINF_TIMEOUT", "1")
    async with asyncio.timeout(90):
        async with rlinf.Cluster() as cluster, cluster.connect("driver:0") as driver:
            await driver.create_channel("quiet", in_process=True)
            group = await cluster.spawn(time_out_quietly, "quiet", 1)
            took = await driver.recv("quiet:0", tag=1, timeout=60)
            assert set(took) == {"recv", "get", "explicit"}, took
            assert 0.9 <= took["recv"] < 5 and 0.9 <= took["get"] < 5 and took["explicit"] < 0.9
            with pytest.raises(rlinf.CommTimeoutError, match=r"join of quiet did not finish within 1\.0 s"):
                await group.join()
            await driver.send("done", "quiet:0", tag=2)
            assert await group.join(timeout=60) == [took]
