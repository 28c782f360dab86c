"""A producer that puts and leaves at once: a clean close delivers every put it made
(DESIGN.md §4: a clean close delivers what was handed over, channel puts included)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from . import workers_channel as wc

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("close", [False, True], ids=["returns", "acloses"])
@pytest.mark.parametrize("size,n", [(8, 100), (200 << 10, 40), (4 << 20, 6)], ids=["small", "200KB", "4MiB"])
async def test_puts_made_just_before_a_clean_exit_all_arrive(cluster, driver, size, n, close):
    name = f"exit-{size}-{int(close)}"
    async with asyncio.timeout(90):
        ch = await driver.create_channel(name)
        producer = await cluster.spawn(wc.put_and_leave, "prod", 1, args=(name, n, size, close))
        assert await producer.join(timeout=60) == [n]
        got = []
        while len(got) < n:
            got.extend(await ch.get_batch(timeout=10))
    assert [item["i"] for item in got] == list(range(n))
    for item in got:
        assert item["data"].nbytes == size and int(item["data"][0]) == item["i"] % 251
