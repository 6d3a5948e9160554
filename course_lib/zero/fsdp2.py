"""PyTorch's own sharded data parallelism: FSDP2 (``torch.distributed.fsdp.fully_shard``) and sharded
checkpoints (``torch.distributed.checkpoint``, DCP).

FSDP2 does what :func:`..fully_shard` does, with PyTorch's machinery: each parameter becomes a
``DTensor`` sharded on its first dimension over a device mesh (``p.to_local()`` is this rank's piece),
each ``fully_shard``-ed module is one all-gather unit, and hooks gather before forward and backward
and reduce-scatter after. On Gloo we ask it to reduce with a sum and divide by the world size
itself (``set_force_sum_reduction_for_comms``): averaging inside Gloo was wrong in some torch
versions (pytorch/pytorch issue 162338), a sum is right on every backend.

A DCP checkpoint is a folder: every rank writes the shards it holds (``__<rank>_0.distcp``), and
rank 0 adds a ``.metadata`` file that says where each piece of each tensor is. Loading reads the
pieces each rank needs for *its* shards, so a checkpoint saved on 4 ranks loads on 2 (resharding).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..hardware import rank_device
from .flat import owned_parameters


def mesh():
    """A one-dimensional device mesh over all ranks, on this rank's device type."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def apply_fsdp2(model: nn.Module, reshard_after_forward: bool = True, param_dtype=None) -> nn.Module:
    """FSDP2 with one unit per layer (every module owning parameters, as :func:`..fully_shard` does),
    then the root. ``param_dtype`` (e.g. ``torch.bfloat16``): FSDP2's ``MixedPrecisionPolicy``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device_mesh = mesh()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for module, _ in owned_parameters(model):
        if module is not model:
            fully_shard(module, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if dist.get_backend() == "gloo":
        model.set_force_sum_reduction_for_comms(True)
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


def reshard_worker(rank: int, world_size: int, model_fn, reshard_after_forward: bool) -> dict:
    """Whole-parameter bytes after forward (before backward), with ``reshard_after_forward`` on or off."""
    model = apply_fsdp2(model_fn().to(rank_device()), reshard_after_forward=reshard_after_forward)
    x = torch.randn(4, next(model.parameters()).shape[-1], device=rank_device())
    before = unsharded_bytes(model)
    out = model(x)
    after_forward = unsharded_bytes(model)
    out.float().pow(2).mean().backward()
    return {"before": before, "after forward": after_forward, "after backward": unsharded_bytes(model)}


def dcp_save_worker(rank: int, world_size: int, path: str, model_fn, steps: int = 2) -> dict:
    """Train an FSDP2 model a few steps, save it with DCP; return the full weights and this rank's file."""
    import torch.distributed.checkpoint as dcp
    model = apply_fsdp2(model_fn().to(rank_device()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    width = next(iter(model_fn().parameters())).shape[-1]
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, width, generator=g).to(rank_device())).float().pow(2).mean().backward()
        opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    dist.barrier()
    mine = os.path.join(path, f"__{rank}_0.distcp")
    return {"weights": {k: v.cpu() for k, v in fsdp2_full_state_dict(model).items()},
            "file": os.path.basename(mine), "bytes": os.path.getsize(mine)}


def dcp_load_worker(rank: int, world_size: int, path: str, model_fn) -> dict:
    """Build a fresh FSDP2 model on this world size, load the checkpoint into its shards, return the weights."""
    import torch.distributed.checkpoint as dcp
    model = apply_fsdp2(model_fn(seed=123).to(rank_device()))        # different weights, on purpose
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)                              # fills this rank's shards in place
    model.load_state_dict(state["model"])
    return {"weights": {k: v.cpu() for k, v in fsdp2_full_state_dict(model).items()},
            "shapes": local_shapes(model)}
