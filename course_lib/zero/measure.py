"""Measuring the stages: bytes each rank holds, bytes a step sends, and step time (workers for ``launch.run``).

The model is a deep MLP whose widths the world size divides, so that every shard is exactly 1/N of
its parameter and the measurements can be compared with the arithmetic byte for byte.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..hardware import rank_device, synchronize
from ..models import mlp
from .api import rank_bytes
from .flat import count_traffic
from .training import wrap

STRATEGIES = ("ddp", 1, 2, 3)


def deep_mlp(width: int = 256, depth: int = 4, seed: int = 0):
    """``depth`` Linear layers of ``width`` x ``width`` with ReLUs between them."""
    return mlp([width] * (depth + 1), seed=seed)


def _setup(strategy, width: int, depth: int, batch: int, seed: int = 0, frozen: tuple[int, ...] = ()):
    device = rank_device()
    model = deep_mlp(width, depth, seed).to(device)
    for k in frozen:
        model[2 * k].requires_grad_(False)
    wrapped, opt = wrap(strategy, model, "adamw")
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g).to(device), torch.randn(batch, width, generator=g).to(device)

    def step():
        opt.zero_grad()
        F.mse_loss(wrapped(x).float(), y).backward()
        opt.step()
    return wrapped, opt, step


def memory_worker(rank: int, world_size: int, strategies=STRATEGIES, width: int = 64, depth: int = 4,
                  frozen: tuple[int, ...] = ()) -> dict:
    """After two AdamW steps: :func:`..rank_bytes` for each strategy; under stage 3 also the peak of whole
    parameters held during a step and the largest layer's bytes. ``frozen``: Linear layers (by index) whose
    parameters do not train."""
    out = {}
    for strategy in strategies:
        wrapped, opt, step = _setup(strategy, width, depth, batch=8, frozen=frozen)
        step()
        if strategy == 3:
            wrapped.zero3.peak_gathered_bytes = 0
        step()
        out[strategy] = rank_bytes(getattr(wrapped, "module", wrapped), opt)
        if strategy == 3:
            z = wrapped.zero3
            out["stage 3 peak"] = {"peak gathered": z.peak_gathered_bytes,
                                   "largest layer": max(layer.nbytes() for layer in z.layers),
                                   "gathered after the step": z.gathered_bytes}
    return out


def traffic_worker(rank: int, world_size: int, strategies=(1, 2, 3), width: int = 64, depth: int = 4) -> dict:
    """The collectives one training step issues, per strategy: ``[(operation, bytes of the buffer), ...]``."""
    out = {}
    for strategy in strategies:
        _, _, step = _setup(strategy, width, depth, batch=8)
        step()                                        # the first step builds what later steps reuse
        with count_traffic() as log:
            step()
        out[strategy] = log
    return out


def step_time_worker(rank: int, world_size: int, strategies=STRATEGIES, width: int = 256, depth: int = 4,
                     batch: int = 64, rounds: int = 5, steps: int = 3) -> dict:
    """Median seconds per training step of each strategy, measured alternately in one process group
    (round after round, so that a busy moment of the machine hits them all alike)."""
    steppers = {s: _setup(s, width, depth, batch)[2] for s in strategies}
    for step in steppers.values():
        step()                                        # warm-up: allocations, connections
    times: dict = {s: [] for s in strategies}
    for _ in range(rounds):
        for s, step in steppers.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(rank_device())
            times[s].append((time.perf_counter() - t0) / steps)
    return {s: statistics.median(t) for s, t in times.items()}
