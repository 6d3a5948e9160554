"""Notebook 09's exercise: ZeRO-1 by hand, on a model whose parameters are one flat vector.

The learner writes ``zero1(flat_param, make_optimizer)``, which returns ``step(flat_grad)``:

* ``flat_param``: every parameter of the model in one 1-D tensor, the same on every rank; its length is
  a multiple of the world size, so ``flat_param.chunk(world_size)[rank]`` is this rank's slice;
* ``make_optimizer(tensors)``: builds the optimizer (SGD with momentum) over ``tensors``;
* ``step(flat_grad)``: this rank's own gradient (not averaged) in; afterwards ``flat_param`` must hold
  the parameters after one optimizer step with the gradient averaged over all ranks, on every rank.

The check trains a linear model for a few steps on 2 and 3 ranks and compares ``flat_param`` with one
process on the global batch. SGD with momentum, not Adam: Adam divides the gradient by its own size,
which would hide a gradient N times too large. It also counts the elements each rank's optimizer was
built on (ZeRO-1 keeps optimizer state for 1/N of them), and the collectives of every step with their bytes
(:class:`..comm.record.CollectiveLog`): an all-reduce of the whole gradient, then keeping a slice, gives the
right weights with 1.5 x the traffic, and is named.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.record import COMM_NAMESPACES, Collective, CollectiveLog, nbytes_of
from ..zero.flat import all_gather_single, reduce_scatter_single
from . import passed, run_attempt, wrong

SHAPE = (12, 5)                 # a linear model 12 -> 5: 60 parameters, a multiple of 2, 3 and 4
STEPS, BATCH, LR, MOMENTUM = 3, 4, 0.1, 0.9
WORLD_SIZES = (2, 3)


def zero1(flat_param: torch.Tensor, make_optimizer):
    """The reference solution."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = flat_param.chunk(world_size)[rank].clone()       # this rank's slice, a copy of its own
    optimizer = make_optimizer([shard])                      # optimizer state for the slice alone: 1/N

    def step(flat_grad: torch.Tensor) -> None:
        grad = torch.empty_like(shard)
        reduce_scatter_single(grad, flat_grad)               # the sum over the ranks of everyone's slice `rank`
        shard.grad = grad / world_size                       # ... made an average
        optimizer.step()                                     # step this rank's slice
        all_gather_single(flat_param, shard)                 # every rank's updated slice, on every rank
    return step


class _AnyCollective(CollectiveLog):
    """Also records the communication operators outside all-reduce/all-gather/reduce-scatter (broadcast, reduce,
    send...), under their own name, so that a message can name what the step really issued."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.records)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        namespace, _, name = func.name().partition("::")
        if len(self.records) == before and namespace in COMM_NAMESPACES and "barrier" not in name:
            self.records.append(Collective(name.split(".")[0].strip("_"), nbytes_of(args, out), self.phase))
        return out


def _problem(world_size: int):
    g = torch.Generator().manual_seed(8)
    start = 0.1 * torch.randn(SHAPE[0] * SHAPE[1], generator=g)
    x = torch.randn(STEPS, world_size * BATCH, SHAPE[0], generator=g)
    y = torch.randn(STEPS, world_size * BATCH, SHAPE[1], generator=g)
    return start, x, y


def _loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x @ flat.view(SHAPE) - y).pow(2).mean()


def _optimizer(tensors):
    return torch.optim.SGD(tensors, lr=LR, momentum=MOMENTUM)


def trial(rank: int, world_size: int, fn) -> dict:
    """Worker: train with the learner's ZeRO-1 on this rank's share of each batch."""
    start, x, y = _problem(world_size)
    flat = start.clone()
    built: list[int] = []

    def make_optimizer(tensors):
        tensors = list(tensors)
        built.append(sum(t.numel() for t in tensors))
        return _optimizer(tensors)

    step = fn(flat, make_optimizer)
    if not callable(step):
        return {"not callable": repr(step)}
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    collectives = []
    for t in range(STEPS):
        p = flat.clone().requires_grad_()
        _loss(p, x[t, mine], y[t, mine]).backward()
        with _AnyCollective() as log:
            step(p.grad)
        collectives.append([(c.kind, c.nbytes) for c in log.records])
    return {"final": flat.clone(), "built": built, "collectives": collectives}


def _traffic_message(collectives: list, n: int) -> str | None:
    """Name a step whose collectives are not one reduce-scatter and one all-gather of the whole vector."""
    whole = SHAPE[0] * SHAPE[1] * 4
    for ops in collectives:
        kinds = [kind for kind, _ in ops]
        if sorted(ops) == [("all-gather", whole), ("reduce-scatter", whole)]:
            continue
        if kinds == ["all-reduce", "all-gather"] and ops[0][1] == whole:
            return ("your step all-reduces the whole gradient and keeps its slice: the weights are right, but every "
                    "rank receives the whole averaged gradient (ZeRO-1's memory at best) and the step sends an "
                    "all-reduce plus an all-gather, 1.5 x what DDP sends. Reduce-scatter it: each rank receives "
                    "only the sum of its own slice.")
        if kinds == ["reduce-scatter", "all-reduce"] and ops[1][1] == whole:
            return ("your step reduce-scatters the gradient, then all-reduces the zero-padded parameters instead of "
                    "all-gathering them: the weights are right, but an all-reduce sends 2 x an all-gather's bytes. "
                    "All-gather the updated slices into flat_param.")
        return (f"on {n} ranks a step issued {kinds} (bytes of each: {[nbytes for _, nbytes in ops]}); ZeRO-1's "
                f"step is one reduce-scatter of the whole gradient ({whole} bytes) and one all-gather of the whole "
                f"vector ({whole} bytes), nothing else")
    return None


def reference(world_size: int, gradient_scale: float = 1.0) -> torch.Tensor:
    """One process on the global batch (with its gradient multiplied by ``gradient_scale``)."""
    start, x, y = _problem(world_size)
    flat = start.clone().requires_grad_()
    optimizer = _optimizer([flat])
    for t in range(STEPS):
        optimizer.zero_grad()
        _loss(flat, x[t], y[t]).backward()
        flat.grad *= gradient_scale
        optimizer.step()
    return flat.detach()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _diagnose(results: list[dict], n: int) -> str | None:
    if "not callable" in results[0]:
        return f"zero1 must return the function step(flat_grad), got {results[0]['not callable']}"
    start, numel = _problem(n)[0], SHAPE[0] * SHAPE[1]
    built = [r["built"] for r in results]
    if any(len(b) == 0 for b in built):
        return "no optimizer was built: call make_optimizer([your slice]) once, in zero1"
    if any(len(b) > 1 for b in built):
        return ("make_optimizer was called more than once per rank: build the optimizer once, in zero1, not in step "
                "(a new optimizer forgets its momentum every step)")
    if any(b[0] >= numel for b in built):
        return (f"every rank steps every parameter: each rank's optimizer was built on all {numel} elements, so each "
                f"keeps the optimizer state of the whole model. ZeRO-1 builds it on this rank's 1/{n} slice "
                "(flat_param.chunk(world_size)[rank]) and all-gathers the updated slices.")
    final, expected = [r["final"] for r in results], reference(n)
    if all(_close(f, expected) for f in final):
        return _traffic_message(results[0]["collectives"], n)
    gathered = all(any(kind == "all-gather" for kind, _ in step) for r in results for step in r["collectives"])
    if gathered and all(torch.equal(f, start) for f in final):
        return ("the weights never moved although the slices were all-gathered: optimizer.step() is missing "
                "(set the slice's .grad, then step the optimizer, then all-gather).")
    ranks_disagree = len({tuple(f.tolist()) for f in final}) > 1
    if ranks_disagree or all(torch.equal(f, start) for f in final):
        return ("the all-gather is missing: after the step the ranks do not all hold the updated parameters (each has "
                "at most its own slice updated). All-gather every rank's updated slice into flat_param.")
    if all(_close(f, reference(n, gradient_scale=n)) for f in final):
        return (f"on {n} ranks the weights moved as if the gradient were {n} times too large: the reduce-scatter "
                "sums the ranks' gradients; divide by the world size to average them.")
    gap = max((f - expected).abs().max().item() for f in final)
    return (f"on {n} ranks flat_param differs from one process on the global batch by up to {gap:.2e}. Check the "
            "order in step: reduce-scatter, divide, optimizer.step(), and only then all-gather the updated slices")


def check_zero1(fn):
    """Run ``fn`` on 2 and 3 ranks for a few steps of SGD with momentum; explain the first wrong answer."""
    for n in WORLD_SIZES:
        results, feedback = run_attempt(
            trial, n, fn, timeout=60,
            timeout_hint="A rank waits in a collective the others never call: every rank must call the same "
                         "collectives, in the same order, with tensors of the same sizes.")
        if feedback is not None:
            return feedback
        message = _diagnose(results, n)
        if message:
            return wrong(message)
    return passed("your ZeRO-1 step equals one process on the global batch on 2 and 3 ranks (SGD with momentum), "
                  "with each rank keeping optimizer state for its own slice only")
