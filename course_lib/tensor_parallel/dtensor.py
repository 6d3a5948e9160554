"""PyTorch's way: the same splits as :mod:`.blocks`, written as plans for ``parallelize_module``.

A **DeviceMesh** names the ranks and arranges them in dimensions (``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp"))``: four ranks, a 2×2 grid). A **DTensor** is a tensor spread over a mesh, each
dimension of the mesh with a *placement*:

* ``Shard(d)``: the tensor is cut along its dimension ``d``; each rank of that mesh dimension holds a piece;
* ``Replicate()``: each rank holds all of it;
* ``Partial()``: each rank holds a tensor of the full shape, and the value is their **sum** (a row-parallel
  layer's output before ``g``); ``Partial("avg")``, ``"max"``, ``"min"``... reduce otherwise, and DTensor's own
  ops make more (the norm of a ``Shard`` tensor is a partial norm, reduced by a norm of the parts).

``redistribute`` moves between placements with the collective it takes: Shard → Replicate is an all-gather,
Partial → Replicate an all-reduce, Partial → Shard a reduce-scatter, Replicate → Shard a local slice.

``parallelize_module(module, mesh, plan)`` turns the named ``nn.Linear`` layers of ``module`` into DTensor
layers: ``ColwiseParallel`` (weight ``Shard(0)``: Megatron's column-parallel, with ``f`` at its input),
``RowwiseParallel`` (weight ``Shard(1)``, output ``Partial`` made ``Replicate``: ``g``), ``SequenceParallel``
(a LayerNorm on ``Shard(1)`` activations), and ``PrepareModuleInput`` (redistribute a module's input: the
all-gather before attention or the MLP).

Two things the plans do not do alike with the from-scratch layers:

* ``ColwiseParallel`` hands back plain local tensors, so a dropout on them (attention's, on this rank's heads)
  draws from the global generator, the same on every rank: :func:`.random.use_sharded_dropout` gives those
  dropouts the per-rank stream (DTensor's own random tracker covers random ops on DTensors only, and only on
  CUDA-like devices);
* under sequence parallelism DTensor leaves the LayerNorms' gradients ``Partial`` until something reads them,
  and computes the row-parallel biases' gradients whole (``Replicate``), from the all-gathered output gradient.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def mlp_plan(prefix: str = "", sequence_parallel: bool = False) -> dict:
    """``up`` column-wise, ``down`` row-wise (and, with sequence parallelism, a sequence slice in and out)."""
    if not sequence_parallel:
        return {f"{prefix}up": ColwiseParallel(), f"{prefix}down": RowwiseParallel()}
    return {f"{prefix}up": ColwiseParallel(input_layouts=Shard(1)),   # all-gather the sequence first
            f"{prefix}down": RowwiseParallel(output_layouts=Shard(1))}  # reduce-scatter to a sequence slice


def attention_plan(prefix: str = "", sequence_parallel: bool = False, prepare_input: bool = True) -> dict:
    """``q``, ``k``, ``v`` column-wise (whole heads per rank), ``out`` row-wise.

    ``prepare_input=False`` leaves out the ``PrepareModuleInput`` (to see what it saves: two all-reduces in
    each backward pass); without it the sequence cannot be gathered, so it needs ``sequence_parallel=False``.
    """
    if not prepare_input and sequence_parallel:
        raise ValueError("sequence parallelism needs the PrepareModuleInput that gathers the sequence: "
                         "use prepare_input=True")
    plan = {f"{prefix}{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan[f"{prefix}out"] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    # The three projections share one input: make it a DTensor once, before them (gathering the sequence
    # first under sequence parallelism). Their input gradients then add up as one Partial DTensor, reduced
    # once: one all-reduce backward, like f applied once, instead of one per projection.
    if prepare_input:
        plan[prefix.rstrip(".")] = PrepareModuleInput(
            input_layouts=(Shard(1) if sequence_parallel else Replicate(),), desired_input_layouts=(Replicate(),))
    return plan


def block_plan(prefix: str = "", sequence_parallel: bool = False, prepare_input: bool = True) -> dict:
    """A transformer block: attention and MLP split; with sequence parallelism, the LayerNorms on sequence slices."""
    plan = {**attention_plan(f"{prefix}attn.", sequence_parallel, prepare_input),
            **mlp_plan(f"{prefix}mlp.", sequence_parallel)}
    if sequence_parallel:
        plan[f"{prefix}ln1"] = SequenceParallel()
        plan[f"{prefix}ln2"] = SequenceParallel()
    return plan


def transformer_plan(layers: int) -> dict:
    """Every block of a :class:`~course_lib.models.Transformer` split; embeddings, LayerNorms and head whole."""
    plan: dict = {}
    for i in range(layers):
        plan.update(block_plan(f"blocks.{i}."))
    return plan


def parallelize(module: nn.Module, mesh, plan: dict) -> nn.Module:
    """``parallelize_module`` (in place; returns ``module``). An empty key means ``module`` itself."""
    root = {k: v for k, v in plan.items() if k == ""}
    rest = {k: v for k, v in plan.items() if k != ""}
    if rest:
        parallelize_module(module, mesh, rest)
    if root:
        parallelize_module(module, mesh, root[""])
    return module


def local(t):
    """The part of ``t`` this rank holds (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(param):
    """This rank's part of ``param``'s gradient, in the parameter's own placement.

    A gradient can be left ``Partial`` (each rank holding a partial sum): a LayerNorm's, under sequence
    parallelism, since each rank saw only its positions. DTensor defers that all-reduce until the value is
    needed (the optimizer's update asks for it); here it is asked for explicitly.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def full(t):
    """The whole of ``t``, gathered from every rank that holds a part (``t`` itself when it is not a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def placements_worker(rank: int, world_size: int, rows: int = 4, cols: int = 4) -> dict:
    """One (rows × cols) tensor, ``arange``, as a DTensor in each placement, and redistributed between them.

    Returns ``{"placements": {label: local part}, "redistribute": {label: (local part, [collectives])}}``: what
    this rank holds, and which collective each ``redistribute`` ran (recorded by
    :class:`course_lib.comm.record.CollectiveLog`).
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    from .. import hardware
    from ..comm.record import CollectiveLog

    device = hardware.rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    whole = torch.arange(float(rows * cols), device=device).view(rows, cols)
    mine = torch.where(torch.arange(rows * cols, device=device).view(rows, cols) % world_size == rank, whole, 0.0)
    made = {"Shard(0)": distribute_tensor(whole, mesh, [Shard(0)]),
            "Shard(1)": distribute_tensor(whole, mesh, [Shard(1)]),
            "Replicate()": distribute_tensor(whole, mesh, [Replicate()]),
            "Partial()": DTensor.from_local(mine, mesh, [Partial()])}   # the ranks' parts add up to `whole`
    moves = {"Shard(0) → Replicate()": ("Shard(0)", Replicate()), "Partial() → Replicate()": ("Partial()", Replicate()),
             "Partial() → Shard(0)": ("Partial()", Shard(0)), "Replicate() → Shard(1)": ("Replicate()", Shard(1))}
    out = {"placements": {k: v.to_local().cpu() for k, v in made.items()}, "redistribute": {}}
    for label, (source, target) in moves.items():
        with CollectiveLog() as log:
            moved = made[source].redistribute(mesh, [target]).to_local().cpu()
        out["redistribute"][label] = (moved, [r.kind for r in log.records])
    return out


def reduce_partial_grads(module: nn.Module) -> int:
    """Redistribute every ``Partial`` gradient of ``module`` to its parameter's placement, once; returns how many.

    DTensor keeps a gradient ``Partial`` (each rank a partial sum: a LayerNorm's under sequence parallelism) and
    reduces it on *every* read: AdamW's step reads each gradient several times, gradient clipping once more, and
    each read is an all-reduce. Call this after ``backward()`` and before clipping and the step: one all-reduce
    per such gradient, then plain reads. (FSDP2 does the same before its reduce-scatter.) Without it,
    ``p.grad.to_local()`` is this rank's partial sum, not the gradient.
    """
    count = 0
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)
            count += 1
    return count


def partial_grad_reads_worker(rank: int, world_size: int, cfg=None, remedy: bool = False, steps: int = 2,
                              seed: int = 0) -> dict:
    """A sequence-parallel DTensor block trained ``steps`` steps with ``clip_grad_norm_`` and AdamW: the
    all-reduces each phase ran per step (``counts``: ``[{"remedy": n, "clip": n, "step": n}, ...]``), the final
    weights (``weights``) and, after the first backward, ``ln1.weight``'s ``grad.to_local()`` before any remedy
    next to the unsplit block's gradient (``local``, ``unsplit``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .. import hardware
    from ..comm.record import CollectiveLog
    from ..models import TransformerConfig
    from .check import split, unsplit

    cfg = cfg or TransformerConfig()
    device = hardware.rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, cfg.seq_len, cfg.dim, generator=g).to(device)
    full_block = unsplit("block", cfg, seed).to(device)
    full_block(x).square().sum().backward()
    part = split("block", full_block, "dtensor", True, mesh)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    counts, seen = [], {}
    for step in range(steps):
        opt.zero_grad()
        local(part(x.chunk(world_size, 1)[rank])).square().sum().backward()
        if step == 0:
            seen = {"local": local(part.ln1.weight.grad).detach().cpu(), "unsplit": full_block.ln1.weight.grad.cpu()}
        phases = {}
        for phase, act in (("remedy", lambda: reduce_partial_grads(part) if remedy else 0),
                           ("clip", lambda: torch.nn.utils.clip_grad_norm_(part.parameters(), 1e9)),
                           ("step", opt.step)):
            with CollectiveLog() as log:
                act()
            phases[phase] = sum(1 for r in log.records if r.kind == "all-reduce")
        counts.append(phases)
    weights = {k: full(p).detach().cpu() for k, p in part.named_parameters()}
    return {"counts": counts, "weights": weights, **seen}
