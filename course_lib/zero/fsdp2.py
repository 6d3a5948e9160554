"""PyTorch's own sharded data parallelism: FSDP2 (``torch.distributed.fsdp.fully_shard``) and sharded
checkpoints (``torch.distributed.checkpoint``, DCP).

FSDP2 does what :func:`..fully_shard` does, with PyTorch's machinery: each parameter becomes a
``DTensor`` sharded on its first dimension over a device mesh (``p.to_local()`` is this rank's piece),
each ``fully_shard``-ed module is one all-gather unit, and hooks gather before forward and backward
and reduce-scatter after. Two differences from the from-scratch one: torch's ``fully_shard`` is called
by hand on each module, bottom-up (ours finds the layers itself), and its shards are rows of each
parameter (``Shard(0)``) where ours are 1-D slices of the flattened parameter.

**Gloo and averaging.** FSDP2 averages gradients with ``ReduceOp.AVG`` inside the reduce-scatter.
pytorch/pytorch#162338 (September 2025, when torch 2.8 was the current release) reported that on Gloo
this came out as a *sum*: gradients N times too large, silently. A fix to Gloo was merged in December
2025 (pytorch/pytorch#171458); on torch 2.13, FSDP2 on 2 Gloo ranks averaged correctly without any
workaround when this was written. :func:`force_sum_on_gloo` is the workaround for whichever releases
have the bug: reduce with a sum and let FSDP2 divide by the world size itself, on every version.

A DCP checkpoint is a folder: every rank writes the shards it holds (``__<rank>_0.distcp``), and
rank 0 adds a ``.metadata`` file that says where each piece of each tensor is. Loading reads the
pieces each rank needs for *its* shards, so a checkpoint saved on 4 ranks loads on 2 (resharding):
the model's state and the optimizer's (``get_state_dict`` / ``set_state_dict``), so training resumes.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.record import CollectiveLog
from ..hardware import rank_device
from .flat import owned_parameters


def mesh():
    """A one-dimensional device mesh over all ranks, on this rank's device type."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (each one all-gather unit)."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def force_sum_on_gloo(model: nn.Module) -> bool:
    """On Gloo, make every FSDP2 unit of ``model`` reduce gradients with a sum and divide by the world size
    itself, rather than ask Gloo for an average (pytorch/pytorch#162338, see the module's docstring).
    Call it after the last ``fully_shard``. Returns whether it did (``False`` on NCCL: nothing to work around).

    ``set_force_sum_reduction_for_comms`` sets only the unit it is called on, so every unit gets it.
    """
    if "gloo" not in str(dist.get_backend()):            # also 'cpu:gloo' and 'cuda:nccl,cpu:gloo'
        return False
    units = fsdp_units(model)
    if not units:
        raise ValueError("force_sum_on_gloo needs a model that fully_shard was applied to")
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return True


def apply_fsdp2(model: nn.Module, reshard_after_forward: bool = True, param_dtype=None,
                reduce_dtype=None, offload_policy=None) -> nn.Module:
    """FSDP2 with one unit per layer (every module owning parameters, as :func:`..fully_shard` does),
    then the root. ``param_dtype`` (e.g. ``torch.bfloat16``) and ``reduce_dtype`` (the type gradients
    are reduce-scattered in; by default ``param_dtype``): FSDP2's ``MixedPrecisionPolicy``.
    ``offload_policy``: e.g. ``CPUOffloadPolicy()`` for every unit (:mod:`.fsdp2_offload`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device_mesh = mesh()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    extra = {} if offload_policy is None else {"offload_policy": offload_policy}
    for module, _ in owned_parameters(model):
        if module is not model:
            fully_shard(module, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                        **extra)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, **extra)
    force_sum_on_gloo(model)
    return model


def sum_instead_of_average(model: nn.Module) -> nn.Module:
    """Make FSDP2 *sum* the ranks' gradients, as Gloo did in pytorch/pytorch#162338: a wrong model, on
    purpose, that a check comparing with one process must catch."""
    for unit in fsdp_units(model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return model


def fsdp2_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors from an FSDP2 model's DTensors (collective: call it on every rank)."""
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def local_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each parameter's global shape and the shape of this rank's piece (``to_local()``)."""
    return {name: (tuple(p.shape), tuple(p.to_local().shape)) for name, p in model.named_parameters()}


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes of parameters held whole right now (those FSDP2 has not resharded), read from their storage."""
    from torch.distributed.tensor import DTensor
    return sum(p.untyped_storage().nbytes() for p in model.parameters() if not isinstance(p, DTensor))


def count_collectives(log: CollectiveLog) -> dict[str, int]:
    """``{"forward all-gathers": n, "backward all-gathers": n, "reduce-scatters": n, "reduce-scatter bytes": b}``."""
    records = log.records
    return {"forward all-gathers": sum(r.kind == "all-gather" and r.phase == "forward" for r in records),
            "backward all-gathers": sum(r.kind == "all-gather" and r.phase == "backward" for r in records),
            "reduce-scatters": sum(r.kind == "reduce-scatter" for r in records),
            "reduce-scatter bytes": sum(r.nbytes for r in records if r.kind == "reduce-scatter")}


def _forward_backward(model: nn.Module, log: CollectiveLog) -> dict:
    """One forward and backward of ``model`` with its collectives recorded; whole-parameter bytes around them."""
    x = torch.randn(4, next(model.parameters()).shape[-1], device=rank_device())
    before = unsharded_bytes(model)
    with log:
        out = model(x)
        after_forward = unsharded_bytes(model)
        with log.during("backward"):
            out.float().pow(2).mean().backward()
    return {"before": before, "after forward": after_forward, "after backward": unsharded_bytes(model)}


def reshard_worker(rank: int, world_size: int, model_fn, reshard_after_forward: bool) -> dict:
    """Whole-parameter bytes after forward (before backward) and after backward, with ``reshard_after_forward``
    on or off, and the collectives of that forward and backward (:func:`count_collectives`)."""
    model = apply_fsdp2(model_fn().to(rank_device()), reshard_after_forward=reshard_after_forward)
    log = CollectiveLog()
    held = _forward_backward(model, log)
    return {**held, **count_collectives(log)}


def mixed_precision_worker(rank: int, world_size: int, model_fn, reduce_dtype=None) -> dict:
    """FSDP2 with ``param_dtype=torch.bfloat16`` (and ``reduce_dtype``): the type layers compute in, the type of
    the sharded parameters and of their gradients, the bytes reduce-scattered in one backward, and the bytes of whole
    (gathered, bf16) weights still held after it."""
    model = apply_fsdp2(model_fn().to(rank_device()), param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    seen = []
    first.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    log = CollectiveLog()
    _forward_backward(model, log)
    shard = next(model.parameters())
    return {"compute": seen[0], "stored": shard.dtype, "gradients": shard.grad.dtype,
            "reduce-scatter bytes": count_collectives(log)["reduce-scatter bytes"],
            "whole after backward": unsharded_bytes(model)}         # the bf16 copies: gone once backward ends


def _train(model: nn.Module, opt, width: int, steps: int) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, width, generator=g).to(rank_device())).float().pow(2).mean().backward()
        opt.step()


def full_optimizer_state(model: nn.Module, opt) -> dict:
    """The optimizer's state as whole tensors on the CPU, keyed by parameter name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    _, state = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"state": {name: {k: v.detach().cpu().clone() for k, v in s.items()} for name, s in state["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]}


def dcp_save_worker(rank: int, world_size: int, path: str, model_fn, steps: int = 2) -> dict:
    """Train an FSDP2 model a few steps with AdamW, save its state and the optimizer's with DCP; return the
    full weights, the full optimizer state, and this rank's file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = apply_fsdp2(model_fn().to(rank_device()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, next(iter(model_fn().parameters())).shape[-1], steps)
    model_state, optimizer_state = get_state_dict(model, opt)        # this rank's shards, keyed by name
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    dist.barrier()
    mine = os.path.join(path, f"__{rank}_0.distcp")
    return {"weights": {k: v.cpu() for k, v in fsdp2_full_state_dict(model).items()},
            "optimizer": full_optimizer_state(model, opt),
            "file": os.path.basename(mine), "bytes": os.path.getsize(mine)}


def dcp_load_worker(rank: int, world_size: int, path: str, model_fn) -> dict:
    """Build a fresh FSDP2 model and optimizer on this world size, load the checkpoint into their shards;
    return the full weights and optimizer state, and the shapes this rank holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = apply_fsdp2(model_fn(seed=123).to(rank_device()))        # different weights, on purpose
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)               # and a different learning rate
    model_state, optimizer_state = get_state_dict(model, opt)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)                              # fills this rank's shards in place
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {"weights": {k: v.cpu() for k, v in fsdp2_full_state_dict(model).items()},
            "optimizer": full_optimizer_state(model, opt), "shapes": local_shapes(model)}


def optimizer_state_difference(a: dict, b: dict) -> float:
    """The largest difference between two :func:`full_optimizer_state` results (``inf`` if their layouts or
    hyperparameters differ)."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return float("inf")
    gaps = [(a["state"][p][k].float() - b["state"][p][k].float()).abs().max().item()
            for p in a["state"] for k in a["state"][p]]
    return max(gaps, default=0.0)
