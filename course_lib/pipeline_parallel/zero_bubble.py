"""Zero-bubble pipeline schedules from ``torch.distributed.pipelining`` (torch 2.13 has both; notebook 07).

The backward of a stage is two computations. The **input gradient** (I) is what the previous stage waits for;
the **weight gradient** (W) nobody waits for: it only has to be done before the optimizer step. A schedule
that splits them sends I back at once and runs W later, in what would have been the bubble.

* ``ScheduleZBVZeroBubble`` (Qi et al., "Zero Bubble Pipeline Parallelism", 2024: ZB-V) and
  ``ScheduleDualPipeV`` (DeepSeek-V3's DualPipe, in its "V" form) give each of the p ranks two stages of a
  2p-stage model, in a V: rank r holds stages r and 2p - 1 - r, so the first and the last stage sit on rank 0.
* A schedule's own plan is ``schedule.pipeline_order``: per rank, its actions in order
  (``F``, ``I``, ``W``, a full backward ``B``, or an ``OVERLAP_F_B`` of a forward and a backward together).
  :func:`actions` flattens it; :func:`play_actions` plays it on an imaginary clock, as
  :func:`.schedules.play` plays GPipe and 1F1B.

:func:`v_pipeline_worker` runs a schedule on the course's deep MLP and returns the gradients (equal to the
unsplit model's), the plan, and the step's wall clock next to the time the same work takes with no pipeline
(one rank alone): 1 - alone / step is the measured bubble. On a busy 2-core CPU that number carries the
operating system's time-slicing and torch's per-action bookkeeping (hundreds of microseconds, next to ops of
a few milliseconds), so the notebook asserts the bubble of the plan itself and prints the measured one.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .stages import make_batch, make_stage

SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def missing() -> list[str]:
    """The zero-bubble schedules this torch lacks (2.13 has both; an older torch may lack either: the notebook then
    skips them and says which)."""
    import torch.distributed.pipelining as pipelining  # takes seconds in a fresh Python: only when asked
    return [name for name in SCHEDULES.values() if not hasattr(pipelining, name)]


def v_stages(rank: int, world_size: int) -> list[int]:
    """The two stages rank ``rank`` holds in a V: ``[rank, 2p - 1 - rank]``."""
    return [rank, 2 * world_size - 1 - rank]


_OPS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}   # by name: the
# enum's values are the letters in torch 2.13, integers in older versions


def actions(order: dict) -> list[list[tuple[str, int, int]]]:
    """``schedule.pipeline_order`` as per-rank lists of ``(op, micro_batch, stage)``: op ``F``, ``I``, ``W`` or
    ``B`` (input and weight gradient together); idle slots dropped, an ``OVERLAP_F_B`` split into its parts."""
    out = []
    for rank in sorted(order):
        ops = []
        for a in order[rank]:
            for part in (a.sub_actions or ()) if a is not None and a.sub_actions else ([a] if a else []):
                kind = part.computation_type.name
                ops.append((_OPS.get(kind, kind), part.microbatch_index, part.stage_index))
        out.append(ops)
    return out


def play_actions(ranks: list[list[tuple[str, int, int]]], cost: dict | None = None) -> dict:
    """Play the ranks' actions in their order on an imaginary clock: ``F`` of stage s waits for stage s-1's;
    ``I`` and ``B`` of stage s wait for stage s+1's input gradient (``I`` or ``B``); ``W`` for its own ``I``.
    ``cost``: units per op (default F, I and W 1, B 2). Returns ``{"times": [[(op, i, stage, start, end)]],
    "bubble", "makespan"}``; a plan that cannot run raises ``RuntimeError``."""
    cost = cost or {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    last = max(s for ops in ranks for _, _, s in ops)
    done: dict[tuple, float] = {}
    cursor, free, times = [0] * len(ranks), [0.0] * len(ranks), [[] for _ in ranks]

    def needs(op, i, s):
        if op == "F":
            return [("F", i, s - 1)] if s > 0 else []
        if op in ("I", "B"):
            return [("F", i, s)] + ([("G", i, s + 1)] if s < last else [])
        return [("G", i, s)]

    while any(c < len(ops) for c, ops in zip(cursor, ranks)):
        best = None
        for r, ops in enumerate(ranks):
            if cursor[r] == len(ops):
                continue
            op, i, s = ops[cursor[r]]
            deps = needs(op, i, s)
            if all(d in done for d in deps):
                start = max([free[r]] + [done[d] for d in deps])
                if best is None or start < best[0]:
                    best = (start, r, op, i, s)
        if best is None:
            raise RuntimeError("the plan deadlocks: " + "; ".join(
                f"rank {r} waits before {ops[c][0]}{ops[c][1]} of stage {ops[c][2]}"
                for r, (c, ops) in enumerate(zip(cursor, ranks)) if c < len(ops)))
        start, r, op, i, s = best
        end = start + cost[op]
        done[(op, i, s)] = end
        if op in ("I", "B"):
            done[("G", i, s)] = end           # the input gradient, sent to stage s - 1
        free[r], cursor[r] = end, cursor[r] + 1
        times[r].append((op, i, s, start, end))
    makespan = max(free)
    busy = sum(e - a for ops in times for *_, a, e in ops)
    return {"times": times, "bubble": 1 - busy / (len(ranks) * makespan), "makespan": makespan}


def fuse_backward(ranks: list[list[tuple[str, int, int]]]) -> list[list[tuple[str, int, int]]]:
    """The same plan with each weight gradient run at once with its input gradient (``I`` + ``W`` = ``B``, where
    the ``I`` was): what the schedule would be without the split."""
    return [[("B", i, s) if op == "I" else (op, i, s) for op, i, s in ops if op != "W"] for ops in ranks]


def v_pipeline_step(rank: int, world_size: int, schedule: str = "zbv", micro_batches: int = 8, batch: int = 64,
                    width: int = 64, layers_per_stage: int = 2) -> dict:
    """Two training steps of the course's 2p-stage deep MLP with a V schedule (the second timed), then the same
    work with no pipeline. Returns this rank's gradients per stage (``{stage: [grad, ...]}``), the schedule's plan
    (:func:`actions`), the timed step's wall clock ``step`` and ``alone``, the seconds this rank's forwards and
    backwards take one after the other with nothing to wait for."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {list(SCHEDULES)}")
    if batch % micro_batches:
        raise ValueError(f"a batch of {batch} does not divide into {micro_batches} equal micro-batches")
    import torch.distributed.pipelining as pipelining

    if not hasattr(pipelining, SCHEDULES[schedule]):
        raise RuntimeError(f"this torch ({torch.__version__}) has no {SCHEDULES[schedule]}")
    torch.set_flush_denormal(True)  # tiny gradients as denormal floats make CPU arithmetic 10-100x slower
    n = 2 * world_size
    modules = {s: make_stage(s, width, layers_per_stage) for s in v_stages(rank, world_size)}
    stages = [pipelining.PipelineStage(m, s, n, torch.device("cpu")) for s, m in modules.items()]
    pipe = getattr(pipelining, SCHEDULES[schedule])(stages, n_microbatches=micro_batches, loss_fn=F.mse_loss)
    x, y = make_batch(batch, width)
    for _ in range(2):                      # a warm-up step (torch sets up its buffers), then the timed one
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == 0 else {}))
        step = time.perf_counter() - t0
    grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()}
    dist.barrier()
    t0 = time.perf_counter()                # the same forwards and backwards, nothing to wait for
    for xm in x.tensor_split(micro_batches):
        for m in modules.values():
            out = m(xm.clone().requires_grad_())
            out.backward(torch.ones_like(out))
    alone = time.perf_counter() - t0
    return {"grads": grads, "plan": actions(pipe.pipeline_order), "step": step, "alone": alone}


def v_pipeline_worker(rank: int, world_size: int, *configs: dict) -> list[dict]:
    """:func:`v_pipeline_step` for each of ``configs`` in one launch of the ranks."""
    return [v_pipeline_step(rank, world_size, **c) for c in configs]
