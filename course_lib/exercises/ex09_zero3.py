"""Notebook 09's second exercise: a ZeRO-3 layer, as a ``torch.autograd.Function``.

The check wraps each ``nn.Linear(WIDTH, WIDTH)`` of a stack: its weight and bias become one flat vector of
``WIDTH * WIDTH + WIDTH`` elements (a multiple of 2, 3 and 4), and rank r keeps only ``flat.chunk(N)[r]``, its
**shard**. The learner writes the Function that runs one such layer, ``Fn.apply(x, shard)``:

* ``forward(ctx, x, shard)``: all-gather the whole flat vector, compute ``x @ weight.T + bias``, and save for
  backward only what is small (``x`` and the shard): the whole weight is freed when ``forward`` returns;
* ``backward(ctx, grad_y)``: all-gather again, compute the input's gradient and the whole flat gradient, then
  **reduce-scatter** it (each rank receives the sum of its own slice), divide by N, return ``(grad_x, grad_shard)``.

The check trains the stack for a few steps of SGD with momentum on 2 and 3 ranks, every rank on its own part of
the global batch, and compares with one process on the whole batch. It also records every collective (kind,
bytes, forward or backward: :class:`..comm.record.CollectiveLog`) and, through weak references to the tensors
the all-gathers fill, how many layers' whole parameters were alive at once. Each usual mistake gets its message.
"""
from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.distributed as dist

from ..comm.record import CollectiveLog, _tensors, kind_of
from ..zero.flat import all_gather_single, reduce_scatter_single
from . import passed, run_attempt, wrong

WIDTH, DEPTH, STEPS, BATCH, LR, MOMENTUM = 8, 3, 3, 4, 0.1, 0.9
WORLD_SIZES = (2, 3)
NUMEL = WIDTH * WIDTH + WIDTH


def unflatten(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's whole flat vector -> ``(weight, bias)``, views of it (so they keep it alive)."""
    return flat[:WIDTH * WIDTH].view(WIDTH, WIDTH), flat[WIDTH * WIDTH:NUMEL]


def gather(shard: torch.Tensor) -> torch.Tensor:
    """Every rank's shard -> the whole flat vector (a new tensor)."""
    flat = shard.new_empty(shard.numel() * dist.get_world_size())
    all_gather_single(flat, shard)
    return flat


class Zero3Linear(torch.autograd.Function):
    """The reference solution."""

    @staticmethod
    def forward(ctx, x, shard):
        weight, bias = unflatten(gather(shard))          # 1. gather the whole layer
        ctx.save_for_backward(x, shard)                   # 3. keep the small things only
        return x @ weight.T + bias                        # 2. compute; the whole layer is freed on return

    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        weight, _ = unflatten(gather(shard))              # 4. gather again, just before it is needed
        grad_flat = torch.cat([(grad_y.T @ x).reshape(-1), grad_y.sum(0)])
        grad_shard = torch.empty_like(shard)
        reduce_scatter_single(grad_shard, grad_flat)      # 5. each rank: the sum of its own slice
        return grad_y @ weight, grad_shard / dist.get_world_size()   # 6. the average; weight freed on return


def _problem(world_size: int):
    g = torch.Generator().manual_seed(9)
    layers = [torch.cat([0.3 * torch.randn(WIDTH * WIDTH, generator=g), 0.1 * torch.randn(WIDTH, generator=g)])
              for _ in range(DEPTH)]
    x = torch.randn(STEPS, world_size * BATCH, WIDTH, generator=g)
    y = torch.randn(STEPS, world_size * BATCH, WIDTH, generator=g)
    return layers, x, y


def _forward(x: torch.Tensor, layer) -> torch.Tensor:
    for k in range(DEPTH):
        x = layer(x, k)
        if k < DEPTH - 1:
            x = torch.relu(x)
    return x


_KEPT: list = []          # in a worker: non-empty once a whole was seen to stay alive (then no more waiting)


class _Watch(CollectiveLog):
    """Collectives, plus how many layers' whole parameters are alive at once.

    A "whole" is what an all-gather filled (one tensor, or the list of parts of ``dist.all_gather``) and what
    ``torch.cat`` makes of such parts. Counted at the layer boundaries: just before each all-gather, the wholes
    still alive plus the one being filled, distinct storages only (a buffer reused for every layer is one). A
    reference Gloo's ``Work`` still holds for a moment is not the learner's: a count above zero is re-taken after
    ``gc.collect()`` and short waits, and only a whole that stays alive counts (once one has, no more waiting)."""

    def __init__(self):
        super().__init__()
        self.wholes: list[list[weakref.ref]] = []       # each whole: weak references to its tensors
        self.peak = self.alive_after_forward = 0

    def _alive_storages(self, exclude=frozenset()) -> set:
        live = set()
        for refs in self.wholes:
            ptrs = frozenset(t.untyped_storage().data_ptr() for t in (r() for r in refs) if t is not None)
            if ptrs and not ptrs & exclude:
                live.add(ptrs)
        return live

    def alive(self, exclude=frozenset()) -> int:
        """Distinct wholes alive, waiting up to about 0.2 s for transient references to go."""
        live = self._alive_storages(exclude)
        for attempt in range(0 if _KEPT else 20):
            if not live:
                break
            if attempt == 0:
                gc.collect()                              # a reference cycle (slow: once)
            else:
                time.sleep(0.01)                          # a Gloo worker thread letting go
            live = self._alive_storages(exclude)
        _KEPT.extend([True] if live else [])
        return len(live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gathering = "allgather" in func.name().replace("_", "") and kind_of(func.name()) == "all-gather"
        if gathering:
            targets = list(_tensors(args[0])) if func.name().startswith("c10d::") else []
            ptrs = frozenset(t.untyped_storage().data_ptr() for t in targets)
            self.peak = max(self.peak, self.alive(exclude=ptrs) + 1)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if gathering:
            self.wholes.append([weakref.ref(t) for t in (targets or list(_tensors(out)))])
        elif func is torch.ops.aten.cat.default:
            parts = {t.untyped_storage().data_ptr() for refs in self.wholes for t in (r() for r in refs)
                     if t is not None}
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in parts for t in args[0]):
                self.wholes.append([weakref.ref(out)])
        return out


def trial(rank: int, world_size: int, fn) -> dict:
    """Worker: train the sharded stack with the learner's Function on this rank's share of each batch."""
    _KEPT.clear()
    layers, x, y = _problem(world_size)
    shards = [flat.chunk(world_size)[rank].clone().requires_grad_() for flat in layers]
    optimizer = torch.optim.SGD(shards, lr=LR, momentum=MOMENTUM)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    steps = []
    for t in range(STEPS):
        optimizer.zero_grad()
        with _Watch() as watch:
            out = _forward(x[t, mine], lambda h, k: fn.apply(h, shards[k]))
            loss = (out - y[t, mine]).pow(2).mean()
            watch.alive_after_forward = watch.alive()
            with watch.during("backward"):
                loss.backward()
        steps.append({"collectives": [(c.kind, c.nbytes, c.phase) for c in watch.records], "peak": watch.peak,
                      "after forward": watch.alive_after_forward,
                      "no grad": [k for k, s in enumerate(shards) if s.grad is None or not s.grad.any()]})
        optimizer.step()
    final = []
    for s in shards:
        whole = torch.empty(s.numel() * world_size)
        all_gather_single(whole, s.detach())
        final.append(whole)
    return {"final": final, "steps": steps}


def reference(world_size: int, gradient_scale: float = 1.0) -> list[torch.Tensor]:
    """One process on the global batch, whole layers (gradients multiplied by ``gradient_scale``)."""
    layers, x, y = _problem(world_size)
    flats = [f.clone().requires_grad_() for f in layers]
    optimizer = torch.optim.SGD(flats, lr=LR, momentum=MOMENTUM)
    for t in range(STEPS):
        optimizer.zero_grad()

        def layer(h, k):
            weight, bias = unflatten(flats[k])
            return h @ weight.T + bias
        (_forward(x[t], layer) - y[t]).pow(2).mean().backward()
        for f in flats:
            f.grad *= gradient_scale
        optimizer.step()
    return [f.detach() for f in flats]


def _close(a: list, b: list) -> bool:
    return all(u.shape == v.shape and torch.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(a, b))


def _diagnose(results: list[dict], n: int) -> str | None:
    steps = results[0]["steps"]
    kinds = {phase: [k for k, _, p in steps[-1]["collectives"] if p == phase] for phase in ("forward", "backward")}
    if any(s["no grad"] for r in results for s in r["steps"]):
        missing = sorted({k for r in results for s in r["steps"] for k in s["no grad"]})
        return (f"layers {missing} got no gradient (or only zeros): backward must return the gradient of the "
                "input first (grad_y @ weight), or the layers below never run their backward")
    if kinds["forward"].count("all-gather") != DEPTH:
        return f"the forward of {DEPTH} layers issued {kinds['forward']}: one all-gather per layer, before it computes"
    if "all-gather" not in kinds["backward"]:
        return ("backward issued no all-gather: the whole weight was kept from forward to backward, so every layer's "
                "whole parameters stay alive for the whole forward pass. Save only x and the shard; gather again in "
                "backward.")
    if "all-reduce" in kinds["backward"]:
        return ("backward all-reduces the whole gradient: every rank receives all of it (ZeRO-1's gradient memory, and "
                "twice a reduce-scatter's traffic). Reduce-scatter it: each rank receives only its own slice.")
    if kinds["backward"].count("reduce-scatter") != DEPTH or kinds["backward"].count("all-gather") != DEPTH:
        return f"the backward of {DEPTH} layers issued {kinds['backward']}: one all-gather and one reduce-scatter each"
    peak = max(s["peak"] for r in results for s in r["steps"])
    kept = max(s["after forward"] for r in results for s in r["steps"])
    if peak > 1 and kept > 0:
        return (f"the gathered weights are never freed: after forward, {kept} layers' whole parameters were still "
                f"alive ({peak} at once at the peak), where ZeRO-3 holds one layer at a time. Something keeps "
                "a whole weight (ctx.save_for_backward(weight), ctx.weight = ...): keep x and the shard only.")
    if peak > 1:
        return (f"{peak} layers' whole parameters were alive at once when a layer began (at its all-gather), where "
                "ZeRO-3 holds one layer at a time: free each layer's gathered weights before the next layer gathers")
    final, expected = [r["final"] for r in results], reference(n)
    if all(_close(f, expected) for f in final):
        return None
    if all(_close(f, reference(n, gradient_scale=n)) for f in final):
        return (f"on {n} ranks the weights moved as if the gradient were {n} times too large: the reduce-scatter "
                "sums the ranks' gradients; divide by the world size to average them.")
    gap = max((a - b).abs().max().item() for f in final for a, b in zip(f, expected))
    return (f"on {n} ranks the weights differ from one process on the global batch by up to {gap:.2e}: check the "
            "gradients (grad_w = grad_y.T @ x, grad_b = grad_y.sum(0), flattened in the order weight then bias)")


def check_zero3(fn):
    """Train a sharded stack of Linear layers with ``fn`` (an autograd Function) on 2 and 3 ranks; name the mistake."""
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        return wrong(f"pass your autograd Function class itself (class MyZero3Linear(torch.autograd.Function)), "
                     f"got {fn!r}")
    for n in WORLD_SIZES:
        results, feedback = run_attempt(
            trial, n, fn, timeout=60,
            timeout_hint="A rank waits in a collective the others never call: every rank must call the same "
                         "collectives, in the same order, with tensors of the same sizes.",
            error_hints={"invalid gradient": "backward returns (grad_x, grad_shard): grad_shard has the shard's "
                                             "size, the output of the reduce-scatter, not the whole gradient."})
        if feedback is not None:
            return feedback
        message = _diagnose(results, n)
        if message:
            return wrong(message)
    return passed("your ZeRO-3 layer equals one process on the global batch on 2 and 3 ranks: per layer one "
                  "all-gather in forward, one all-gather and one reduce-scatter in backward, and the whole "
                  "parameters of one layer alive at a time")
