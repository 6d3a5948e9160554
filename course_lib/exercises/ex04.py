"""Notebook 04's exercise: batch statistics over all ranks (SyncBatchNorm by hand).

The check runs the learner's code on real ranks whose batches differ in size and centre, and compares with the truth
computed by the library: the statistics of the union of the ranks' batches.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import passed, run_attempt, wrong


def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the per-channel mean and (biased) variance over every rank's samples, whatever the batch sizes.

    One all-reduce of three sums: of x, of x squared, and the count. var = E[x²] - E[x]²."""
    channels = x.shape[1]
    sums = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))], dtype=x.dtype)])
    dist.all_reduce(sums)
    count = sums[-1]
    mean = sums[:channels] / count
    return mean, sums[channels:2 * channels] / count - mean ** 2


def stats_trial(rank, world_size, fn):
    """Worker: rank r has 3 + 2r samples drawn around a centre of its own; the learner's statistics and the truth."""
    g = torch.Generator().manual_seed(0)
    everyone = [torch.randn(3 + 2 * r, 5, generator=g, dtype=torch.float64) * (1 + r) + 3 * r
                for r in range(world_size)]
    mine = everyone[rank]
    union = torch.cat(everyone)
    local_mean, local_var = mine.mean(0), mine.var(0, unbiased=False)
    got = fn(mine.clone())
    return {"got": got, "true": (union.mean(0), union.var(0, unbiased=False)), "unbiased": union.var(0),
            "local": (local_mean, local_var),
            "mean_of_means": torch.stack([e.mean(0) for e in everyone]).mean(0),
            "mean_of_vars": torch.stack([e.var(0, unbiased=False) for e in everyone]).mean(0)}


def check_global_batch_stats(fn):
    """``fn(x)`` returns ``(mean, var)`` per channel over all ranks' samples, on every rank, for uneven batches."""
    results, feedback = run_attempt(stats_trial, 3, fn, timeout=15)
    if feedback is not None:
        return feedback
    for r in results:
        got = r["got"]
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            return wrong(f"return two tensors (mean, var) of one value per channel, got {type(got).__name__}")
        mean, var = (t.to(torch.float64) for t in got)
        if mean.shape != r["true"][0].shape or var.shape != r["true"][1].shape:
            return wrong(f"mean and var must have one value per channel, shape {tuple(r['true'][0].shape)}, "
                         f"got {tuple(mean.shape)} and {tuple(var.shape)}")
        close = lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-9)  # noqa: E731
        if close(mean, r["local"][0]):
            return wrong("each rank returned its own batch's statistics: combine them across ranks with all_reduce")
        if close(mean, r["mean_of_means"]):
            return wrong("you averaged the ranks' means, but the ranks have batches of different sizes: add up the "
                         "sums and the counts over all ranks, then divide")
        if not close(mean, r["true"][0]):
            return wrong("the mean is not the mean of all ranks' samples")
        if close(var, r["mean_of_vars"]):
            return wrong("the variance of the union is not the average of the ranks' variances (their means "
                         "differ): all-reduce the sum of squares too, and use var = E[x²] - E[x]²")
        if close(var, r["unbiased"]):
            return wrong("BatchNorm normalises with the biased variance: divide by the count, not count - 1")
        if not close(var, r["true"][1]):
            return wrong("the variance is not the variance of all ranks' samples")
    return passed("every rank has the mean and variance of all 3 ranks' samples, with batches of 3, 5 and 7")
