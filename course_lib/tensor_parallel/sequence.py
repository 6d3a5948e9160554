"""Sequence parallelism: the parts of a block that tensor parallelism leaves whole, split along the sequence.

Tensor parallelism splits attention and the MLP, but LayerNorm, dropout and the residual additions still run on
the full (batch, seq, dim) activation on **every** rank: the same work N times, the same activations stored N
times. Megatron-LM's sequence parallelism (Korthikanti et al., 2022) gives each rank ``seq/N`` positions there.
LayerNorm and dropout act on each position alone, so a slice of the sequence is all they need.

The all-reduce at each edge becomes its two halves, moving the same bytes:

* entering attention or the MLP: **all-gather** the sequence slices (backward: reduce-scatter),
* leaving it: **reduce-scatter** the partial sums, each rank keeping its slice (backward: all-gather).

Two things change for the parameters and the random numbers:

* the LayerNorms' weights, and the row-parallel layers' biases, now see only this rank's positions, so their
  gradients are partial sums: :func:`sync_sequence_parallel_grads` all-reduces them after ``backward()``;
* dropout on a sequence slice acts on sharded data: each rank must draw its own masks (:mod:`.random`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models.transformer import Block
from .blocks import ParallelBlock
from .operators import _all_gather, _reduce_scatter, gather_sequence, scatter_sequence
from .random import RankGenerator


def sequence_parallel_block(block: Block, group=None, rng: RankGenerator | None = None) -> ParallelBlock:
    """``block`` split over ``group``: tensor parallel inside, sequence parallel around.

    It takes this rank's slice of the sequence, ``(batch, seq/N, dim)``, and returns the same slice of the output.
    ``rng``: the model's one :class:`~.random.RankGenerator` for this rank (shared by all its blocks).
    """
    return ParallelBlock(block, group, sequence_parallel=True, rng=rng)


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients are partial sums under sequence parallelism."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """All-reduce (sum) the gradients of :func:`sequence_parallel_params` over ``group``; returns how many.

    Call it after ``backward()`` and before the optimizer step (Megatron-LM does it in the same place).
    """
    params = [p for p in sequence_parallel_params(module) if p.grad is not None]
    for p in params:
        dist.all_reduce(p.grad, group=group)
    return len(params)


def split_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of a (batch, seq, dim) activation every rank holds whole (backward: all-gather)."""
    return scatter_sequence(x, 1, group)


def join_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """The whole sequence from every rank's slice, ahead of a *column-parallel* layer (backward: reduce-scatter)."""
    return gather_sequence(x, 1, group)


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                                 sequence_parallel: bool = False, attention_scores: bool = True,
                                 regather: bool = True) -> float:
    """Bytes of activations one transformer layer keeps for backward: the formulas of Korthikanti et al. (2022,
    "Reducing Activation Recomputation in Large Transformer Models", Table 2), for 16-bit activations and
    1-byte dropout masks, with ``sbh = seq * batch * hidden``:

    * tensor parallelism over ``tp`` ranks: ``sbh (10 + 24/tp + 5·a·s/(h·tp))``;
    * with sequence parallelism as Megatron-LM builds it (``regather=True``): ``sbh (34/tp + 5·a·s/(h·tp))``.
      All ten whole ``sbh`` terms are divided by ``tp``: the column-parallel layers keep only their sequence
      slice of the input and all-gather it again in the backward pass (two more all-gathers per layer);
    * with sequence parallelism as this course's :class:`~.blocks.ParallelBlock` and PyTorch's
      ``SequenceParallel`` + ``ColwiseParallel`` build it (``regather=False``): the two all-gathered inputs of
      the column-parallel layers (attention's and the MLP's, 2 bytes × sbh each) stay whole:
      ``sbh (4 + 30/tp + 5·a·s/(h·tp))``;
    * ``attention_scores=False`` drops the ``5·a·s/h`` term: the ``heads × seq × seq`` scores, softmax and its
      dropout mask not kept (the paper's selective recomputation; FlashAttention-style kernels keep none either).

    Computed from the formula, not measured: :func:`course_lib.memory.activations.split_block_worker` measures
    this course's small block.
    """
    sbh = seq * batch * hidden
    scores = 5 * heads * seq / hidden / tp if attention_scores else 0.0
    if not sequence_parallel:
        return sbh * (10 + 24 / tp + scores)
    return sbh * (34 / tp + scores) if regather else sbh * (4 + 30 / tp + scores)


class RegatheredColumnLinear(torch.autograd.Function):
    """Megatron-LM's re-gather: a column-parallel layer on a sequence slice that keeps only the slice for backward.

    Forward all-gathers the sequence and applies the layer, as :func:`join_sequence` then ``F.linear`` do, but
    saves this rank's slice instead of the whole input; backward all-gathers it again for the weight gradient
    and reduce-scatters the input gradient. One more all-gather per layer, ``(N−1)/N`` of the input less to keep.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return torch.nn.functional.linear(_all_gather(x, 1, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _all_gather(x, 1, ctx.group)                        # gathered again
        grad_x = _reduce_scatter(grad @ weight, 1, ctx.group)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t() @ whole.reshape(-1, whole.shape[-1])
        return grad_x, grad_w, flat.sum(0) if ctx.has_bias else None, None


def regather_worker(rank: int, world_size: int, batch: int = 2, seq: int = 8, dim: int = 16, out: int = 32) -> dict:
    """A column-parallel layer on this rank's sequence slice, as this course builds it (gather, then ``F.linear``)
    and with Megatron-LM's re-gather: the bytes each keeps for backward (parameters and their views excluded), its
    collectives, and the largest difference of output and gradients between the two."""
    from .. import hardware
    from ..comm.record import CollectiveLog

    device = hardware.rank_device()   # the rank's GPU under NCCL (which has no CPU tensors), else the CPU
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, seq, dim, generator=g).chunk(world_size, 1)[rank].to(device)
    weight = torch.randn(out, dim, generator=g).chunk(world_size, 0)[rank].to(device)
    bias = torch.randn(out, generator=g).chunk(world_size, 0)[rank].to(device)
    grad_y = torch.randn(batch, seq, out // world_size, generator=g).to(device)
    result = {}
    for how in ("gather, then F.linear", "re-gather"):
        xi, w, bb = (t.clone().requires_grad_() for t in (x, weight, bias))
        kept = []

        def pack(t, params=(w, bb), kept=kept):
            if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in params):
                kept.append(t.numel() * t.element_size())
            return t

        with CollectiveLog() as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = (RegatheredColumnLinear.apply(xi, w, bb, None) if how == "re-gather"
                 else torch.nn.functional.linear(join_sequence(xi), w, bb))
            with log.during("backward"):
                y.backward(grad_y)
        result[how] = {"kept bytes": sum(kept), "collectives": [(r.kind, r.phase) for r in log.records],
                       "values": [y.detach(), xi.grad, w.grad, bb.grad]}
    a, b = (result[h].pop("values") for h in ("gather, then F.linear", "re-gather"))
    result["largest difference"] = max((p - q).abs().max().item() for p, q in zip(a, b))
    return result
