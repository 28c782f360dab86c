"""A seeded storm of gets given up against a ledger: consumers whose tasks share a handle
issue get / get_batch / async_get (acked or not), some with tiny timeouts, some cancelled
at random moments, while items are put. Once the channel is closed and drained, every
item was returned exactly once: none lost, none taken twice. (Put order is not checked:
gets given up while their answers are on their way may reorder a consumer's items, as
docs/channel.md says.)"""

from __future__ import annotations

import asyncio
import random

import pytest

from rlinf import CommTimeoutError, EndOfChannel

from .test_channel import comms  # noqa: F401 (a fixture)

pytestmark = pytest.mark.multiproc

_ITEMS = 120


async def _consume(c, rng: random.Random, ledger: list, tasks: int) -> None:
    """``tasks`` tasks of consumer ``c`` take items into ``ledger`` until EndOfChannel."""
    async def one() -> None:
        while True:
            kind, ack = rng.random(), rng.random() < 0.3
            timeout = rng.choice([None, 0, 0.001, 0.003, 0.02, 1.0])
            try:
                if kind < 0.4:
                    work = asyncio.ensure_future(c.get(timeout=timeout, ack=ack))
                elif kind < 0.75:
                    work = asyncio.ensure_future(
                        c.get_batch(max_items=rng.choice([None, 1, 2, 5]), timeout=timeout, ack=ack))
                else:
                    work = c.async_get(ack=ack)       # a Work, cancelled itself
                if rng.random() < 0.3:                # given up at a random moment
                    for _ in range(rng.randrange(4)):
                        await asyncio.sleep(0)
                    if rng.random() < 0.5:
                        await asyncio.sleep(rng.random() * 0.004)
                    work.cancel()
                try:
                    got = await work
                except asyncio.CancelledError:
                    if not work.cancelled():
                        raise
                    continue
                except CommTimeoutError:
                    continue
            except EndOfChannel:
                return
            items = got if isinstance(got, list) else [got]
            ledger.extend(items)
            if ack:
                c.task_done(*items)
            await asyncio.sleep(rng.random() * 0.004)      # its work

    await asyncio.gather(*(one() for _ in range(tasks)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy,stealing", [("fifo", None), ("performance_aware", True),
                                             ("performance_aware", False)])
async def test_a_storm_of_gets_given_up_loses_and_duplicates_nothing(driver, comms, seed, policy, stealing):
    async with asyncio.timeout(60):
        rng = random.Random(seed)
        options = {} if stealing is None else {"work_stealing": stealing}
        name = f"storm-{policy[:4]}-{stealing}-{seed}"
        ch = await driver.create_channel(name, policy=policy, in_process=True, **options)
        handles = [await comm.channel(name, speed=50.0 * (i + 1)) for i, comm in enumerate(await comms(2))]
        ledger: list = []
        consumers = [asyncio.ensure_future(_consume(c, random.Random(seed * 31 + i), ledger, 3))
                     for i, c in enumerate(handles)]
        try:
            for i in range(_ITEMS):
                await ch.put(i, weight=rng.choice([0.2, 0.5, 1.0, 2.0]))
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.random() * 0.01)     # bursts and pauses
            await ch.close()
            await asyncio.gather(*consumers)
        finally:
            for task in consumers:
                task.cancel()
        duplicated = sorted({x for x in ledger if ledger.count(x) > 1})
        assert not duplicated and sorted(set(ledger)) == list(range(_ITEMS)), (duplicated, len(ledger))
