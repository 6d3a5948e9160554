"""Training the small transformer with its layers split, and proving it equals one process.

:func:`train_worker` runs on every rank, in one of three layouts:

* ``"tp"``: tensor parallelism from scratch (:func:`~course_lib.tensor_parallel.tensor_parallel_transformer`)
  over all the ranks;
* ``"dtensor"``: the same split with ``parallelize_module`` over a 1-D mesh of all the ranks;
* ``"2d"``: a (data, tensor) mesh, ``tp`` ranks per tensor-parallel group: ``parallelize_module`` inside each
  group, FSDP2 (``fully_shard``) across the groups, which each train on their slice of the global batch;
* ``"2d-sp"``: the same with sequence parallelism, the production plan (:mod:`.production`: vocabulary-parallel
  embedding and head) and the loss under ``loss_parallel()``.

Each returns the loss of every step (the global batch's mean) and the weights, to compare with
:func:`course_lib.models.train_reference`, one process on the global batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import hardware
from ..data import make_token_dataset
from ..models.transformer import LMTrainConfig, batch_indices, lm_loss, make_optimizer, transformer
from .blocks import expected_shards, tensor_parallel_transformer
from .dtensor import full, local, parallelize, transformer_plan
from .production import production_plan
from .random import RankGenerator, ShardedDropout, use_sharded_dropout

LAYOUTS = ("tp", "dtensor", "2d", "2d-sp")


def build(cfg: LMTrainConfig, layout: str, world_size: int, tp: int = 2, model=None):
    """The model for ``layout`` on this rank, the data-parallel coordinate and group, and the mesh (or None).

    ``model``: the full model to split (by default the one of ``cfg``, the same on every rank).
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = hardware.rank_device()                        # the rank's GPU under NCCL, else the CPU
    if model is None:
        model = transformer(cfg.model, seed=cfg.seed)      # the same full model on every rank, then split
    model = model.to(device)
    if layout == "tp":
        return tensor_parallel_transformer(model, seed=cfg.seed), 0, 1, None, None
    if layout == "dtensor":
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
        use_sharded_dropout(model, RankGenerator(cfg.seed, mesh.get_local_rank()))   # a stream per tp rank
        return parallelize(model, mesh, transformer_plan(cfg.model.layers)), 0, 1, None, mesh
    if layout in ("2d", "2d-sp"):
        from torch.distributed.fsdp import fully_shard

        from ..zero.fsdp2 import force_sum_on_gloo

        if world_size % tp:
            raise ValueError(f"world_size {world_size} does not divide into tensor-parallel groups of {tp}")
        mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        # attention's dropout acts on this rank's heads: a stream per tp rank, its coordinate on the mesh's tp
        # dimension (not get_rank() % tp, which assumes the mesh's layout)
        rng = RankGenerator(cfg.seed, mesh["tp"].get_local_rank())
        use_sharded_dropout(model, rng, layout == "2d-sp")
        if layout == "2d-sp":   # the production plan hands the embedding dropout a sequence slice: own masks too
            model.dropout = ShardedDropout(model.dropout.p, rng)
        plan = transformer_plan(cfg.model.layers) if layout == "2d" else production_plan(cfg.model.layers)
        parallelize(model, mesh["tp"], plan)                                  # TP first, inside each group...
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])                                # ...then FSDP2 across the groups
        fully_shard(model, mesh=mesh["dp"])
        force_sum_on_gloo(model)              # Gloo averaged wrongly in some torch versions (zero.fsdp2)
        dp = mesh["dp"]
        return model, dp.get_local_rank(), dp.size(), dp.get_group(), mesh
    raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")


def train_worker(rank: int, world_size: int, cfg: LMTrainConfig, layout: str = "2d", tp: int = 2,
                 reference_state: dict | None = None) -> dict:
    """Train ``cfg.steps`` steps in ``layout``; the losses (global-batch means) and the weights.

    ``"dtensor"`` and ``"2d"`` return the full weights on rank 0 (``state``, gathered from the shards) and the
    first step's full gradients (``first_grads``);
    ``"tp"`` compares this rank's slices with ``reference_state`` (the full model's final weights) and returns
    the largest difference (``max_diff``). Every layout returns which part of each weight this rank holds
    (``shapes``).
    """
    if cfg.model.dropout:
        raise ValueError("compare layouts with dropout=0: the masks of one process and of N ranks differ")
    model, dp_rank, dp_size, dp_group, mesh = build(cfg, layout, world_size, tp)
    if cfg.batch_size % dp_size:
        raise ValueError(f"the global batch {cfg.batch_size} does not divide by {dp_size} data-parallel groups")
    device = hardware.rank_device()
    data = make_token_dataset(cfg.n, cfg.model.seq_len, cfg.model.vocab, seed=cfg.seed).tensors
    inputs, targets = (t.to(device) for t in data)
    opt = make_optimizer(model.parameters(), cfg)
    per_group = cfg.batch_size // dp_size
    losses, first_grads = [], None
    for idx in batch_indices(cfg):
        mine = idx[dp_rank * per_group:(dp_rank + 1) * per_group]   # this data-parallel group's slice
        opt.zero_grad()
        if layout == "2d-sp":   # vocabulary-sharded logits: the loss under loss_parallel, DTensor's
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = lm_loss(model(inputs[mine]), targets[mine])
                loss.backward()
            loss = full(loss)
        else:
            loss = lm_loss(local(model(inputs[mine])), targets[mine])
            loss.backward()
        if first_grads is None and layout != "tp":   # whole gradients, gathered from the shards (collectives)
            first_grads = {k: full(p.grad).detach().cpu() for k, p in model.named_parameters()}
        opt.step()
        logged = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(logged, group=dp_group)
        losses.append(logged.item() / dp_size)
    out = {"losses": losses, "shapes": {k: tuple(local(v).shape) for k, v in model.state_dict().items()}}
    if layout == "tp":
        reference = transformer(cfg.model, seed=cfg.seed)
        reference.load_state_dict(reference_state)
        reference.to(device)
        expected = expected_shards(reference, model, grads=False)
        out["max_diff"] = max((p.detach() - expected[k]).abs().max().item() for k, p in model.named_parameters())
    else:
        state = {k: full(v).detach().cpu() for k, v in model.state_dict().items()}   # a collective: every rank
        out["state"] = state if rank == 0 else None
        out["first_grads"] = first_grads if rank == 0 else None
    return out


def holdings_worker(rank: int, world_size: int, cfg: LMTrainConfig, names: list[str], tp: int = 2) -> dict:
    """Which elements of each weight in ``names`` this rank holds in the 2-D layout.

    Every weight is set to its own element indices (``arange``) before the model is split, so the values of
    this rank's shard name the elements it holds: ``{name: (full shape, local values, placements)}``, the
    placements as DTensor prints them, one per mesh dimension (dp, tp).
    """
    model = transformer(cfg.model, seed=cfg.seed)
    shapes = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shapes[name] = tuple(p.shape)
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p))
    model = build(cfg, "2d", world_size, tp, model)[0]
    params = dict(model.named_parameters())
    return {name: (shapes[name], local(params[name]).detach().cpu(), str(params[name].placements)) for name in names}
