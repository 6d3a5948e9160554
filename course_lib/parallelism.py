"""How many processes this machine really runs at once, right now.

A speed-up from running ranks side by side is bounded by the cores the ranks actually get. On a quiet 2-core
machine two busy processes run at once (concurrency 2.0); with a browser, a build or another notebook keeping
one core busy they share what is left (about 1.3); on a machine busier still, barely 1.0. A notebook that
asserted "two ranks are at least 1.3x faster" would then fail for a reason that has nothing to do with
distributed training. So the notebooks first *measure* the concurrency available right now, and claim their
speed-ups relative to it (:func:`expected_speedup`), saying so when the machine cannot show one at all.

How it is measured: N ranks, one thread each, do the same fixed amount of arithmetic, first one rank alone
(the others wait in a barrier, which sleeps), then all N at once. If the machine runs them side by side, all
at once takes as long as one alone: concurrency = N x (time alone) / (time all at once).
"""
from __future__ import annotations

import time

SHOWABLE = 1.2   # below this, side-by-side speed-ups are lost in noise: the notebooks say so instead


def busy_work(size: int, reps: int) -> float:
    """Seconds for ``reps`` products of two size-by-size matrices: a fixed amount of arithmetic."""
    import torch
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b                                       # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return time.perf_counter() - t0


def _worker(rank: int, world_size: int, size: int, reps: int, rounds: int) -> tuple[float, float]:
    import torch.distributed as dist
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(busy_work(size, reps))
        dist.barrier()
        together.append(busy_work(size, reps))
    return min(alone) if alone else 0.0, min(together)


def concurrency(n: int = 2, size: int = 256, reps: int = 40, rounds: int = 3) -> float:
    """How many of ``n`` single-threaded busy processes this machine runs at once right now (1.0 to ``n``)."""
    from .launch import run
    results = run(_worker, n, size, reps, rounds, backend="gloo", threads=1, show_output=False)
    alone = results[0][0]
    together = max(t for _, t in results)       # all at once is done when the slowest is
    return max(1.0, min(float(n), n * alone / together))


def expected_speedup(available: float, ideal: float, processes: int = 2) -> float | None:
    """What a job of ``processes`` processes whose ideal speed-up on free cores is ``ideal`` can be expected to
    show when the machine runs ``available`` of them at once (:func:`concurrency`), with a margin for noise;
    ``None`` when the machine cannot show a speed-up right now (``available`` below :data:`SHOWABLE`).

    Interpolates between no speed-up (concurrency 1) and the ideal (concurrency = ``processes``), then keeps
    60% of the gain: timings on a shared machine move by tens of percent from one run to the next."""
    if processes < 2:
        raise ValueError(f"a speed-up needs 2 or more processes, got {processes}")
    if available < SHOWABLE:
        return None
    reachable = 1 + (ideal - 1) * min(1.0, (available - 1) / (processes - 1))
    return 1 + 0.6 * (reachable - 1)


def side_by_side(variants: dict, rounds: int, steps: int, device) -> dict:
    """Worker side of a benchmark: ``{name: median seconds a call}`` of each of ``variants`` (``name: fn()``), run on
    every rank of the process group in alternation, ``steps`` calls each, for ``rounds`` rounds. Each round starts
    at a barrier and counts the *slowest* rank's time (a step is done when every rank is), so both variants see the
    same machine, moments apart: their ratio holds on a busy one too."""
    import statistics

    import torch
    import torch.distributed as dist

    from .hardware import synchronize
    times: dict = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {name: statistics.median(t) for name, t in times.items()}
