"""What sharding breaks: a global-norm gradient clip, and optimizers that are not element-wise (notebook 09).

ZeRO steps each rank's slice with an ordinary optimizer. That is exact when the update of one element
reads only that element's gradient and state: SGD, Adam, Lion are **element-wise**. Two common things
read the whole tensor, or the whole model, and give another answer on a slice:

* **gradient clipping by the global norm**: ``torch.nn.utils.clip_grad_norm_`` on the shards computes the
  norm of this rank's slices only, so each rank scales by its own factor. :func:`clip_grad_norm_` sums
  the squared norms of the slices over the ranks (one all-reduce of one number) first;
* **factored optimizers** (Adafactor): they keep one statistic per row and one per column of a matrix.
  A 1-D slice has no rows and columns, so the update differs from one process's.

:func:`clip_worker` measures both on a sharded MLP; notebook 09 runs it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .training import batches, build, loss_fn


def clip_grad_norm_(shards, max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``shards`` (this rank's disjoint slices of the model, e.g. ``model.parameters()``
    after :func:`..fully_shard`) by the norm of the *whole* model's gradient; return that norm.

    Collective: call it on every rank. The squared norms of the slices add up to the squared norm of the whole.
    For stage 2 and 3 and :class:`..ShardedOptimizer` (under DDP): there the slices' gradients are averaged
    already. Under ``shard(model, 1)`` the reduce-scatter runs inside ``step()``, so before it the gradients are
    not the slices'. A rank with no gradient still joins, on the device of its first shard (NCCL cannot
    all-reduce a CPU tensor).
    """
    shards = list(shards)
    grads = [p.grad for p in shards if p.grad is not None]
    device = grads[0].device if grads else (shards[0].device if shards else torch.device("cpu"))
    squared = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))
    dist.all_reduce(squared)                               # sum over the ranks of the partial squared norms
    norm = squared.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm


def _reference(world_size: int, max_norm: float, optimizer_class, steps: int, **kwargs):
    model = build("mlp")
    opt = optimizer_class(model.parameters(), **kwargs)
    norms = []
    for x, y in batches("mlp", 4 * world_size, steps):
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
    return model.state_dict(), norms


def _sharded(rank: int, world_size: int, clip, optimizer_class, steps: int, **kwargs):
    from .api import full_state_dict, shard
    model, opt = shard(build("mlp"), 3, optimizer_class, **kwargs)
    norms = []
    for x, y in batches("mlp", 4 * world_size, steps):
        mine = slice(rank * 4, (rank + 1) * 4)
        opt.zero_grad()
        loss_fn("mlp", model(x[mine]), y[mine]).backward()
        if clip is not None:
            norms.append(float(clip(list(model.parameters()))))
        opt.step()
    return full_state_dict(model), norms


def _gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def clip_worker(rank: int, world_size: int, max_norm: float = 0.5, steps: int = 3) -> dict:
    """ZeRO-3 on the MLP against one process on the global batch, ``steps`` steps each:

    ``"norms"``: the gradient norm each way at the first step (``"one process"``, ``"torch on the shards"``: this
    rank's own, ``"all-reduced"``: :func:`clip_grad_norm_`'s); ``"gap"``: the largest weight difference after
    training with SGD + each clip, and with Adam and Adafactor unclipped (``None`` where torch has no Adafactor).
    """
    sgd = dict(lr=0.1, momentum=0.9)
    torch_clip = lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm)      # noqa: E731
    ours = lambda ps: clip_grad_norm_(ps, max_norm)                            # noqa: E731
    ref, ref_norms = _reference(world_size, max_norm, torch.optim.SGD, steps, **sgd)
    out = {"gap": {}, "norms": {"one process": ref_norms[0]}}
    for name, clip in (("torch on the shards", torch_clip), ("all-reduced", ours)):
        state, norms = _sharded(rank, world_size, clip, torch.optim.SGD, steps, **sgd)
        out["norms"][name], out["gap"][name] = norms[0], _gap(state, ref)
    adafactor = getattr(torch.optim, "Adafactor", None)       # torch >= 2.5
    for name, cls, kw in (("adam", torch.optim.Adam, dict(lr=0.01)), ("adafactor", adafactor, dict(lr=0.01))):
        if cls is None:
            out["gap"][name] = None
            continue
        ref_state = _reference(world_size, float("inf"), cls, steps, **kw)[0]
        out["gap"][name] = _gap(_sharded(rank, world_size, None, cls, steps, **kw)[0], ref_state)
    return out
