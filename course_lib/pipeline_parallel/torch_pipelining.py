"""PyTorch's own pipeline parallelism, ``torch.distributed.pipelining``, on the course's stages (notebook 07).

What :func:`.stages.pipeline_worker` does by hand, torch packages in two pieces:

* a :class:`~torch.distributed.pipelining.PipelineStage` wraps the module of one stage, knows its index
  and the number of stages, and sends activations and gradients to its neighbours (it infers the shapes
  from the first micro-batch);
* a *schedule* runs a training step over the micro-batches: :class:`ScheduleGPipe` and
  :class:`Schedule1F1B` with one stage per rank, :class:`ScheduleInterleaved1F1B` with ``v`` stages per
  rank (rank r holds stages r, r + p, r + 2p...: the model goes round the ranks v times, so each op is v
  times shorter and the bubble v times smaller: (p - 1) / (v m) of the compute time instead of (p - 1) / m).

``step(x)`` on the first stage's rank, ``step(target=y)`` on the last one's, ``step()`` elsewhere. The loss
``loss_fn(output, target)`` is computed per micro-batch; with ``scale_grads=True`` (the default) the schedule
divides the accumulated gradients by the number of micro-batches m. With a mean loss and a batch that
divides into m equal micro-batches that is the gradient of the whole batch's mean loss, the one
``pipeline_worker`` computes (it weights each micro-batch by its share of the batch); with
``scale_grads=False`` the gradients are m times larger.

To see who computed when, each stage's module is wrapped in :class:`Timed`: it notes the start and end of
every forward, and two autograd markers note when the backward of a micro-batch reaches the stage's
output (its start) and its input (its end), on the clocks :func:`.stages.pipeline_worker` uses (the wall
clock, and the CPU time the op really used).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .stages import make_batch, make_stage, shift_to_common_origin

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class _Mark(torch.autograd.Function):
    """Identity whose backward notes the time (the backward of a micro-batch passing this point)."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


class Timed(nn.Module):
    """``inner`` with every forward and backward noted in ``log`` as ``(op, micro_batch, stage, cpu, start, end)``:
    start and end on the wall clock (seconds since ``t0[0]``), ``cpu`` the seconds of CPU time this thread spent
    in it (less than end - start when the operating system gave the core to another program meanwhile)."""

    def __init__(self, inner: nn.Module, stage: int, log: list, t0: list):
        super().__init__()
        self.inner, self.stage, self.log, self.t0, self.count = inner, stage, log, t0, 0

    def forward(self, x):
        i, self.count = self.count, self.count + 1             # the micro-batch: the schedule runs them in order
        start = self._now()
        backward: dict = {}
        if not x.requires_grad:   # the first stage: its input gets a gradient too, only so that every stage does
            x = x.detach().requires_grad_()       # equal work (as in pipeline_worker), and the end of B is noted
        x = _Mark.apply(x, lambda: self._note_backward(i, backward, "end"))
        out = _Mark.apply(self.inner(x), lambda: self._note_backward(i, backward, "start"))
        self._note("F", i, start, self._now())
        return out

    def _now(self) -> tuple[float, float]:
        return time.thread_time(), time.perf_counter() - self.t0[0]

    def _note(self, op: str, i: int, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.log.append((op, i, self.stage, end[0] - start[0], start[1], end[1]))

    def _note_backward(self, i: int, backward: dict, which: str) -> None:
        backward[which] = self._now()     # on a CPU, autograd runs the backward on the thread that called it
        if which == "end":
            self._note("B", i, backward["start"], backward["end"])


def stage_indices(rank: int, world_size: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``rank`` holds: ``rank, rank + p, rank + 2p, ...`` (p = ``world_size``)."""
    return [rank + k * world_size for k in range(stages_per_rank)]


def torch_pipeline_step(rank: int, world_size: int, schedule: str = "1f1b", micro_batches: int = 4,
                        batch: int = 64, width: int = 64, layers_per_stage: int = 2, stages_per_rank: int = 1,
                        scale_grads: bool = True) -> dict:
    """Two training steps of the course's deep MLP with one of torch's schedules; the second is timed.

    The model is :func:`.stages.make_full_model` with ``world_size * stages_per_rank`` stages, so its gradients
    can be compared with ``pipeline_worker``'s and the unsplit model's. The first step is a warm-up (torch
    infers the shapes and sets up its buffers then); its gradients are dropped. Returns this rank's gradients per
    stage (``{stage: [grad, ...]}``), the per-micro-batch losses (on the last stage's rank), and the timeline of
    the second step: ``(op, micro_batch, stage, cpu, start, end)`` (:class:`Timed`), start and end in seconds from
    the earliest rank's start.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {list(SCHEDULES)}")
    if schedule != "interleaved" and stages_per_rank != 1:
        raise ValueError(f"{schedule} runs one stage per rank; stages_per_rank={stages_per_rank} needs 'interleaved'")
    if batch % micro_batches:
        raise ValueError(f"a batch of {batch} does not divide into {micro_batches} equal micro-batches: torch's "
                         "gradient scaling (1/m) is the batch mean only for equal micro-batches")
    import torch.distributed.pipelining as pipelining  # here: in a fresh Python (a kernel) it takes seconds

    torch.set_flush_denormal(True)  # tiny gradients as denormal floats make CPU arithmetic 10-100x slower
    n_stages = world_size * stages_per_rank
    log: list = []
    t0 = [time.perf_counter()]
    modules = {s: make_stage(s, width, layers_per_stage) for s in stage_indices(rank, world_size, stages_per_rank)}
    stages = [pipelining.PipelineStage(Timed(m, s, log, t0), s, n_stages, torch.device("cpu"))
              for s, m in modules.items()]
    kind = getattr(pipelining, SCHEDULES[schedule])
    kwargs = {"n_microbatches": micro_batches, "loss_fn": F.mse_loss, "scale_grads": scale_grads}
    pipe = kind(stages, **kwargs) if schedule == "interleaved" else kind(stages[0], **kwargs)
    x, y = make_batch(batch, width)
    first, last = 0 in modules, n_stages - 1 in modules
    losses: list = []
    for _ in range(2):                          # a warm-up step, then the step that counts
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        for t in stages:
            t.submod.count = 0
        log.clear()
        dist.barrier()
        t0[0] = time.perf_counter()
        pipe.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
    shift = shift_to_common_origin(t0[0])
    timeline = sorted(((op, i, s, cpu, a + shift, b + shift) for op, i, s, cpu, a, b in log), key=lambda e: e[4])
    return {"grads": {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()},
            "losses": [float(v) for v in losses], "timeline": timeline}


def torch_pipeline_worker(rank: int, world_size: int, *configs: dict) -> list[dict]:
    """:func:`torch_pipeline_step` for each of ``configs`` (keyword arguments) in turn, in one launch of the
    ranks (each launch starts fresh processes: what they set up, a notebook pays once)."""
    return [torch_pipeline_step(rank, world_size, **c) for c in configs]

