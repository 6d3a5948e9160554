"""Notebook 11's exercise: write ``f``, the operator at the entry of a column-parallel layer.

``f`` is the identity in the forward pass and an all-reduce (sum) of the gradient in the backward pass. The
learner writes ``fn(x)`` (typically ``MyF.apply(x)`` for a ``torch.autograd.Function``). The check runs it on
2 and 4 ranks, twice:

1. a probe: the same ``x`` on every rank, a loss ``(fn(x) * w_rank).sum()`` with a different ``w_rank`` per
   rank, so the right input gradient is the sum of the ``w_rank``; what comes out instead names the mistake;
2. in use: ``fn`` at the entry of a column → row MLP, whose input gradient must equal the unsplit MLP's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.transformer import MLP
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.operators import f as reference_f  # noqa: F401 (the reference solution)
from . import passed, run_attempt, wrong

WORLD_SIZES = (2, 4)


def probe(rank, world_size, fn):
    """Worker: the forward output, the input gradient, and what they should be."""
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).requires_grad_()
    weights = [torch.arange(6, dtype=torch.float64) * (r + 1) + r for r in range(world_size)]  # w_r per rank
    y = fn(x)
    if not isinstance(y, torch.Tensor):
        return {"type": type(y).__name__}
    if y.requires_grad:
        (y * weights[rank]).sum().backward()
    grad = None if x.grad is None else x.grad.clone()
    return {"type": "Tensor", "y": y.detach().clone(), "x": x.detach(), "grad": grad, "own": weights[rank],
            "sum": sum(weights)}


def in_an_mlp(rank, world_size, fn):
    """Worker: ``fn`` entering a column → row MLP; the input gradient next to the unsplit MLP's.

    In float64, like the probe: the split MLP adds in another order than the unsplit one, and float32's
    rounding (~1e-7 relative) would leave a correct ``f`` little margin under the check's tolerance.
    """
    torch.manual_seed(0)
    mlp = MLP(8, 16).double()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    mlp(x_full).pow(2).sum().backward()
    up = ColumnParallelLinear(mlp.up, entry="none")       # no f inside: the learner's f is the entry
    down = RowParallelLinear(mlp.down)
    x_part = x.clone().requires_grad_()
    down(F.gelu(up(fn(x_part)))).pow(2).sum().backward()
    return {"grad": x_part.grad, "expected": x_full.grad}


def _close(a, b) -> bool:
    """Equal up to float64 rounding (both workers compute in float64)."""
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-9)


def _diagnose(results: list[dict], n: int) -> str | None:
    where = f"on {n} ranks"
    r0 = results[0]
    if r0["type"] != "Tensor":
        return f"{where}: your function returned a {r0['type']}, not a tensor: return the result of MyF.apply(x)"
    forward_ok = all(_close(r["y"], r["x"]) for r in results)
    forward_reduced = all(_close(r["y"], r["x"] * n) for r in results)
    grads = [r["grad"] for r in results]
    if forward_reduced and all(_close(g, r["sum"]) for g, r in zip(grads, results)):
        return (f"{where}: all-reduce done twice: in the forward as well as in the backward (the output is {n}× x). "
                "f's forward is the identity; the all-reduce belongs in its backward only.")
    if forward_reduced and all(_close(g, r["own"]) for g, r in zip(grads, results)):
        return (f"{where}: that is g, not f: all-reduce in the forward, identity in the backward. "
                "f is the other way round: identity forward, all-reduce of the gradient backward.")
    if not forward_ok:
        return (f"{where}: the forward changed x (rank 0 got {r0['y'][:3].tolist()}... for "
                f"{r0['x'][:3].tolist()}...): f's forward returns x unchanged.")
    if any(g is None for g in grads):
        return (f"{where}: no gradient reached x: the output must come from MyF.apply(x) (a Function that returns a "
                "tensor connected to x), not from x.detach() or a new tensor.")
    if all(_close(g, r["own"]) for g, r in zip(grads, results)):
        return (f"{where}: all-reduce forgotten in backward: each rank's input gradient holds only its own slice's "
                "contribution. Every rank fed the same x to its slice, so x's gradient is the sum over the ranks: "
                "dist.all_reduce the gradient in backward.")
    if all(_close(g, r["sum"] * n) for g, r in zip(grads, results)):
        return (f"{where}: all-reduce done twice in backward: the gradient is {n}× too large. "
                "One dist.all_reduce of the gradient is the whole of f's backward.")
    if all(_close(g, r["sum"] / n) for g, r in zip(grads, results)):
        return (f"{where}: the gradient was averaged: f's backward sums (dist.all_reduce's default) without dividing "
                "by the world size; the input's gradient is the sum of the slices' contributions.")
    if not all(_close(g, r["sum"]) for g, r in zip(grads, results)):
        bad = next(i for i, (g, r) in enumerate(zip(grads, results)) if not _close(g, r["sum"]))
        return (f"{where}: rank {bad}'s input gradient is {grads[bad][:3].tolist()}..., expected the sum over ranks "
                f"{results[bad]['sum'][:3].tolist()}...")
    return None


def check_f(fn):
    """``fn(x)`` must be the identity forward and all-reduce the gradient backward, on 2 and 4 ranks."""
    hint = ("A rank waits in a collective that another rank never calls: every rank must call dist.all_reduce "
            "in backward (no `if rank == 0`).")
    for n in WORLD_SIZES:
        results, feedback = run_attempt(probe, n, fn, timeout=20, timeout_hint=hint)
        if feedback is not None:
            return feedback
        message = _diagnose(results, n)
        if message:
            return wrong(message)
        results, feedback = run_attempt(in_an_mlp, n, fn, timeout=20, timeout_hint=hint)
        if feedback is not None:
            return feedback
        if not all(_close(r["grad"], r["expected"]) for r in results):
            return wrong(f"on {n} ranks, your f passes the probe but, at the entry of a column → row MLP, the input "
                         "gradient differs from the unsplit MLP's: does your backward return the all-reduced "
                         "gradient (and nothing else)?")
    return passed("your f is the identity forward and sums the gradient over the ranks backward; at the entry of a "
                  "column → row MLP it gives the unsplit MLP's input gradient, on 2 and 4 ranks")
