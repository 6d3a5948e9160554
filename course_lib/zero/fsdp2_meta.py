"""Building an FSDP2 model on the ``meta`` device, so that no rank ever holds it whole (notebook 10, section 5).

``with torch.device("meta")`` builds shapes without memory; ``fully_shard`` turns them into meta DTensors;
``model.to_empty(device=...)`` gives each rank memory for its own rows only. What is left is the initialisation.

Each layer's ``reset_parameters()`` is *not* enough on a CPU mesh: DTensor's random operators use torch's offset
RNG tracker only on CUDA-like meshes (torch's ``is_rng_supported_mesh``), so on CPU every rank draws the same
numbers for its own rows and the two halves of every weight come out identical (duplicate neurons).
:func:`init_shards` does it instead: it replays the whole model's construction one layer at a time, from the seed,
and copies out this rank's rows. The result equals :class:`~.fsdp2_costs.BlockNet` built normally, on any world size,
and no more than one layer is ever whole.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..hardware import rank_device
from .fsdp2 import fsdp2_full_state_dict, mesh
from .fsdp2_costs import BlockNet


@torch.no_grad()
def init_shards(model: nn.Module, seed: int) -> None:
    """Initialise a sharded model's ``nn.Linear`` layers as ``torch.manual_seed(seed)`` and their construction in
    module order would: each layer is made whole on its own (on the CPU), and this rank keeps its rows of it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                whole = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)   # one layer at a time
                for name, p in m.named_parameters(recurse=False):
                    rows = torch.chunk(getattr(whole, name), p.device_mesh.size(), dim=0)   # Shard(0)'s pieces
                    p.to_local().copy_(rows[p.device_mesh.get_local_rank()])


def meta_init_worker(rank: int, world_size: int, width: int, depth: int, seed: int = 0) -> dict:
    """Build a :class:`BlockNet` on ``meta``, shard it, give each rank's shards memory (``to_empty``) and initialise
    them (:func:`init_shards`). Returns the bytes the model held on this rank at each point, the whole model's bytes,
    this rank's shapes, whether its first rows differ from the second rank's (no duplicate neurons), and the largest
    difference from ``BlockNet(width, depth, seed)`` built whole in one process."""
    from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = BlockNet(width, depth, seed)
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p                       # noqa: E731
    real = lambda: sum(0 if local(p).is_meta else local(p).untyped_storage().nbytes()     # noqa: E731
                       for p in model.parameters())
    built = real()
    device_mesh = mesh()
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    sharded = real()
    model.to_empty(device=rank_device())
    init_shards(model, seed)
    n = sum(p.numel() for p in model.parameters())
    weight = model.blocks[0].up.weight
    full = fsdp2_full_state_dict(model)
    pieces = torch.chunk(full["blocks.0.up.weight"], world_size)                 # each rank's rows, side by side
    one = BlockNet(width, depth, seed).state_dict()
    return {"after building": built, "after fully_shard": sharded, "after to_empty": real(), "whole": 4 * n,
            "placement": str(weight.placements[0]), "shape": tuple(weight.shape),
            "local shape": tuple(weight.to_local().shape), "device": str(weight.to_local().device),
            "shards differ": not torch.equal(pieces[0][:len(pieces[1])], pieces[1]),
            "vs built whole": max((full[k].cpu() - one[k]).abs().max().item() for k in one),
            "rank": dist.get_rank()}
