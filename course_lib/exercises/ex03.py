"""Notebook 03's exercise: average the gradients by hand, after ``backward()``, on every rank.

The check builds the same model on every rank, runs one backward pass on each rank's own batch, and
compares the gradients after the learner's function with the true average over ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import make_dataset
from ..data_parallel import average_gradients  # noqa: F401 (the reference solution)
from ..models import make_mlp
from . import passed, run_attempt, wrong


def grad_trial(rank, world_size, fn):
    """Worker: local gradients, their true average (computed with the library), and the learner's result."""
    model = make_mlp(seed=0)
    x, y = make_dataset(32 * world_size, seed=5).tensors
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    expected = [g.clone() for g in local]
    for g in expected:
        dist.all_reduce(g)
        g /= world_size
    fn(model)
    return {"local": local, "expected": expected, "got": [p.grad.clone() for p in model.parameters()]}


def _all_equal(a, b) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


def check_average_gradients(fn):
    """Every rank's gradients must equal the average over ranks after ``fn(model)``."""
    for n in (2, 3):
        results, feedback = run_attempt(grad_trial, n, fn, timeout=15)
        if feedback is not None:
            return feedback
        if all(_all_equal(r["got"], r["expected"]) for r in results):
            continue
        if all(_all_equal(r["got"], [g * n for g in r["expected"]]) for r in results):
            return wrong(f"on {n} ranks the gradients are {n} times too large: all_reduce sums, so divide by the "
                         "world size. (With the sum, the learning rate is silently multiplied by the number of ranks.)")
        if all(_all_equal(r["got"], r["local"]) for r in results):
            return wrong("the gradients are unchanged: each rank still has only its own. all_reduce every p.grad.")
        if _all_equal(results[0]["got"], results[0]["expected"]):
            return wrong("only rank 0 has the average: use dist.all_reduce (not dist.reduce) so every rank gets it")
        return wrong(f"on {n} ranks the gradients after your function are not the average over ranks")
    return passed("after your function every rank holds the average gradient, on 2 and 3 ranks")
