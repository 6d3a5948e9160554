"""The three stages behind one call, a full state dict from any of them, and the bytes a rank holds.

``model, optimizer = shard(model, stage, torch.optim.AdamW, lr=1e-3)`` inside a rank; then train as
usual (``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``): gradients are averaged
over the ranks inside, no DDP needed.

============  ===========================================  =============================================
stage         what each rank holds between steps           what a step sends
============  ===========================================  =============================================
1             all parameters, all gradients, 1/N states    reduce-scatter + all-gather (= an all-reduce)
2             all parameters, 1/N gradients, 1/N states    the same, the reduce-scatter during backward
3             1/N of everything, plus one layer at a time  all-gather twice (forward, backward) + RS
============  ===========================================  =============================================
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from .flat import require_process_group
from .optimizer import LayerwiseZero1, LayerwiseZero2, ShardedOptimizer
from .stage3 import fully_shard

STAGES = (1, 2, 3)


def shard(model: nn.Module, stage: int, optimizer_class: type[Optimizer], **optimizer_kwargs):
    """``(model, optimizer)`` for ZeRO ``stage`` 1, 2 or 3, in a rank whose process group is up.

    Stages 1 and 2 start every rank from rank 0's parameters and buffers (as DDP does); stage 3 keeps
    each rank's own slice of its own model (build it the same way on every rank, e.g. from a seed).
    """
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (the ZeRO stage), got {stage!r}")
    require_process_group("shard")
    if stage == 3:
        model = fully_shard(model)
        return model, optimizer_class(model.parameters(), **optimizer_kwargs)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)
    wrapper = LayerwiseZero1 if stage == 1 else LayerwiseZero2
    return model, wrapper(model, optimizer_class, **optimizer_kwargs)


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (same keys, whole fp32 tensors), on every rank.

    For a model from ``shard`` or ``fully_shard``. Collective under stage 3 (it all-gathers): call it
    on every rank. Tied weights keep both keys, pointing at one tensor, as in the unsharded model.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    zero3 = getattr(model, "zero3", None)
    if zero3 is None:
        return state
    whole = {}
    for layer in zero3.layers:
        outputs = [torch.empty(f.shape, dtype=s.dtype, device=s.device) for f, s in zip(layer.full, layer.shards)]
        layer.group.all_gather(layer.shards, [o.view(-1) for o in outputs], layer.shards[0].dtype)
        whole.update({id(s): o for s, o in zip(layer.shards, outputs)})
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in whole:
            state[key] = whole[id(value)]
    return state


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct memory behind ``tensors`` (views of one tensor count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def rank_bytes(model: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """The bytes this rank holds between steps: ``{"parameters", "gradients", "optimizer states"}``.

    Counted from the memory really behind the tensors (a shard that is a view of a parameter adds
    nothing; tied weights count once). Optimizer states are the per-parameter tensors (Adam's step
    counter, a 0-d tensor, is left out).
    """
    inner = getattr(optimizer, "inner", optimizer)           # a ShardedOptimizer steps its shards with .inner
    params = list(model.parameters()) + [p for g in inner.param_groups for p in g["params"]]
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"parameters": _storage_bytes(params),
            "gradients": _storage_bytes(p.grad for p in params),
            "optimizer states": _storage_bytes(states)}


__all__ = ["shard", "full_state_dict", "rank_bytes", "ShardedOptimizer", "STAGES"]
