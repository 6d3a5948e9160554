"""Every collective, twice: what it *means* (plain Python) and what ``torch.distributed`` does (a demo).

:func:`expected` is the reference meaning of each collective, written over plain lists so it can be
read in one sitting; the ``*_demo`` functions run the real ``torch.distributed`` call on each rank and
return what that rank held before and after.  The tests (and notebook 01) check that the two agree
for every collective and world size, so the pictures drawn from :func:`expected` are the truth.

Conventions: rank ``r``'s element ``i`` starts as ``10*r + i + 1``, so every starting value says
where it came from (``23`` is rank 2's third element).  ``None`` after a collective means "this rank
gets no result": read it and you read whatever the library left there (for ``reduce``, Gloo leaves
partial sums in the other ranks' buffers).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

ROOT = 0  # the source of broadcast/scatter and the destination of reduce/gather in the demos
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter",
               "all_to_all", "barrier")


def initial(name: str, rank: int, world_size: int) -> list[float]:
    """What ``rank`` holds before collective ``name``."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: choose one of {', '.join(COLLECTIVES)}")
    if name in ("broadcast", "reduce", "all_reduce"):
        length = 3
    elif name == "scatter":
        length = world_size if rank == ROOT else 0  # only the root has data to hand out
    elif name in ("gather", "all_gather"):
        length = 1
    elif name in ("reduce_scatter", "all_to_all"):
        length = world_size  # one element destined for each rank
    else:
        length = 0  # barrier moves no data
    return [float(10 * rank + i + 1) for i in range(length)]


def expected(name: str, before: list[list[float]]) -> list[list[float] | None]:
    """What each rank holds after collective ``name``, given what each held before (sum for reductions)."""
    n = len(before)
    column_sums = [sum(col) for col in zip(*before)] if before and before[0] else []
    if name == "broadcast":
        return [list(before[ROOT]) for _ in range(n)]
    if name == "reduce":
        return [column_sums if r == ROOT else None for r in range(n)]
    if name == "all_reduce":
        return [list(column_sums) for _ in range(n)]
    if name == "scatter":
        return [[before[ROOT][r]] for r in range(n)]
    if name == "gather":
        return [[x for b in before for x in b] if r == ROOT else None for r in range(n)]
    if name == "all_gather":
        return [[x for b in before for x in b] for _ in range(n)]
    if name == "reduce_scatter":
        return [[column_sums[r]] for r in range(n)]
    if name == "all_to_all":
        return [[before[src][r] for src in range(n)] for r in range(n)]  # a transpose
    if name == "barrier":
        return [[] for _ in range(n)]
    raise ValueError(f"unknown collective {name!r}: choose one of {', '.join(COLLECTIVES)}")


def _start(name, rank, world_size):
    return torch.tensor(initial(name, rank, world_size))


def broadcast_demo(rank, world_size):
    x = _start("broadcast", rank, world_size)
    before = x.tolist()
    dist.broadcast(x, src=ROOT)                 # every rank's x becomes ROOT's x
    return before, x.tolist()


def reduce_demo(rank, world_size):
    x = _start("reduce", rank, world_size)
    before = x.tolist()
    dist.reduce(x, dst=ROOT, op=dist.ReduceOp.SUM)  # only ROOT's x is defined afterwards
    return before, x.tolist() if rank == ROOT else None


def all_reduce_demo(rank, world_size):
    x = _start("all_reduce", rank, world_size)
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)    # every rank's x becomes the element-wise sum
    return before, x.tolist()


def scatter_demo(rank, world_size):
    x = _start("scatter", rank, world_size)
    before = x.tolist()
    out = torch.empty(1)
    chunks = list(x.chunk(world_size)) if rank == ROOT else None  # only the source passes a list
    dist.scatter(out, scatter_list=chunks, src=ROOT)
    return before, out.tolist()


def gather_demo(rank, world_size):
    x = _start("gather", rank, world_size)
    before = x.tolist()
    bucket = [torch.empty(1) for _ in range(world_size)] if rank == ROOT else None
    dist.gather(x, gather_list=bucket, dst=ROOT)
    return before, torch.cat(bucket).tolist() if rank == ROOT else None


def all_gather_demo(rank, world_size):
    x = _start("all_gather", rank, world_size)
    before = x.tolist()
    bucket = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(bucket, x)                  # every rank receives every rank's x
    return before, torch.cat(bucket).tolist()


def reduce_scatter_demo(rank, world_size):
    x = _start("reduce_scatter", rank, world_size)
    before = x.tolist()
    out = torch.empty(1)
    dist.reduce_scatter(out, list(x.chunk(world_size)), op=dist.ReduceOp.SUM)  # rank r: sum of chunk r
    return before, out.tolist()


def all_to_all_demo(rank, world_size):
    x = _start("all_to_all", rank, world_size)
    before = x.tolist()
    out = torch.empty(world_size)
    # chunk j of x goes to rank j, and chunk i of out comes from rank i: a transpose. The list form,
    # dist.all_to_all(out_list, in_list), does the same, but Gloo in torch 2.11 lacks it; this one
    # runs on Gloo and NCCL alike.
    dist.all_to_all_single(out, x)
    return before, out.tolist()


def barrier_demo(rank, world_size, delay: float = 0.15):
    """Rank r arrives ``r * delay`` seconds late; nobody leaves before the last one arrives.

    Times are ``time.perf_counter()`` readings: one clock for every process of a machine, so the ranks' arrivals
    and departures compare directly (the caller subtracts the earliest)."""
    dist.barrier()                              # line everyone up
    time.sleep(rank * delay)
    arrive = time.perf_counter()
    dist.barrier()
    return arrive, time.perf_counter()


DEMOS = {name: globals()[f"{name}_demo"] for name in COLLECTIVES if name != "barrier"}


def compare(name: str, results: list[tuple[list, list | None]]) -> list[list[float] | None]:
    """Check a demo's results (one ``(before, after)`` per rank) against :func:`expected`.

    Returns the expected state; raises ``AssertionError`` naming the first rank that disagrees.
    """
    before = [b for b, _ in results]
    want = expected(name, before)
    for rank, ((_, got), exp) in enumerate(zip(results, want)):
        if got != exp:
            raise AssertionError(f"{name}: rank {rank} holds {got}, the reference says {exp}")
    return want
