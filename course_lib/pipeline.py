"""Pipeline parallelism across processes: each stage its own rank, micro-batches flowing through.

A *schedule* says in which order each stage runs the forward (``F``) and backward (``B``) pass of each
micro-batch.  Two classics:

* **GPipe**: every stage runs all m forwards, then all m backwards.  Simple; each stage keeps the
  activations of all m micro-batches until their backward.
* **1F1B**: after a short warm-up (p - 1 - s forwards on stage s), each stage alternates one forward
  and one backward, so it keeps at most p - s micro-batches' activations; the idle time is the same.

Either way a stage waits at the start (for the first micro-batch to reach it) and at the end (for the
last backward to come back): the **bubble**.  With equal work per stage, its share of the time is
(p - 1) / (m + p - 1): more micro-batches, smaller bubble.

:func:`schedule` and :func:`simulate` are plain Python (the pictures and the explorer use them);
:func:`pipeline_worker` runs a schedule for real, with activations and gradients sent between ranks.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("gpipe", "1f1b")


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """The ordered ops of each stage: ``[[("F", 0), ("F", 1), ..., ("B", 1), ("B", 0)], ...]``."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}: use one of {KINDS}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {stages} and {micro_batches}")
    out = []
    for s in range(stages):
        if kind == "gpipe":
            ops = [("F", i) for i in range(micro_batches)] + [("B", i) for i in reversed(range(micro_batches))]
        else:
            warm = min(stages - 1 - s, micro_batches)
            ops = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < micro_batches:
                if f < micro_batches:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
                b += 1
        out.append(ops)
    return out


def simulate(kind: str, stages: int, micro_batches: int, t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Start and end time of every op, if each takes the given time and communication is free.

    F(s, i) waits for F(s-1, i); B(s, i) waits for B(s+1, i) (the last stage's B waits for its own F);
    each stage runs its ops in schedule order.  Returns the ops' times, the makespan and the bubble.
    """
    plan = schedule(kind, stages, micro_batches)
    done: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[str, int, float, float]]] = [[] for _ in range(stages)]
    cursor, clock = [0] * stages, [0.0] * stages
    while any(cursor[s] < len(plan[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if cursor[s] == len(plan[s]):
                continue
            op, i = plan[s][cursor[s]]
            dep = ("F", s - 1, i) if op == "F" and s > 0 else ("B", s + 1, i) if op == "B" and s < stages - 1 \
                else ("F", s, i) if op == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            end = start + (t_forward if op == "F" else t_backward)
            done[(op, s, i)] = clock[s] = end
            times[s].append((op, i, start, end))
            cursor[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {kind} deadlocks")  # cannot happen for the schedules above
    makespan = max(clock)
    busy = micro_batches * (t_forward + t_backward)
    return {"times": times, "makespan": makespan, "bubble": 1 - busy / makespan}


def bubble_formula(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


def peak_in_flight(kind: str, stages: int, micro_batches: int) -> list[int]:
    """Per stage, the most micro-batches whose activations are held at once (forward done, backward not)."""
    peaks = []
    for ops in schedule(kind, stages, micro_batches):
        held = peak = 0
        for op, _ in ops:
            held += 1 if op == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def make_stage(rank: int, width: int, layers_per_stage: int, seed: int = 0) -> nn.Sequential:
    """Stage ``rank`` of a deep MLP; every stage of every rank is built from the same seed schedule, so the
    stages together equal :func:`make_full_model`."""
    torch.manual_seed(seed + rank)
    layers: list[nn.Module] = []
    for _ in range(layers_per_stage):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def make_full_model(stages: int, width: int, layers_per_stage: int, seed: int = 0) -> nn.Sequential:
    return nn.Sequential(*[make_stage(s, width, layers_per_stage, seed) for s in range(stages)])


def make_batch(batch: int, width: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def pipeline_worker(rank: int, world_size: int, kind: str, micro_batches: int, batch: int = 64, width: int = 64,
                    layers_per_stage: int = 2) -> dict:
    """Run one training step of a ``world_size``-stage pipeline with schedule ``kind``.

    Rank s holds stage s. Stage 0 reads the input, the last stage computes the loss (mean squared error
    over the whole batch: each micro-batch's loss is weighted by its share of the batch, so uneven
    micro-batches are right too). Returns the stage's gradients, what it held at most, and when each op
    ran (seconds since the moment the first rank started: ``perf_counter`` is one clock for all the
    processes of a machine, so the ranks' timelines line up).
    """
    torch.set_flush_denormal(True)  # tiny gradients as denormal floats make CPU arithmetic 10-100x slower
    stage = make_stage(rank, width, layers_per_stage)
    x, y = make_batch(batch, width)
    xs, ys = x.tensor_split(micro_batches), y.tensor_split(micro_batches)
    first, last = rank == 0, rank == world_size - 1
    for size in sorted({len(b) for b in xs}):   # warm up: the first backward of a shape is slow (kernel set-up)
        out = stage(torch.randn(size, width, requires_grad=True))
        out.backward(torch.randn_like(out))
    stage.zero_grad(set_to_none=True)
    inputs, outputs, sends = {}, {}, []
    held = peak = 0
    timeline = []
    dist.barrier()
    t0 = time.perf_counter()
    # Post every receive at once: each message then lands while this stage is busy with something else,
    # instead of after it asks (messages between two ranks arrive in the order they were sent).
    acts = {i: torch.empty(len(xs[i]), width) for i in range(micro_batches)} if not first else {}
    grads = {i: torch.empty(len(xs[i]), width) for i in range(micro_batches)} if not last else {}
    pending = {("F", i): dist.irecv(acts[i], src=rank - 1) for i in range(micro_batches)} if not first else {}
    order_b = [i for op, i in schedule(kind, world_size, micro_batches)[rank] if op == "B"]
    pending.update({("B", i): dist.irecv(grads[i], src=rank + 1) for i in order_b} if not last else {})
    for op, i in schedule(kind, world_size, micro_batches)[rank]:
        if op == "F":
            if first:   # its input gets a gradient too, only so that every stage does equal work (the
                inp = xs[i].clone().requires_grad_()   # bubble formula assumes equal stages)
            else:
                pending.pop(("F", i)).wait()
                inp = acts.pop(i).requires_grad_()
            start = time.perf_counter() - t0
            out = stage(inp)
            timeline.append(("F", i, start, time.perf_counter() - t0))
            inputs[i], outputs[i] = inp, out
            held += 1
            peak = max(peak, held)
            if not last:
                sends.append(dist.isend(out.detach(), dst=rank + 1))
        else:
            if last:
                start = time.perf_counter() - t0
                loss = F.mse_loss(outputs[i], ys[i]) * len(ys[i]) / batch
                loss.backward()
            else:
                pending.pop(("B", i)).wait()
                start = time.perf_counter() - t0
                outputs[i].backward(grads.pop(i))
            timeline.append(("B", i, start, time.perf_counter() - t0))
            if not first:
                sends.append(dist.isend(inputs[i].grad, dst=rank - 1))
            del inputs[i], outputs[i]  # this micro-batch's activations can go
            held -= 1
    for s in sends:
        s.wait()
    total = time.perf_counter() - t0
    start = torch.tensor([t0], dtype=torch.float64)
    dist.all_reduce(start, op=dist.ReduceOp.MIN)          # the earliest rank's start: a common origin
    shift = t0 - start.item()
    timeline = [(op, i, a + shift, b + shift) for op, i, a, b in timeline]
    return {"grads": [p.grad.clone() for p in stage.parameters()], "peak_in_flight": peak,
            "timeline": timeline, "total": total}


def measured_bubble(results: list[dict]) -> float:
    """Idle share of the pipeline: 1 - (time spent computing) / (stages x wall time), from real timelines."""
    start = min(op[2] for r in results for op in r["timeline"])
    end = max(op[3] for r in results for op in r["timeline"])
    busy = sum(op[3] - op[2] for r in results for op in r["timeline"])
    return 1 - busy / (len(results) * (end - start))
