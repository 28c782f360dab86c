"""Rehearse a multi-node job on one machine: workers with different RLINF_NODE_ID.

rlinf treats workers with the same node id as one node (stream sockets, shared memory)
and the others as remote (TCP). Giving two groups different ``RLINF_NODE_ID`` values
makes them talk as if they ran on two machines, so cross-node paths can be tried on a
laptop. Each worker swaps an array with its same-"node" neighbour and with its peer on
the other "node"; the controller then shows the route rlinf picks for each pair.

Run:  python examples/multi_node.py
On real machines, see docs/deployment.md (standalone manager, RLINF_MANAGER/RLINF_TOKEN).
"""

import asyncio

import numpy as np

import rlinf
from rlinf.routing import select_transport


DATA = np.arange(256 * 1024, dtype=np.float32)             # 1 MiB


async def worker(comm, here: str, there: str):
    rank = int(comm.address.split(":")[1])
    neighbour, remote = f"{here}:{1 - rank}", f"{there}:{rank}"
    await asyncio.gather(comm.send(DATA, neighbour), comm.send(DATA, remote))
    for src in (neighbour, remote):
        assert np.array_equal(await comm.recv(src, timeout=60), DATA)
    return comm.info                                        # node id, host, endpoints...


async def main() -> None:
    async with rlinf.Cluster() as cluster:
        groups = [await cluster.spawn(worker, here, n=2, args=(here, there), env={"RLINF_NODE_ID": here})
                  for here, there in (("nodeA", "nodeB"), ("nodeB", "nodeA"))]
        infos = [info for group in groups for info in await group.join(timeout=120)]
        for src in infos:
            for dst in infos:
                if src is not dst:
                    route = select_transport(src, dst, DATA)
                    print(f"{src.address} ({src.node_id}) -> {dst.address} ({dst.node_id}): "
                          f"{route.transport} over {route.scheme}")


if __name__ == "__main__":
    asyncio.run(main())
