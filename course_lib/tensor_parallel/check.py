"""The proofs: split blocks equal the unsplit ones; the dropout rule holds. Workers for ``launch.run``.

:func:`compare_worker` builds the unsplit block (the same on every rank, from a seed), runs it forward and
backward on one input, then runs the split version, from scratch or with ``parallelize_module``, with or
without sequence parallelism, and returns the largest difference of the output, the input's gradient and each
parameter's gradient (compared with the slice of the unsplit gradient this rank holds).

:func:`dropout_worker` records the dropout masks each rank draws, block after block and step after step, to show
which must agree across ranks and that none repeats. :func:`grad_placements_worker` shows where DTensor leaves
the gradients under sequence parallelism.
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
from .random import RankGenerator, use_sharded_dropout
from .sequence import sync_sequence_parallel_grads

KINDS = ("mlp", "attention", "block")
LAYOUTS = ("scratch", "dtensor", "dtensor-unprepared")   # the last: attention without its PrepareModuleInput


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


def split(kind: str, full: nn.Module, layout: str, sequence_parallel: bool = False, mesh=None,
          rng: RankGenerator | None = None) -> nn.Module:
    """``full`` split over the default group: from scratch (``scratch``) or by ``parallelize_module`` (``dtensor``;
    ``dtensor-unprepared``: attention without its ``PrepareModuleInput``). Dropouts on sharded activations draw
    from ``rng`` (by default a stream of this rank's own) in both."""
    if layout == "scratch":
        cls = {"mlp": ParallelMLP, "attention": ParallelAttention, "block": ParallelBlock}[kind]
        return cls(full, sequence_parallel=sequence_parallel, rng=rng)
    if layout in ("dtensor", "dtensor-unprepared"):
        prepare = {} if kind == "mlp" else {"prepare_input": layout == "dtensor"}
        plan = {"mlp": D.mlp_plan, "attention": D.attention_plan, "block": D.block_plan}[kind]
        part = D.parallelize(copy.deepcopy(full), mesh, plan(sequence_parallel=sequence_parallel, **prepare))
        return use_sharded_dropout(part, rng or RankGenerator(0, mesh.get_local_rank()), sequence_parallel)
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
    if any(layout != "scratch" for _, layout, _ in cases):
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


def _draw_masks(rank: int, world_size: int, mesh, layout: str, sequence_parallel: bool, sharded_masks_per_rank: bool,
                same_global_seed: bool, p: float, layers: int, steps: int, cfg: TransformerConfig, seed: int) -> dict:
    """One case of :func:`dropout_worker`."""
    device = hardware.rank_device()
    rng = RankGenerator(seed, rank)   # one stream for all the blocks, as in a model
    blocks = [split("block", unsplit("block", cfg.with_(dropout=p), seed + i).to(device), layout,
                    sequence_parallel, mesh, rng).train() for i in range(layers)]
    masks: dict[str, list[torch.Tensor]] = {"attention": [], "residual": []}

    def record(name):
        def hook(module, inputs, output):
            masks[name].append(((output != 0) | (inputs[0] == 0)).cpu())   # kept, or zero anyway
        return hook

    for block in blocks:
        if not sharded_masks_per_rank:
            block.attn.attn_dropout, block.attn.resid_dropout, block.mlp.dropout = (nn.Dropout(p) for _ in range(3))
        block.attn.attn_dropout.register_forward_hook(record("attention"))
        block.attn.resid_dropout.register_forward_hook(record("residual"))
        block.mlp.dropout.register_forward_hook(record("residual"))
    torch.manual_seed(seed + (0 if same_global_seed else 1 + rank))
    x = torch.randn(2, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(seed)).to(device)
    if sequence_parallel:
        x = x.chunk(world_size, 1)[rank]
    outputs = []
    with torch.no_grad():
        for _ in range(steps):
            h = x
            for block in blocks:
                h = D.local(block(h))
            outputs.append(h.cpu())
    att, res = masks["attention"], masks["residual"]
    out = {"attention": [att[s * layers:(s + 1) * layers] for s in range(steps)],
           "residual": [[res[2 * (s * layers + b):2 * (s * layers + b) + 2] for b in range(layers)]
                        for s in range(steps)],
           "output": outputs}
    if layout == "scratch" and not sequence_parallel:   # one more step, with backward: a replicated gradient
        h = x                                            # (its masks come after those returned above)
        for block in blocks:
            h = block(h)
        h.square().sum().backward()
        out["down.bias grad"] = dict(blocks[-1].named_parameters())["mlp.down.bias"].grad.cpu()
    return out


def dropout_worker(rank: int, world_size: int, cases: list[tuple[str, bool, bool, bool]], p: float = 0.5,
                   layers: int = 2, steps: int = 2, cfg: TransformerConfig | None = None, seed: int = 0) -> dict:
    """``steps`` training-mode forwards of ``layers`` split blocks with dropout ``p``: the masks each rank drew.

    For each case ``(layout, sequence_parallel, sharded_masks_per_rank, same_global_seed)``:

    * ``layout``: ``"scratch"`` or ``"dtensor"``, split as :func:`split` does, the blocks' sharded dropouts
      sharing one :class:`~.random.RankGenerator` (``seed``, this rank), as in a model;
    * ``sharded_masks_per_rank=False`` makes every dropout a plain ``nn.Dropout`` on the global generator (what
      ``parallelize_module`` gives as it is);
    * ``same_global_seed``: every rank seeds the global generator alike (the rule for replicated activations).

    Returns ``{case: result}``; each result holds, indexed ``[step][block]``, the attention-probability masks of
    this rank's heads (``attention``) and the residual branches' two masks (``residual``: whole activations, or
    sequence slices under sequence parallelism), and the last block's output at each step (``output``). From
    scratch without sequence parallelism, also the last block's ``mlp.down.bias`` gradient after one more step
    (``down.bias grad``): a replicated parameter's, which every rank should hold alike.
    """
    cfg = cfg or TransformerConfig(seq_len=8)
    mesh = None
    if any(layout != "scratch" for layout, *_ in cases):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(hardware.rank_device().type, (world_size,))
    return {case: _draw_masks(rank, world_size, mesh, *case, p, layers, steps, cfg, seed) for case in cases}


def _kind(placement) -> str:
    """``"partial"``, ``"replicate"`` or ``"shard"``, from the placement's public methods (not its repr)."""
    return "partial" if placement.is_partial() else "replicate" if placement.is_replicate() else "shard"


def grad_placements_worker(rank: int, world_size: int, cfg: TransformerConfig | None = None, batch: int = 2,
                           seed: int = 0) -> dict:
    """A block split by ``parallelize_module`` with sequence parallelism, after one backward: each parameter's
    placement and its gradient's (``placements``, as printed; ``grad kind``, read from the placement), and
    the total gradient norm, as gradient clipping computes it (``norm``, with the collectives it ran,
    ``norm collectives``), next to the unsplit block's (``unsplit norm``) and to the norm of the from-scratch
    block's local gradients after their sync (``scratch local norm``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..comm.record import CollectiveLog

    cfg = cfg or TransformerConfig()
    device = hardware.rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cfg.seq_len, cfg.dim, generator=g).to(device)
    full = unsplit("block", cfg, seed).to(device)
    full(x).square().sum().backward()
    part = split("block", full, "dtensor", True, mesh)
    D.local(part(x.chunk(world_size, 1)[rank])).square().sum().backward()
    with CollectiveLog() as log:
        norm = D.full(torch.nn.utils.get_total_norm([p.grad for p in part.parameters()])).item()
    # the from-scratch block, its gradients synced: the norm over this rank's own tensors, as clipping would take it
    scratch = split("block", full, "scratch", True)
    scratch(x.chunk(world_size, 1)[rank]).square().sum().backward()
    sync_sequence_parallel_grads(scratch)
    return {"placements": {k: (str(p.placements), str(p.grad.placements)) for k, p in part.named_parameters()},
            "grad kind": {k: _kind(p.grad.placements[0]) for k, p in part.named_parameters()},
            "norm": norm, "norm collectives": [r.kind for r in log.records],
            "scratch local norm": torch.nn.utils.get_total_norm([p.grad for p in scratch.parameters()]).item(),
            "unsplit norm": torch.nn.utils.get_total_norm([p.grad for p in full.parameters()]).item()}
