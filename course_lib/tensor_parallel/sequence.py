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
from .operators import gather_sequence, scatter_sequence
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
