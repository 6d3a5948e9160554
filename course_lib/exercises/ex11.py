"""Notebook 11's exercises: write ``f``, then the column- and row-parallel layers of a parallel MLP.

1. ``fn(x, group)`` (:func:`check_f`): ``f``, the identity forward and an all-reduce (sum) of the gradient over
   ``group`` backward. The check runs on 4 ranks as two groups of 2 ({0, 1} and {2, 3}), then on all 4 as one
   group. Every rank gets a different ``x`` (a forward that communicates changes it) and a different weight
   ``w_rank`` in its loss ``(fn(x, group) * w_rank).sum()``, so the right input gradient is the sum of the
   ``w_rank`` over the group, and an all-reduce over every rank instead of the group gives another sum. The
   collectives are counted: none in the forward, one all-reduce in the backward (a forward that changes ``x``
   by a means ``CollectiveLog`` does not count, a send say, shows in ``y`` instead: the first rank whose ``y``
   differs is quoted).
   The backward is handed a gradient tensor of the check's own, which must come back unchanged: autograd may
   hand the same gradient tensor to several branches of the graph (``a + b`` gives both the same one), and an
   in-place all-reduce would change the others' gradients too. Then
   ``fn`` goes at the entry of a column → row MLP, whose input gradient must equal the unsplit MLP's.
2. ``column(linear, group)`` and ``row(linear, group)`` (:func:`check_parallel_mlp`, in :mod:`._ex11_mlp`):
   the two layers of a split MLP, equal to the unsplit one with every gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.record import CollectiveLog
from ..models.transformer import MLP
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.operators import f as reference_f  # noqa: F401 (the reference solution)
from . import passed, run_attempt, wrong
from ._ex11_mlp import ERROR_HINTS, GROUPS, check_parallel_mlp, make_groups, with_died_hint  # noqa: F401

WORLD = 4
TIMEOUT = 90   # a first launch in a fresh kernel takes 15-20 s on a busy 2-core machine
DIED_HINT = ("a rank can abort when it calls a collective its partners never call: every rank must call "
             "dist.all_reduce in backward (no `if rank == 0`)")


def _probe(rank, fn, group, members):
    x = (torch.linspace(-1.0, 1.0, 6, dtype=torch.float64) + 10 * rank).requires_grad_()   # its own x per rank
    weights = [torch.arange(6, dtype=torch.float64) * (r + 1) + r for r in range(WORLD)]   # w_r per rank
    with CollectiveLog() as log:
        y = fn(x, group)
        if not isinstance(y, torch.Tensor):
            return {"type": type(y).__name__}
        incoming = weights[rank].clone()                    # the gradient handed to backward, as autograd does
        with log.during("backward"):
            if y.requires_grad:
                y.backward(incoming)
    xs = [torch.linspace(-1.0, 1.0, 6, dtype=torch.float64) + 10 * r for r in range(WORLD)]
    return {"type": "Tensor", "rank": rank, "y": y.detach().clone(), "x": x.detach(), "n": len(members),
            "grad": None if x.grad is None else x.grad.clone(), "own": weights[rank],
            "in place": not torch.equal(incoming, weights[rank]),
            "sum": sum(weights[r] for r in members), "world sum": sum(weights),
            "x sum": sum(xs[r] for r in members), "x world sum": sum(xs),
            "forward": [c.kind for c in log.records if c.phase == "forward"],
            "backward": [c.kind for c in log.records if c.phase == "backward"]}


def _in_an_mlp(rank, fn, group, members):
    """``fn`` entering a column → row MLP; the input gradient next to the unsplit MLP's (float64)."""
    torch.manual_seed(0)
    mlp = MLP(8, 16).double()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1 + members[0]), dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    mlp(x_full).pow(2).sum().backward()
    up = ColumnParallelLinear(mlp.up, group, entry="none")       # no f inside: the learner's f is the entry
    down = RowParallelLinear(mlp.down, group)
    x_part = x.clone().requires_grad_()
    down(F.gelu(up(fn(x_part, group)))).pow(2).sum().backward()
    return {"grad": x_part.grad, "expected": x_full.grad}


def worker(rank, world_size, fn):
    """Worker: the probe and the MLP, in groups of 2 and then in one group of all the ranks."""
    pair = make_groups(rank)
    members = GROUPS[rank // 2]
    out = {}
    for name, group, ranks in (("groups of 2", pair, members), ("one group of 4", dist.group.WORLD,
                                                                 list(range(world_size)))):
        out[name] = {"probe": _probe(rank, fn, group, ranks), "mlp": None}
        if out[name]["probe"]["type"] == "Tensor" and not out[name]["probe"]["forward"]:
            out[name]["mlp"] = _in_an_mlp(rank, fn, group, ranks)
    return out


def _close(a, b) -> bool:
    """Equal up to float64 rounding (both sides computed in float64)."""
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-6, atol=1e-9))


def _forward_message(results, where) -> str | None:
    r0 = results[0]
    if r0["forward"]:
        if all(_close(r["y"], r["x sum"]) or _close(r["y"], r["x world sum"]) for r in results):
            first = ("that is g, not f: all-reduce in the forward, identity in the backward. "
                     if not any(r["backward"] for r in results) else "")
            return (f"{where}: {first}your forward ran {r0['forward']} and summed x over the ranks (each rank holds "
                    "its own x here). f's forward is the identity: it sends nothing; the all-reduce belongs in its "
                    "backward only.")
        return (f"{where}: your forward ran collectives {r0['forward']}: f's forward is the identity and sends "
                "nothing.")
    bad = next((r for r in results if not _close(r["y"], r["x"])), None)
    if bad is not None:
        return (f"{where}: the forward changed x (rank {bad['rank']} got {bad['y'][:3].tolist()}... for "
                f"{bad['x'][:3].tolist()}...): f's forward returns x unchanged and sends nothing.")
    return None


def _backward_message(results, where) -> str | None:
    grads, n = [r["grad"] for r in results], results[0]["n"]
    if any(g is None for g in grads):
        return (f"{where}: no gradient reached x: return the result of MyF.apply(x, group) (a Function whose output "
                "is connected to x), not x.detach() or a new tensor.")
    if all(_close(g, r["own"]) for g, r in zip(grads, results)):
        return (f"{where}: all-reduce forgotten in backward: each rank's input gradient holds only its own slice's "
                "contribution. Every rank of the group fed the same x to its slice, so x's gradient is the sum over "
                "the group: dist.all_reduce the gradient in backward.")
    if n < WORLD and all(_close(g, r["world sum"]) for g, r in zip(grads, results)):
        return (f"{where}: the gradient was summed over all {WORLD} ranks, not over the group of {n}: pass "
                "group=group to dist.all_reduce (save it in forward: ctx.group = group).")
    if all(_close(g, r["sum"] * n) for g, r in zip(grads, results)):
        return (f"{where}: all-reduce done twice in backward: the gradient is {n}× too large. One dist.all_reduce "
                "of the gradient is the whole of f's backward.")
    if all(_close(g, r["sum"] / n) for g, r in zip(grads, results)):
        return (f"{where}: the gradient was averaged: f's backward sums (dist.all_reduce's default) without dividing "
                "by the group's size; the input's gradient is the sum of the slices' contributions.")
    bad = next((i for i, (g, r) in enumerate(zip(grads, results)) if not _close(g, r["sum"])), None)
    if bad is not None:
        return (f"{where}: rank {bad}'s input gradient is {grads[bad][:3].tolist()}..., expected the sum over its "
                f"group {results[bad]['sum'][:3].tolist()}...")
    if any(r["in place"] for r in results):
        return (f"{where}: the values are right, but your backward changed the gradient it was handed, in place. "
                "Autograd may hand that same tensor to another branch of the graph (y + z gives both branches one "
                "tensor), whose gradient would then change too: all-reduce a copy, grad.clone().")
    if results[0]["backward"] != ["all-reduce"]:
        return (f"{where}: the gradient is right, but your backward ran {results[0]['backward']}: f's backward is "
                "one all-reduce.")
    return None


def check_f(fn):
    """``fn(x, group)`` must be the identity forward and all-reduce the gradient over ``group`` backward."""
    hint = ("Either a rank waits in a collective that another rank never calls (every rank must call "
            "dist.all_reduce in backward: no `if rank == 0`), or the machine is very busy: run the cell again.")
    results, feedback = run_attempt(worker, WORLD, fn, timeout=TIMEOUT, timeout_hint=hint,
                                    error_hints={"positional argument": "f takes (x, group): my_f(x, group) "
                                                 "returns MyF.apply(x, group), and backward returns a gradient "
                                                 "for each input: (grad, None)",
                                                 "returned an incorrect number of gradients":
                                                 "backward returns one gradient per input of forward: (grad, None) "
                                                 "for (x, group)", **ERROR_HINTS})
    if feedback is not None:
        return with_died_hint(feedback, DIED_HINT)
    for name in ("groups of 2", "one group of 4"):
        where = f"on {WORLD} ranks as {name}"
        probes = [r[name]["probe"] for r in results]
        if probes[0]["type"] != "Tensor":
            return wrong(f"{where}: your function returned a {probes[0]['type']}, not a tensor: return the result "
                         "of MyF.apply(x, group)")
        message = _forward_message(probes, where) or _backward_message(probes, where)
        if message:
            return wrong(message)
        if not all(_close(r[name]["mlp"]["grad"], r[name]["mlp"]["expected"]) for r in results):
            return wrong(f"{where}: your f passes the probe but, at the entry of a column → row MLP, the input "
                         "gradient differs from the unsplit MLP's: does your backward return the all-reduced "
                         "gradient (and nothing else)?")
    return passed("your f is the identity forward (no collective) and sums the gradient over its group backward (one "
                  "all-reduce); at the entry of a column → row MLP it gives the unsplit MLP's input gradient, in "
                  "groups of 2 and in one group of 4")
