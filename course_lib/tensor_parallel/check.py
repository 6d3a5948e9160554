"""The proofs: split blocks equal the unsplit ones; the dropout rule holds. Workers for ``launch.run``.

:func:`compare_worker` builds the unsplit block (the same on every rank, from a seed), runs it forward and
backward on one input, then runs the split version, from scratch or with ``parallelize_module``, with or
without sequence parallelism, and returns the largest difference of the output, the input's gradient and each
parameter's gradient (compared with the slice of the unsplit gradient this rank holds).

:func:`dropout_worker` records the dropout masks each rank draws, to show which must agree across ranks.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .. import hardware
from ..models.transformer import MLP, Block, CausalSelfAttention, TransformerConfig
from . import dtensor as D
from .blocks import ParallelAttention, ParallelBlock, ParallelMLP, expected_shards
from .operators import group_rank_and_size
from .sequence import sync_sequence_parallel_grads

KINDS = ("mlp", "attention", "block")
LAYOUTS = ("scratch", "dtensor")


def unsplit(kind: str, cfg: TransformerConfig, seed: int = 0) -> nn.Module:
    """The full block ``kind`` of ``cfg``'s shape, its weights a function of ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            return MLP(cfg.dim, cfg.hidden, cfg.dropout, cfg.bias)
        if kind == "attention":
            return CausalSelfAttention(cfg.dim, cfg.heads, cfg.dropout, cfg.bias)
        if kind == "block":
            return Block(cfg)
    raise ValueError(f"unknown block {kind!r}: use one of {KINDS}")


def split(kind: str, full: nn.Module, layout: str, sequence_parallel: bool = False, mesh=None) -> nn.Module:
    """``full`` split over the default group: from scratch (``scratch``) or by ``parallelize_module`` (``dtensor``)."""
    if layout == "scratch":
        cls = {"mlp": ParallelMLP, "attention": ParallelAttention, "block": ParallelBlock}[kind]
        return cls(full, sequence_parallel=sequence_parallel)
    if layout == "dtensor":
        plan = {"mlp": D.mlp_plan, "attention": D.attention_plan, "block": D.block_plan}[kind]
        return D.parallelize(copy.deepcopy(full), mesh, plan(sequence_parallel=sequence_parallel))
    raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")


def _dtensor_slice(full: torch.Tensor, param) -> torch.Tensor:
    """The part of ``full`` a 1-D-mesh DTensor parameter holds on this rank (all of it for a plain tensor)."""
    if not isinstance(param, DTensor):
        return full
    (placement,) = param.placements
    if isinstance(placement, Shard):
        return full.chunk(param.device_mesh.size(), placement.dim)[param.device_mesh.get_local_rank()]
    return full


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def compare_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]],
                   cfg: TransformerConfig | None = None, batch: int = 2, seed: int = 0) -> dict:
    """For each ``(kind, layout, sequence_parallel)``: ``{"output": d, "input grad": d, "<param> grad": d...}``."""
    cfg = cfg or TransformerConfig()
    device = hardware.rank_device()
    mesh = None
    if any(layout == "dtensor" for _, layout, _ in cases):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cfg.seq_len, cfg.dim, generator=g).to(device)      # the same on every rank
    grad_y = torch.randn(batch, cfg.seq_len, cfg.dim, generator=g).to(device)
    results = {}
    for kind, layout, sp in cases:
        full = unsplit(kind, cfg, seed).to(device)
        x_full = x.clone().requires_grad_()
        y_full = full(x_full)
        y_full.backward(grad_y)
        part = split(kind, full, layout, sp, mesh)
        mine = (lambda t: t.chunk(world_size, 1)[rank]) if sp else (lambda t: t)   # a sequence slice, or all
        x_part = mine(x).clone().requires_grad_()
        y_part = D.local(part(x_part))
        y_part.backward(mine(grad_y))
        diffs = {"output": _max_diff(y_part, mine(y_full)), "input grad": _max_diff(x_part.grad, mine(x_full.grad))}
        if layout == "scratch":
            if sp:
                sync_sequence_parallel_grads(part)
            expected = expected_shards(full, part)
            diffs.update({f"{k} grad": _max_diff(p.grad, expected[k]) for k, p in part.named_parameters()})
        else:
            fulls = dict(full.named_parameters())
            diffs.update({f"{k} grad": _max_diff(D.local_grad(p), _dtensor_slice(fulls[k].grad, p))
                          for k, p in part.named_parameters()})
        results[kind, layout, sp] = diffs   # plain floats: they travel back from any device
    return results


def dropout_worker(rank: int, world_size: int, p: float = 0.5, same_global_seed: bool = True,
                   sharded_masks_per_rank: bool = True, cfg: TransformerConfig | None = None,
                   seed: int = 0) -> dict:
    """One training-mode forward of a split block with dropout ``p``: the masks each rank drew.

    ``same_global_seed``: every rank seeds the global generator alike (the rule for replicated activations).
    ``sharded_masks_per_rank``: attention's dropout draws from a per-rank generator (the rule for sharded ones);
    ``False`` replaces it by a plain ``nn.Dropout``, drawing from the global generator like everything else.
    Returns the attention-probability masks of this rank's heads (``sharded``), the block's output-side masks
    (``replicated``), and the block's output.
    """
    cfg = cfg or TransformerConfig(seq_len=8)
    _, n = group_rank_and_size()
    device = hardware.rank_device()
    block = ParallelBlock(unsplit("block", cfg.with_(dropout=p), seed).to(device), seed=seed).train()
    if not sharded_masks_per_rank:
        block.attn.attn_dropout = nn.Dropout(p)
    masks: dict[str, list[torch.Tensor]] = {"sharded": [], "replicated": []}

    def record(name):
        def hook(module, inputs, output):
            masks[name].append(((output != 0) | (inputs[0] == 0)).cpu())   # kept, or zero anyway
        return hook

    block.attn.attn_dropout.register_forward_hook(record("sharded"))
    block.attn.resid_dropout.register_forward_hook(record("replicated"))
    block.mlp.dropout.register_forward_hook(record("replicated"))
    torch.manual_seed(seed + (0 if same_global_seed else 1 + rank))
    x = torch.randn(2, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad():
        out = block(x).cpu()
    return {"sharded": masks["sharded"][0], "replicated": masks["replicated"], "output": out,
            "heads": cfg.heads // n}
