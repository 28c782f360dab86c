"""One program, twice: torch_dist.py uses torch.distributed, torch_port_rlinf.py uses rlinf.

The two files differ in two lines (``diff examples/torch_dist.py examples/torch_port_rlinf.py``):
the import, and ``init_process_group`` -> ``rlinf.init()``. Everything else -- all_reduce,
broadcast, send/recv, gather, all_to_all, barrier -- is the same code on the same tensors.

Run:  torchrun --nproc-per-node 3 examples/torch_port_rlinf.py
 or:  python examples/torch_port_rlinf.py --local 3     (no torchrun: examples/local_launch.py)
(and the same for examples/torch_dist.py)
"""

import sys

import torch
import rlinf


def main() -> None:
    dist = rlinf.init()
    rank, world = dist.get_rank(), dist.get_world_size()

    grad = torch.full((4,), float(rank + 1))
    dist.all_reduce(grad)                                      # sum, in place
    assert grad.tolist() == [world * (world + 1) / 2] * 4

    weights = torch.arange(6.0) if rank == 0 else torch.zeros(6)
    dist.broadcast(weights, src=0)                             # rank 0's, everywhere
    assert weights.tolist() == list(range(6))

    right, left = (rank + 1) % world, (rank - 1) % world       # a ring of send/recv
    inbox = torch.empty(3)
    request = dist.isend(torch.full((3,), float(rank)), right)
    dist.recv(inbox, src=left)
    request.wait()
    assert inbox.tolist() == [float(left)] * 3

    parts = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), parts, dst=0)
    if rank == 0:
        assert [p[0].item() for p in parts] == list(range(world))

    outputs = [torch.empty(1) for _ in range(world)]
    dist.all_to_all(outputs, [torch.tensor([10.0 * rank + j]) for j in range(world)])
    assert [o.item() for o in outputs] == [10.0 * i + rank for i in range(world)]

    dist.barrier()
    print(f"rank {rank}/{world}: all collectives ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--local":       # no torchrun: fake its environment
        from local_launch import launch
        sys.exit(launch(__file__, int(sys.argv[2])))
    main()
