"""torch's DistributedDataParallel, feature by feature: gradient accumulation with ``no_sync``, checkpoints written
by rank 0 and loaded on every rank, unused parameters, and uneven inputs.  Each function is a worker for
``launch.run``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import checkpoint
from ..data import make_dataset
from ..hardware import rank_device
from ..models import WithExtras, make_mlp


def accumulation_worker(rank: int, world_size: int, micro_steps: int = 4, micro_batch: int = 8) -> dict:
    """k micro-steps under ``no_sync`` (then one synchronised) == one step on a k-times larger batch.

    Returns the largest weight difference between the two ways, and whether the ranks' gradients
    differed before the last micro-step (they should: ``no_sync`` skips the all-reduce).
    """
    x, y = make_dataset(micro_steps * micro_batch * world_size, seed=1).tensors
    mine = slice(rank * micro_steps * micro_batch, (rank + 1) * micro_steps * micro_batch)
    x, y = x[mine], y[mine]

    accumulated = DDP(make_mlp(seed=3))
    opt = torch.optim.SGD(accumulated.parameters(), lr=0.1)
    for i, (xb, yb) in enumerate(zip(x.split(micro_batch), y.split(micro_batch))):
        last = i == micro_steps - 1
        if last:
            norm = torch.tensor([accumulated.module[0].weight.grad.norm().item()])
            gathered = [torch.zeros(1) for _ in range(world_size)]
            dist.all_gather(gathered, norm)            # before the last micro-step: do ranks differ?
        context = accumulated.no_sync() if not last else torch.enable_grad()
        with context:
            (F.cross_entropy(accumulated(xb), yb) / micro_steps).backward()
    opt.step()

    big = DDP(make_mlp(seed=3))
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    F.cross_entropy(big(x), y).backward()
    opt.step()

    diff = max((a - b).abs().max().item() for a, b in zip(accumulated.parameters(), big.parameters()))
    return {"max_difference": diff, "grads_differed_before_sync": len({g.item() for g in gathered}) > 1}


def checkpoint_worker(rank: int, world_size: int, path: str, steps: int = 5) -> dict:
    """Train a few steps; rank 0 alone writes the checkpoint; every rank loads it onto its own device."""
    device = rank_device()                            # by LOCAL rank, never the global one
    model = DDP(make_mlp(seed=0).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_dataset(64 * world_size, seed=2).tensors
    x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if rank == 0:                                      # one writer: N ranks writing one file corrupt it
        checkpoint.save_atomic({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "step": steps}, path)
    dist.barrier()                                     # nobody reads before rank 0 has finished writing
    snap = checkpoint.load(path, map_location=device)  # onto this rank's device, whatever saved it
    fresh = make_mlp(seed=123).to(device)
    fresh.load_state_dict(snap["model"])
    resumed = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    resumed.load_state_dict(snap["optimizer"])
    same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.module.parameters()))
    return {"same_weights": same, "step": snap["step"], "device": str(device)}


def unused_parameter_worker(rank: int, world_size: int, find_unused: bool, steps: int = 2) -> str:
    """Train :class:`WithExtras` (a layer ``forward`` never calls) under DDP for ``steps`` steps.

    DDP reduces a bucket once every parameter in it has its gradient. The unused layer's never comes, so its
    bucket is never reduced; DDP notices at the *next* forward pass and raises ("Expected to have finished
    reduction in the prior iteration...") instead of waiting. ``find_unused_parameters=True`` makes DDP
    search the autograd graph after each forward and mark what will get no gradient.
    """
    model = DDP(WithExtras(), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_dataset(16 * world_size, seed=4).tensors
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        opt.step()
    return f"{steps} steps"


def uneven_inputs_worker(rank: int, world_size: int, join: bool) -> int:
    """Rank r gets 3 + r batches (no padding), trains on them under DDP, then waits at a barrier (where a script
    would let rank 0 save a checkpoint). Returns the number of steps this rank took.

    Without ``Join`` the rank with fewer batches reaches the barrier while the others are still in a gradient
    all-reduce it will never join: the job hangs. ``Join([model])`` lets a rank that ran out of data shadow the
    others' all-reduces (with zeros), until every rank has finished.
    """
    from torch.distributed.algorithms.join import Join
    model = DDP(make_mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_dataset(8 * (3 + rank), seed=10 + rank).tensors
    steps = 0
    with Join([model]) if join else contextlib.nullcontext():
        for xb, yb in zip(x.split(8), y.split(8)):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps += 1
    dist.barrier()
    return steps


def buffers_worker(rank: int, world_size: int) -> dict:
    """Each rank gives its BatchNorm a running mean of its own; what does BatchNorm see inside DDP's next forward?

    DDP broadcasts rank 0's buffers at the start of every forward pass (by default), so the value BatchNorm finds
    is rank 0's on every rank; its own update with the local batch then makes the ranks differ again until the next
    forward."""
    model = WithExtras()
    wrapped = DDP(model, find_unused_parameters=True)
    with torch.no_grad():
        model.body[1].running_mean.fill_(float(rank))        # after construction: the ranks now disagree
    seen = {}

    def look(module, args):                                  # BatchNorm about to run: what will it normalise with?
        seen.setdefault("mean", module.running_mean[0].item())
    model.body[1].register_forward_pre_hook(look)
    x, _ = make_dataset(8, seed=rank).tensors
    wrapped(x)
    return {"own": float(rank), "seen_in_forward": seen["mean"]}
