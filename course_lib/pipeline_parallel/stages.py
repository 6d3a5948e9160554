"""Pipeline parallelism across processes: each stage its own rank, micro-batches flowing through.

:func:`pipeline_worker` runs one training step of a schedule from :mod:`.schedules` for real: stage s is
rank s, activations go forward with ``isend``/``irecv``, gradients come back the same way, and each op's
start and end are recorded on a clock all the ranks share.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..models import mlp
from .schedules import play, schedule


def make_stage(rank: int, width: int, layers_per_stage: int, seed: int = 0) -> nn.Sequential:
    """Stage ``rank`` of a deep MLP; every stage of every rank is built from the same seed schedule, so the
    stages together equal :func:`make_full_model`."""
    return mlp([width] * (layers_per_stage + 1), nn.Tanh, last_activation=True, seed=seed + rank)


def make_full_model(stages: int, width: int, layers_per_stage: int, seed: int = 0) -> nn.Sequential:
    return nn.Sequential(*[make_stage(s, width, layers_per_stage, seed) for s in range(stages)])


def make_batch(batch: int, width: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def pipeline_worker(rank: int, world_size: int, kind: str, micro_batches: int, batch: int = 64, width: int = 64,
                    layers_per_stage: int = 2, stage_fn=None) -> dict:
    """Run one training step of a ``world_size``-stage pipeline with schedule ``kind``.

    Rank s holds stage s, built by ``stage_fn(rank, width, layers_per_stage)`` (default :func:`make_stage`; pass
    your own to try unequal stages). Stage 0 reads the input, the last stage computes the loss (mean squared error
    over the whole batch: each micro-batch's loss is weighted by its share of the batch, so uneven micro-batches
    are right too). The algorithm is :func:`stage_step`; :class:`StageClock` does the rest. Returns the stage's
    gradients, what it held at most, and when each op ran: ``(op, micro_batch, stage, cpu, start, end)``, start
    and end in seconds since the moment the first rank started (``perf_counter`` is one clock for all the
    processes of a machine, so the ranks' timelines line up), ``cpu`` the CPU time the op took (less than
    end - start when the operating system gave the core to another program meanwhile).
    """
    stage = (stage_fn or make_stage)(rank, width, layers_per_stage)
    x, y = make_batch(batch, width)
    xs, ys = x.tensor_split(micro_batches), y.tensor_split(micro_batches)
    clock = StageClock(rank, stage, xs)
    peak = stage_step(stage, schedule(kind, world_size, micro_batches)[rank], rank, world_size, xs, ys, clock=clock)
    total = clock.total()
    return {"grads": [p.grad.clone() for p in stage.parameters()], "peak_in_flight": peak,
            "timeline": clock.timeline(), "total": total}


def stage_step(stage: nn.Module, ops: list, rank: int, world_size: int, xs, ys, comm=dist, clock=None) -> int:
    """One training step of stage ``rank``: its ``ops`` (``("F", i)``, ``("B", i)``) in order; returns the most
    micro-batches whose activations it held at once. ``xs``, ``ys``: the micro-batches (the first stage reads
    ``xs``, the last ``ys``). ``comm`` sends and receives (``torch.distributed``, or anything with its
    ``isend``/``irecv``); ``clock(op, i)``, a context manager, times each forward and backward (see
    :class:`StageClock`)."""
    clock = clock or (lambda op, i: contextlib.nullcontext())
    first, last = rank == 0, rank == world_size - 1
    batch = sum(len(y) for y in ys)
    # Post every receive at once: each message then lands while this stage is busy with something else
    # (messages between two ranks arrive in the order they were sent).
    acts = {i: torch.empty_like(xs[i]) for op, i in ops if op == "F"} if not first else {}
    grads = {i: torch.empty_like(xs[i]) for op, i in ops if op == "B"} if not last else {}
    pending = {("F", i): comm.irecv(acts[i], src=rank - 1) for i in acts}
    pending.update({("B", i): comm.irecv(grads[i], src=rank + 1) for i in grads})
    inputs, outputs, sends = {}, {}, []
    held = peak = 0
    for op, i in ops:
        if op == "F":
            if first:   # its input gets a gradient too, only so that every stage does equal work
                inp = xs[i].clone().requires_grad_()
            else:
                pending.pop(("F", i)).wait()
                inp = acts.pop(i).requires_grad_()
            with clock("F", i):
                out = stage(inp)
            inputs[i], outputs[i] = inp, out
            held += 1
            peak = max(peak, held)
            if not last:
                sends.append(comm.isend(out.detach(), dst=rank + 1))
        else:
            if last:    # the loss of micro-batch i, weighted by its share of the batch (1/m for equal ones)
                with clock("B", i):
                    (F.mse_loss(outputs[i], ys[i]) * len(ys[i]) / batch).backward()
            else:
                pending.pop(("B", i)).wait()
                with clock("B", i):
                    outputs[i].backward(grads.pop(i))
            if not first:
                sends.append(comm.isend(inputs[i].grad, dst=rank - 1))
            del inputs[i], outputs[i]  # this micro-batch's activations can go
            held -= 1
    for s in sends:
        s.wait()
    return peak


class StageClock:
    """What :func:`pipeline_worker` does around :func:`stage_step`, so that the step measures the schedule.

    Made before the step: it flushes denormal floats to zero (tiny gradients as denormals make CPU arithmetic
    10-100x slower), warms the stage up (the first backward of a shape is slow: kernel set-up), and starts the
    clock after a barrier. Called as ``clock(op, i)`` it is a context manager that notes the op's CPU time
    (``time.thread_time``) and its start and end on the wall clock; :meth:`timeline` counts them from the
    earliest rank's start (a collective: every rank calls it)."""

    def __init__(self, rank: int, stage: nn.Module, xs) -> None:
        torch.set_flush_denormal(True)
        for size in sorted({len(b) for b in xs}):
            out = stage(torch.randn(size, xs[0].shape[1], requires_grad=True))
            out.backward(torch.randn_like(out))
        stage.zero_grad(set_to_none=True)
        self.rank, self.ops = rank, []
        dist.barrier()
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, op: str, i: int):
        cpu, start = time.thread_time(), time.perf_counter() - self.t0
        yield
        self.ops.append((op, i, self.rank, time.thread_time() - cpu, start, time.perf_counter() - self.t0))

    def total(self) -> float:
        return time.perf_counter() - self.t0

    def timeline(self) -> list[tuple]:
        shift = shift_to_common_origin(self.t0)
        return [(op, i, s, cpu, a + shift, b + shift) for op, i, s, cpu, a, b in self.ops]


def shift_to_common_origin(t0: float) -> float:
    """What to add to this rank's times (seconds since its own ``t0``) to count them from the earliest rank's
    ``t0``: ``perf_counter`` is one clock for all the processes of a machine, so the timelines then line up.
    A collective: every rank calls it."""
    start = torch.tensor([t0], dtype=torch.float64)
    dist.all_reduce(start, op=dist.ReduceOp.MIN)
    return t0 - start.item()


def measured_bubble(results: list[dict]) -> float:
    """Idle share of the pipeline: 1 - (time spent computing) / (ranks x wall time), from real timelines (each
    rank's ``timeline`` holds ops whose last two fields are their start and end)."""
    busy = sum(op[-1] - op[-2] for r in results for op in r["timeline"])
    return 1 - busy / (len(results) * measured_makespan(results))


def measured_makespan(results: list[dict]) -> float:
    """Seconds from the first op's start on any rank to the last op's end on any rank (the wall clock)."""
    start = min(op[-2] for r in results for op in r["timeline"])
    return max(op[-1] for r in results for op in r["timeline"]) - start


UNDISTURBED = 1.2   # ops that took at most this times their CPU time ran nearly undisturbed


def stretch(results: list[dict]) -> float:
    """The ops' wall-clock time over the CPU time they used: 1.0 when nothing else wanted the cores; about 1.5 when
    two stages share two cores with one other busy program (time-slicing); more on a busier machine. Above
    :data:`UNDISTURBED` a timeline shows the operating system's time-slicing as much as the schedule: a stage
    waits for a neighbour the operating system has set aside for a few milliseconds, or computes while the
    neighbour's ops are stretched."""
    wall = sum(op[-1] - op[-2] for r in results for op in r["timeline"])
    return wall / sum(op[3] for r in results for op in r["timeline"])


def typical_costs(results: list[dict]) -> dict[tuple[str, int], float]:
    """``{(op, stage): cost}``: the median CPU time of the ops of each kind (forward or backward) on each stage.

    One op slowed by another program does not move it; a slower stage does. Two processes computing at once can
    slow each other's ops a lot: on the course's idle 2-core machine an op that ran while the other rank computed
    could take ~2x the CPU time of one that ran alone."""
    costs: dict[tuple[str, int], list[float]] = {}
    for r in results:
        for op, _, s, cpu, _, _ in r["timeline"]:
            costs.setdefault((op, s), []).append(cpu)
    return {key: statistics.median(values) for key, values in costs.items()}


def rank_imbalance(results: list[dict]) -> float:
    """How much more compute the busiest rank has than the least busy one in :func:`replayed` (its ops at their
    :func:`typical_costs`), as a fraction (0.1: 10% more).

    The bubble formulas assume equal stages. A rank whose ops take longer keeps its neighbour waiting; in the
    course's 2-stage runs that added up to about half the imbalance to the idle time (as a share of the compute
    time). Stages equal in work can still measure unequal, because two processes computing at once slow each other
    and not always evenly: up to 25% on the course's idle 2-core machine with ops of 20 ms and more, a few percent
    when a third program time-slices them, with 4 or more ops per stage (one op can be 40% off): see
    :func:`most_balanced`."""
    typical = typical_costs(results)
    per_rank = [sum(typical[op, s] for op, _, s, *_ in r["timeline"]) for r in results]
    if not per_rank or min(per_rank) <= 0:
        raise ValueError("rank_imbalance needs every rank's timeline with its ops' CPU times (op[3] > 0)")
    return max(per_rank) / min(per_rank) - 1


BALANCED = 0.3   # ranks of equal stages whose CPU times differ more than this measured the machine, not the schedule


def most_balanced(attempt, tries: int = 3, imbalance=rank_imbalance) -> tuple:
    """Call ``attempt()`` (a real run) until ``imbalance`` of what it returns is below :data:`BALANCED`, at most
    ``tries`` runs in all; return ``(results, imbalance, imbalances)``: the most balanced run's results and
    imbalance, and every run's imbalance in the order measured (``len(imbalances)`` runs were made).

    A measurement repeated, as a benchmark is, not a bug retried: equal stages measure unequal when the machine
    slows one rank more than the other. Two processes computing at once slow each other, not always evenly: on the
    course's idle 2-core machine one rank of :func:`pipeline_worker` came out up to 25% slower with ops of 20 ms and
    more, and up to 64% with ops of 1 ms (30 runs each); with a third program time-slicing both, a few percent.
    The check of the returned imbalance catches stages that differ a lot (one twice as deep measures about 100%
    more in every run), not an imbalance near :data:`BALANCED`: one run of 3 below it passes."""
    if tries < 1:
        raise ValueError(f"most_balanced needs tries >= 1, got {tries}")
    best, imbalances = None, []
    for _ in range(tries):
        results = attempt()
        imbalances.append(imbalance(results))
        if best is None or imbalances[-1] < best[1]:
            best = (results, imbalances[-1])
        if imbalances[-1] < BALANCED:
            break
    return best[0], best[1], imbalances


def replayed(results: list[dict], typical: bool = True) -> dict:
    """The ranks' ops, in the order they ran, played again (:func:`.schedules.play`) with messages free and each
    op lasting the CPU time it needed: the bubble the schedule itself leaves for these ops' real costs, without what
    the wall clock adds (messages, overheads, and time-slicing on a busy machine).

    With ``typical`` (the default) an op costs its stage's :func:`typical_costs` (the median of its kind); with
    ``typical=False`` each op costs its own CPU time. No real run can be shorter than that second replay: each op
    took at least its CPU time on the wall clock, and messages only add."""
    costs = typical_costs(results)
    stages = 1 + max(s for _, s in costs)
    return play([[(op, i, s, costs[op, s] if typical else cpu) for op, i, s, cpu, *_ in r["timeline"]]
                 for r in results], stages)


def replay_tolerance(imbalance: float) -> float:
    """How far a replayed bubble may stray from the formula: 0.04 plus half the ranks' :func:`rank_imbalance`.

    The formula assumes equal stages. Ours are equal in work, but two processes computing at once slow each other,
    not always evenly; a rank whose ops take longer keeps its neighbour waiting, which in the course's 2-stage runs
    added about half the imbalance to the idle time (in 50 runs the replay stayed within 0.022 + half of it)."""
    return 0.04 + imbalance / 2


def wall_tolerance(imbalance: float) -> float:
    """How far a wall-clock bubble of a nearly undisturbed run (:func:`stretch` at most :data:`UNDISTURBED`) may
    stray from the formula: 0.1 plus half the imbalance. The wall clock adds what the replay leaves out: the
    messages and the bookkeeping between ops."""
    return 0.1 + imbalance / 2


def bubble_sweep(micro_batches=(1, 2, 4, 8), repeats: int = 2, kind: str = "1f1b", batch: int = 4096,
                 width: int = 512, layers_per_stage: int = 8) -> list[dict]:
    """Run :func:`pipeline_worker` on 2 processes (one thread each) ``repeats`` times for each m in
    ``micro_batches`` and measure each run: a list of ``{"m", "wall", "replayed", "stretch", "imbalance",
    "total", "timeline"}`` (the wall-clock bubble :func:`measured_bubble`, the bubble :func:`replayed` at the ops'
    CPU times, :func:`stretch`, :func:`rank_imbalance`, the step's seconds, the ranks' timelines).

    Why two bubbles: on a busy machine other programs take turns on the cores (time-slicing). Say one keeps one
    of the two cores busy. While both stages compute, three programs share two cores and each op takes 1.5x as
    long; while one stage computes alone (the ramps), nothing is stretched. The busy part grows, the idle part
    does not, and the wall-clock bubble comes out *below* the formula; on a machine busier still a stage also
    waits for a neighbour that is not running at all, and it comes out above. The CPU time of each op
    (``time.thread_time``) is untouched by that: :func:`replayed` plays the ops again with those costs and free
    messages, the bubble the schedule itself leaves. Each run with 4 or more micro-batches is repeated while its
    ranks differ by :data:`BALANCED` or more (:func:`most_balanced`, at most 3 runs), so that one rank slowed by
    the machine does not pass for a schedule's bubble."""
    from ..launch import run

    runs = []
    for _ in range(repeats):
        for m in micro_batches:
            def step(m=m):
                return run(pipeline_worker, 2, kind, m, batch, width, layers_per_stage, backend="gloo", threads=1,
                           show_output=False)
            res, imbalance, _ = most_balanced(step, tries=3 if m >= 4 else 1)
            runs.append({"m": m, "wall": measured_bubble(res), "replayed": replayed(res)["bubble"],
                         "stretch": stretch(res), "imbalance": imbalance, "total": max(r["total"] for r in res),
                         "timeline": [r["timeline"] for r in res]})
    return runs
