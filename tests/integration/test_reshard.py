"""M->N batch resharding between real processes: uneven shards, nested structures,
workers that are both sources and destinations, another batch dimension."""

from __future__ import annotations

import asyncio

import pytest

from . import workers_coll

pytestmark = pytest.mark.multiproc


async def test_reshard_m_to_n(cluster, driver):
    async with asyncio.timeout(120):
        group = await cluster.spawn(workers_coll.reshard_cases, "rs", 3)
        mine = await workers_coll.reshard_cases(driver)
        theirs = await group.join(timeout=60)
        names = [name for name, *_ in workers_coll.RESHARD_CASES]
        assert mine == ["4->2", "2->3", "2->3 short"]        # driver:0 is not in "3->3"
        assert sorted({n for done in theirs for n in done}) == sorted(names)
        assert theirs[0] == names                       # rs:0 takes part in every case
