"""Forward + backward time of the from-scratch tensor-parallel MLP against ``parallelize_module``'s, side by side.

Goal: the from-scratch MLP block (column-parallel ``up``, row-parallel ``down``, ``f`` and ``g``) takes at most
1.2x the time of the same block split by ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``) on 2
ranks. Both are built from one full MLP in the same process group and alternate, a few steps each, for
``--rounds`` rounds; medians are compared. NCCL where every rank has its own GPU, Gloo on the CPU otherwise.

    python benchmarks/tp_vs_dtensor.py [--ranks 2] [--rounds 15] [--dim 512] [--tokens 1024]

``--tokens`` is a multiple of 128 (the batch is ``tokens // 128`` sequences of 128).
"""
import argparse
import copy
import functools

import torch

from course_lib import hardware
from course_lib.launch import run
from course_lib.parallelism import side_by_side

GOAL = 1.2


def worker(rank, world_size, dim, tokens, rounds, steps):
    """Median seconds of one forward + backward of each version of the MLP block (rank 0's view)."""
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.models import MLP
    from course_lib.tensor_parallel import ParallelMLP
    from course_lib.tensor_parallel.dtensor import local, mlp_plan, parallelize

    device = hardware.rank_device()
    torch.manual_seed(0)
    full = MLP(dim, 4 * dim).to(device)
    versions = {"from scratch": ParallelMLP(full),
                "parallelize_module": parallelize(copy.deepcopy(full), init_device_mesh(device.type, (world_size,)),
                                                  mlp_plan())}
    x = torch.randn(tokens // 128, 128, dim, device=device, requires_grad=True)

    def step(model):
        local(model(x)).sum().backward()

    for model in versions.values():   # warm-up: allocations, connections, DTensor's sharding caches
        for _ in range(2):
            step(model)
    return side_by_side({name: functools.partial(step, model) for name, model in versions.items()}, rounds, steps,
                        device)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args()
    if a.tokens < 128 or a.tokens % 128:
        p.error(f"--tokens must be a positive multiple of 128 (sequences of 128 tokens), got {a.tokens}")
    if a.dim < 1 or a.ranks < 1 or a.rounds < 1 or a.steps < 1:
        p.error("--dim, --ranks, --rounds and --steps must be at least 1")
    print(hardware.summary().splitlines()[0])
    backend = hardware.default_backend(a.ranks)
    t = run(worker, a.ranks, a.dim, a.tokens, a.rounds, a.steps, backend=backend, show_output=False)[0]
    ratio = t["from scratch"] / t["parallelize_module"]
    print(f"{a.ranks} ranks ({backend}), MLP {a.dim} -> {4 * a.dim} -> {a.dim}, {a.tokens} tokens, "
          f"median of {a.rounds} rounds of {a.steps} steps")
    for name, seconds in t.items():
        print(f"  {name:18}: {seconds * 1e3:7.2f} ms per forward + backward")
    print(f"ratio from scratch / parallelize_module = {ratio:.2f}x "
          f"(goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
