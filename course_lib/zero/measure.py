"""Measuring the stages: bytes each rank holds, bytes a step sends, and step time (workers for ``launch.run``).

The model is a deep MLP whose widths the world size divides, so that every shard is exactly 1/N of
its parameter and the measurements can be compared with the arithmetic byte for byte.

What :func:`memory_worker` counts (:func:`..rank_bytes`) is what stays allocated *between* steps:
parameters, gradients, optimizer states. Not counted: activations; DDP's gradient buckets, a second
gradient-sized buffer unless ``gradient_as_bucket_view=True`` (which ``"ddp"`` uses, and
:func:`ddp_bucket_worker` checks); the layer-sized buffers each collective of ``course_lib.zero``
allocates while it runs; ZeRO-3's whole parameters and gradients of the layers in flight during a step.
On GPUs, ``torch.cuda.max_memory_allocated`` adds the peak of all of it.
"""
from __future__ import annotations

import gc
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


def _setup(strategy, width: int, depth: int, batch: int, seed: int = 0, frozen: tuple[int, ...] = (),
           micro_batches: int = 1):
    device = rank_device()
    model = deep_mlp(width, depth, seed).to(device)
    for k in frozen:
        model[2 * k].requires_grad_(False)
    wrapped, opt = wrap(strategy, model, "adamw")
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g).to(device), torch.randn(batch, width, generator=g).to(device)

    def step():
        opt.zero_grad()
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (F.mse_loss(wrapped(xm).float(), ym) / micro_batches).backward()
        opt.step()
    return wrapped, opt, step


def memory_worker(rank: int, world_size: int, strategies=STRATEGIES, width: int = 64, depth: int = 4,
                  frozen: tuple[int, ...] = ()) -> dict:
    """After two AdamW steps: :func:`..rank_bytes` for each strategy; under stage 3 also the peak of whole
    parameters held during a step and the largest layer's bytes. ``frozen``: Linear layers (by index) whose
    parameters do not train. On a GPU also ``"cuda peak"``: for each strategy, the most memory its two steps
    had allocated at once beyond what was allocated before it (``torch.cuda.max_memory_allocated``)."""
    device = rank_device()
    out: dict = {"cuda peak": {}} if device.type == "cuda" else {}
    for strategy in strategies:
        if device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
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
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out["cuda peak"][strategy] = torch.cuda.max_memory_allocated(device) - before
        del wrapped, opt, step
    return out


def record_buckets(ddp) -> dict[int, tuple[int, int]]:
    """Register a communication hook on a DDP model that records, every backward, each gradient bucket's
    memory: ``{bucket index: (address of its storage, bytes)}``. The hook then all-reduces the bucket as
    DDP's default does (``allreduce_hook``: divide by the world size, sum)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buckets: dict[int, tuple[int, int]] = {}

    def hook(state, bucket):
        storage = bucket.buffer().untyped_storage()
        buckets[bucket.index()] = (storage.data_ptr(), storage.nbytes())
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, hook)
    return buckets


def ddp_bucket_worker(rank: int, world_size: int, width: int = 64, depth: int = 4) -> dict:
    """DDP's gradient buckets after two AdamW steps, with ``gradient_as_bucket_view`` off (DDP's default) and
    on: ``{view: {"bucket bytes", "gradient bytes", "gradients in the buckets"}}``; the gradients' bytes are
    :func:`..rank_bytes`'s (the memory behind them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    device, out = rank_device(), {}
    for view in (False, True):
        model = deep_mlp(width, depth).to(device)
        ddp = DDP(model, gradient_as_bucket_view=view)
        buckets = record_buckets(ddp)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank)).to(device)
        for _ in range(2):
            buckets.clear()                   # DDP may rebuild its buckets after the first step: keep the last
            opt.zero_grad()
            F.mse_loss(ddp(x), x).backward()
            opt.step()
        addresses = {address for address, _ in buckets.values()}
        out[view] = {"bucket bytes": sum(dict(buckets.values()).values()),
                     "gradient bytes": rank_bytes(model, opt)["gradients"],
                     "gradients in the buckets": all(p.grad.untyped_storage().data_ptr() in addresses
                                                     for p in model.parameters())}
    return out


def traffic_worker(rank: int, world_size: int, strategies=(1, 2, 3), width: int = 64, depth: int = 4,
                   micro_batches: int = 1) -> dict:
    """The collectives one training step issues, per strategy: ``[(operation, bytes of the buffer), ...]``.
    ``micro_batches`` > 1: the step accumulates the gradients of that many backward passes."""
    out = {}
    for strategy in strategies:
        _, _, step = _setup(strategy, width, depth, batch=8, micro_batches=micro_batches)
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


def zero1_traffic_worker(rank: int, world_size: int, width: int = 64, depth: int = 4) -> dict:
    """The collectives of one step of ``"ddp"``, ``"sharded_optimizer"`` (DDP + :class:`..ShardedOptimizer`) and
    ``1`` (:func:`..shard`, stage 1): ``{strategy: [(operation, bytes of the buffer), ...]}``.

    DDP's all-reduce runs in C++, so a communication hook records its buckets (:func:`record_buckets`). Stage 1
    issues the real reduce-scatter here on every backend (Gloo accepts ``reduce_scatter_single``, though inside it
    all-reduces, notebook 09 section 2), and :func:`.flat.count_traffic` records what was issued."""
    from unittest import mock

    from . import flat
    out = {}
    for strategy in ("ddp", "sharded_optimizer", 1):
        wrapped, _, step = _setup(strategy, width, depth, batch=8)
        buckets = record_buckets(wrapped) if strategy != 1 else {}
        with mock.patch.object(flat, "real_reduce_scatter", lambda: True):
            step()                                    # the first step builds what later steps reuse
            buckets.clear()
            with count_traffic() as log:
                step()
        out[strategy] = [("all-reduce", n) for _, n in buckets.values()] + list(log)
    return out
