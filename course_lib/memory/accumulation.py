"""Gradient accumulation against a larger micro-batch: the same gradients, less activation memory, more time.

A batch of B sequences split into k micro-batches of B/k, each loss divided by k and backpropagated in turn
(the gradients add up in ``.grad``), gives the gradient of the whole batch: one optimizer step, the same
result, *when every micro-batch and every rank holds the same number of loss tokens*. With padding,
``ignore_index`` or packed documents they differ, and the mean of per-micro-batch means is not the mean over
all tokens: divide each micro-batch's summed loss by the loss tokens of all micro-batches on all ranks, times the
number of ranks, since DDP averages over them (:func:`global_token_step`, :func:`masked_accumulation_worker`).
What changes:

* **memory**: only one micro-batch's activations are alive at a time, so activation bytes fall k-fold (the
  weights, gradients and optimizer states do not change);
* **time**: k smaller passes instead of one big one; each operator's fixed cost (Python, kernel launches)
  is paid k times and small matrix products run less efficiently, so a step takes longer;
* **communication** (notebook 04's ``no_sync``): DDP all-reduces the gradients after every backward unless
  the backward runs inside ``with model.no_sync():``. Accumulating k micro-batches with ``no_sync`` on all
  but the last sends the gradients once per step; without it, k times.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch.distributed as dist

from .activations import held_bytes


def accumulation_worker(rank: int, world_size: int, cfg, batch: int = 16, splits=(1, 2, 4, 8), rounds: int = 3,
                        seed: int = 0, masked: bool = False) -> dict:
    """For each k in ``splits``: the rank's ``batch // world_size`` sequences as k micro-batches under DDP.
    Returns per k: activation bytes held by one micro-batch's forward, the largest difference of the
    accumulated gradients from k = 1's, the bytes all-reduced per step with and without ``no_sync``, and the
    median seconds per step (the k's alternate, round after round). ``masked``: also
    :func:`masked_accumulation_worker`'s result, under ``"masked"`` (one launch for both)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..comm.record import CollectiveLog
    from ..data import make_token_dataset
    from ..hardware import rank_device, synchronize
    from ..models.transformer import lm_loss, transformer

    device = rank_device()
    per_rank = batch // world_size
    if per_rank % max(splits):
        raise ValueError(f"each rank's {per_rank} sequences must divide into {max(splits)} micro-batches")
    x, y = make_token_dataset(batch, cfg.seq_len, cfg.vocab, seed=seed).tensors
    x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
    model = DDP(transformer(cfg, seed=seed).to(device))
    model.register_comm_hook(None, default_hooks.allreduce_hook)   # DDP's all-reduce, from Python: countable

    def step(k: int, sync_every_micro_batch: bool = False) -> None:
        model.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
            last = i == k - 1
            quiet = model.no_sync() if not (last or sync_every_micro_batch) else contextlib.nullcontext()
            with quiet:
                (lm_loss(model(xb), yb) / k).backward()

    def lm_loss_of(m, xb, yb):
        return lm_loss(m(xb), yb)

    out = {}
    for k in splits:
        micro = per_rank // k
        _, held = held_bytes(lm_loss_of, model.module, x[:micro], y[:micro])
        bytes_sent = {}
        for every in (False, True):
            log = CollectiveLog()
            with log:
                step(k, sync_every_micro_batch=every)
            bytes_sent["every micro-batch" if every else "no_sync"] = sum(   # the gradients' all-reduces only,
                r.nbytes for r in log.records if r.kind == "all-reduce")          # not DDP's bucket-rebuild broadcast
        grads = [p.grad.clone() for p in model.parameters()]
        out[k] = {"micro_batch": micro, "activation_bytes": held.total, "bytes_all_reduced": bytes_sent,
                  "grads": grads, "seconds": []}
    reference = out[splits[0]]["grads"]
    for k in splits:
        out[k]["max_grad_difference"] = max((a - b).abs().max().item() for a, b in zip(out[k].pop("grads"), reference))
    for _ in range(rounds):
        for k in splits:
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            step(k)
            synchronize(device)
            out[k]["seconds"].append(time.perf_counter() - t0)
    for k in splits:
        out[k]["median_seconds"] = statistics.median(out[k].pop("seconds"))
    if masked:
        out["masked"] = masked_accumulation_worker(rank, world_size, cfg, seed=seed)
    return out


def masked_targets(cfg, n: int, seed: int = 0):
    """``n`` sequences whose targets are masked (``-100``, cross-entropy's ``ignore_index``) from a random point on:
    padding, as in a batch of documents of different lengths. Sequence ``i`` keeps between 1 and all targets."""
    import torch

    from ..data import make_token_dataset
    x, y = make_token_dataset(n, cfg.seq_len, cfg.vocab, seed=seed).tensors
    g = torch.Generator().manual_seed(seed + 7)
    keep = torch.randint(1, cfg.seq_len + 1, (n,), generator=g)
    y = y.masked_fill(torch.arange(cfg.seq_len) >= keep[:, None], -100)
    return x, y


def lm_loss_sum(logits, targets):
    """Cross-entropy of the next token, *summed* over the loss tokens (targets ``-100`` are left out)."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def global_token_step(model, micro_batches, world_size: int) -> None:
    """One accumulation step under DDP, normalised by the global token count: each micro-batch's *summed* loss is
    divided by the loss tokens of all micro-batches on all ranks, times ``world_size`` because DDP divides the
    gradients it sums by the number of ranks. All but the last backward run inside ``no_sync()``."""
    import torch

    mine = sum(int((yb != -100).sum()) for _, yb in micro_batches)
    total = torch.tensor(float(mine), device=micro_batches[0][1].device)
    dist.all_reduce(total)                                          # loss tokens on every rank, all micro-batches
    for i, (xb, yb) in enumerate(micro_batches):
        quiet = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with quiet:
            (lm_loss_sum(model(xb), yb) / total * world_size).backward()


def masked_accumulation_worker(rank: int, world_size: int, cfg, batch: int = 8, k: int = 2, seed: int = 0) -> dict:
    """Gradient accumulation with masked targets under DDP (``no_sync`` on all but the last micro-batch, tensors on
    the rank's device): ``batch`` sequences over ``world_size`` ranks, each rank's share in ``k`` micro-batches,
    against one process on the whole batch (the mean over every loss token). Three ways to normalise:
    ``"per micro-batch mean"`` (each micro-batch's mean loss / k, what ``lm_loss(...) / k`` does),
    ``"global token count"`` (:func:`global_token_step`) and ``"global token count without x W"`` (the same,
    without the factor ``world_size``). Returns each one's largest gradient difference from one process, relative
    to the largest gradient, and under ``"size without x W"`` the norm of that last way's gradients over the exact
    ones' (``1 / world_size``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..hardware import rank_device
    from ..models.transformer import transformer

    device = rank_device()
    x, y = (t.to(device) for t in masked_targets(cfg, batch, seed))
    per_rank = batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    micro = list(zip(x[mine].chunk(k), y[mine].chunk(k)))

    def grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    one = transformer(cfg, seed=seed).to(device)
    (lm_loss_sum(one(x), y) / (y != -100).sum()).backward()      # one process: the mean over every loss token
    exact = grads(one)
    out = {"tokens per micro-batch": [int((yb != -100).sum()) for _, yb in micro]}
    for way in ("per micro-batch mean", "global token count", "global token count without x W"):
        model = DDP(transformer(cfg, seed=seed).to(device))
        if way == "per micro-batch mean":
            for i, (xb, yb) in enumerate(micro):
                with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                    (lm_loss_sum(model(xb), yb) / (yb != -100).sum() / k).backward()
        else:
            global_token_step(model, micro, world_size if way == "global token count" else 1)
        g = grads(model.module)
        out[way] = ((g - exact).abs().max() / exact.abs().max()).item()
        if way.endswith("without x W"):
            out["size without x W"] = (g.norm() / exact.norm()).item()
    return out
