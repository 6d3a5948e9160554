"""Measurements of data-parallel training: throughput, step time, when buckets are reduced, and how much
of a step is communication.  Each function is a worker for ``launch.run``; with NCCL the model and data
live on the rank's GPU (and ``amp=True`` trains in bf16), with Gloo on the CPU.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..hardware import rank_device, synchronize
from ..models import make_mlp
from .mini_ddp import MiniDDP
from .training import TrainConfig, wrap


def _step_fn(wrapped, model, opt, strategy, amp: bool = False):
    def step(x, y):
        opt.zero_grad()
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = wrapped(x)
        F.cross_entropy(logits.float(), y).backward()
        if strategy == "mini_ddp":
            wrapped.finish_gradient_synchronization()
        opt.step()
    return step


def _setup(width, depth, batch, strategy, amp=False):
    device = rank_device()
    model = make_mlp(dim=width, hidden=width, classes=10, depth=depth).to(device)
    wrapped = wrap(model, TrainConfig(strategy=strategy))
    step = _step_fn(wrapped, model, torch.optim.SGD(model.parameters(), lr=0.01), strategy, amp)
    x, y = torch.randn(batch, width, device=device), torch.randint(10, (batch,), device=device)
    for _ in range(3):                             # warm-up: allocations, connections, kernels
        step(x, y)
    synchronize(device)
    return step, x, y, device


class TimedMiniDDP(MiniDDP):
    """:class:`MiniDDP` that records its timeline: when each bucket's all-reduce was launched and finished, and
    when backward ended (seconds since the step's forward began). The algorithm is MiniDDP's, unchanged."""

    def forward(self, *args, **kwargs):
        self._t0, self.timeline, self.backward_done = time.perf_counter(), [], None
        return super().forward(*args, **kwargs)

    def elapsed(self) -> float:
        """Seconds since this step's forward pass started (the clock of :attr:`timeline`)."""
        return time.perf_counter() - self._t0

    def _launch(self, i: int):
        entry = {"bucket": i, "params": len(self.buckets[i]), "launched": self.elapsed()}
        work = super()._launch(i)
        flat = self._in_flight[-1][1]
        entry["bytes"] = flat.numel() * flat.element_size()
        work.get_future().then(lambda _: entry.__setitem__("finished", self.elapsed()))
        self.timeline.append(entry)
        return work

    def finish_gradient_synchronization(self) -> None:
        self.backward_done = self.elapsed()                # the caller has just finished backward()
        super().finish_gradient_synchronization()
        for entry in self.timeline:
            entry.setdefault("finished", self.elapsed())


def timeline_worker(rank: int, world_size: int, width: int = 512, depth: int = 8, batch: int = 64,
                    bucket_cap_mb: float = 1.0) -> dict:
    """One measured MiniDDP step of a deep MLP: when forward and backward ended, when each bucket's
    all-reduce was launched and finished (seconds from the start of forward)."""
    model = make_mlp(dim=width, hidden=width, classes=10, depth=depth)
    ddp = TimedMiniDDP(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, width), torch.randint(10, (batch,))
    for _ in range(3):                             # warm up; keep the last step's record
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        forward_done = ddp.elapsed()
        loss.backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {"forward_done": forward_done, "backward_done": ddp.backward_done, "buckets": ddp.timeline,
            "bucket_sizes": [sum(p.numel() for p in b) * 4 for b in ddp.buckets]}


def throughput_worker(rank: int, world_size: int, width: int = 256, depth: int = 4, batch: int = 64,
                      steps: int = 20, strategy: str = "torch_ddp", amp: bool = False) -> float:
    """Samples per second of the whole job (all ranks), training an MLP with ``strategy``."""
    step, x, y, device = _setup(width, depth, batch, strategy, amp)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    synchronize(device)
    dist.barrier()
    return world_size * batch * steps / (time.perf_counter() - t0)


def comm_share_worker(rank: int, world_size: int, width: int = 512, depth: int = 4, batch: int = 256,
                      steps: int = 3) -> dict:
    """Profile a few DDP steps (torch.profiler): step time, and time spent in all-reduce.

    Gloo's all-reduce runs on its own CPU thread (events ``gloo:all_reduce``); NCCL's runs as GPU
    kernels (``nccl...``). Part of it overlaps backward, so the share is an upper bound on what
    communication costs the step.
    """
    from torch.profiler import ProfilerActivity, profile
    step, x, y, device = _setup(width, depth, batch, "torch_ddp")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        synchronize(device)
        wall = time.perf_counter() - t0
    comm_us = 0.0
    for e in prof.key_averages():
        name = e.key.lower()
        if device.type == "cuda" and "nccl" in name and "kernel" in name:
            comm_us += getattr(e, "device_time_total", 0.0)
        elif device.type == "cpu" and name == "gloo:all_reduce":
            comm_us += e.cpu_time_total
    return {"step_s": wall / steps, "comm_s": comm_us / 1e6 / steps, "device": str(device)}


def compare_wrappers_worker(rank: int, world_size: int, width: int = 256, depth: int = 4, batch: int = 64,
                            rounds: int = 10, steps: int = 5) -> dict:
    """Median step time of MiniDDP and of torch DDP on the same model, alternating, in one process group.

    ``ratio`` is the median over rounds of MiniDDP's time over DDP's in the same round. The order swaps every round
    (A B, B A, ...), so a machine getting busier or calmer during a round favours neither; a burst of load spoils
    one round's ratio, not the median."""
    steppers = {s: _setup(width, depth, batch, s) for s in ("mini_ddp", "torch_ddp")}
    times: dict[str, list[float]] = {s: [] for s in steppers}
    for r in range(rounds):
        for strategy in (list(steppers) if r % 2 == 0 else list(reversed(steppers))):
            step, x, y, device = steppers[strategy]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            synchronize(device)
            times[strategy].append((time.perf_counter() - t0) / steps)
    ratios = [m / d for m, d in zip(times["mini_ddp"], times["torch_ddp"])]
    return {**{s: statistics.median(t) for s, t in times.items()}, "ratio": statistics.median(ratios)}


def side_by_side_worker(rank: int, world_size: int, width: int = 512, depth: int = 4, batch: int = 1024,
                        steps: int = 3, rounds: int = 3) -> dict | None:
    """Data parallelism's speed-up next to what the machine gives right now, measured in alternation by the same ranks.

    Each round: rank 0 trains ``steps`` steps alone (no DDP; the others wait in a barrier, which sleeps), then every
    rank trains ``steps`` DDP steps on a batch of its own; then rank 0 does fixed arithmetic alone, then every rank
    does it at once (:func:`course_lib.parallelism.busy_work`). Per round, speed-up = samples/s of the ranks together
    over rank 0's alone, and concurrency = how many ranks ran side by side. Measured seconds apart, the two see the
    same machine, so their ratio (the efficiency) holds on a busy laptop too. Rank 0 returns the medians."""
    from ..parallelism import busy_work
    alone_step, x, y, device = _setup(width, depth, batch, "none")
    ddp_step, *_ = _setup(width, depth, batch, "torch_ddp")
    slowest = torch.zeros(1, dtype=torch.float64)
    rows = []
    for _ in range(rounds):
        times = []
        for work in ("train", "arithmetic"):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                for _ in range(steps) if work == "train" else range(1):
                    alone_step(x, y) if work == "train" else busy_work(256, 40)
            alone = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps) if work == "train" else range(1):
                ddp_step(x, y) if work == "train" else busy_work(256, 40)
            synchronize(device)
            slowest.fill_(time.perf_counter() - t0)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)     # together is done when the slowest rank is
            times.append(world_size * alone / slowest.item())
        speedup, concurrency = times[0], max(1.0, min(float(world_size), times[1]))
        rows.append({"speedup": speedup, "concurrency": concurrency, "efficiency": speedup / concurrency})
    if rank != 0:
        return None
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}
