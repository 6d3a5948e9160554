"""One rank's piece of the model: a pipeline stage, its blocks tensor-parallel, then sharded by FSDP2.

Three cuts, in this order, each along one mesh dimension:

1. **pp: which layers.** :func:`split_stage` keeps the blocks of this rank's stage. Stage 0 also holds the
   embeddings; the last stage holds the final LayerNorm and the head. The blocks keep their names
   (``blocks.2.attn.q.weight`` on stage 1), so every weight can be matched with the one-process model's.
2. **tp: which heads and which positions.** :func:`stage_plan` is the course's plan
   (:func:`course_lib.tensor_parallel.dtensor.block_plan`) with sequence parallelism: inside a block, attention
   and the MLP split by heads and columns; around them, the LayerNorms and residuals work on ``seq/tp`` positions.
   A block takes and returns this rank's slice of the sequence, so that is also what crosses between stages. At
   the model's two ends the plan adds one edge each: stage 0 cuts the embeddings' output into slices (backward:
   an all-gather of its gradient), the last stage gathers the whole sequence again before the final LayerNorm
   and the head (kept whole on every tp rank).
3. **dp: which rows.** :func:`shard_stage` applies FSDP2 (``fully_shard``) over the dp sub-mesh: one unit per
   block, and the stage itself for the rest. A block's parameters end as DTensors over the (dp, tp) mesh: a
   column-parallel weight ``(_StridedShard(0), Shard(0))`` (dp takes rows of tp's rows), a row-parallel one
   ``(Shard(0), Shard(1))``, a LayerNorm's ``(Shard(0), Replicate())``; the embeddings and the head, which tp
   leaves whole, are DTensors over dp alone, ``(Shard(0),)``.
   ``reshard_after_forward=False``: a unit stays gathered across the step's micro-batches, so it is all-gathered
   once per step, not once per micro-batch (what torchtitan does under pipelining too).

What each rank holds, for the course's 4-block model on 2×2×2: the weights of one stage (half the model), of which
a quarter of each split weight (tp halves it, dp halves it again: ``blocks.0.mlp.up.weight`` is ``hidden/4 × dim``)
and half of each other weight (dp only: ``tok_emb.weight`` is ``vocab/2 × dim``).

Two things torch does here that the plan relies on (torch 2.13):

* under sequence parallelism the LayerNorms' gradients come out ``Partial`` over tp (each tp rank saw its own
  positions); FSDP2 all-reduces them over tp itself (it redistributes a gradient to its parameter's placement)
  before it reduce-scatters over dp: four all-reduces per block, at the end of the step;
* the whole sequence is gathered at the final LayerNorm's input, not at the last block's output: a
  ``PrepareModuleOutput`` there works too, but hands FSDP2 a view as the block's output, which it warns about.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..models.transformer import Transformer, TransformerConfig


def stage_blocks(layers: int, pp: int, stage: int) -> range:
    """The block indices of pipeline stage ``stage``: ``layers / pp`` consecutive ones."""
    if layers % pp:
        raise ValueError(f"{layers} blocks do not split into {pp} equal pipeline stages: "
                         f"choose a number of blocks that divides by pp")
    per = layers // pp
    return range(stage * per, (stage + 1) * per)


class Stage(nn.Module):
    """The part of a :class:`~course_lib.models.Transformer` that one pipeline stage runs.

    First stage: tokens (batch, seq) → embeddings → its blocks. Middle stages: blocks only. Last stage: blocks →
    final LayerNorm → head → logits (batch, seq, vocab). Between stages flows the residual stream.
    """

    def __init__(self, model: Transformer, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})   # names as in the full model
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:    # x: token ids
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def split_stage(model: Transformer, pp: int, stage: int) -> Stage:
    """Stage ``stage`` of ``pp``: its blocks (:func:`stage_blocks`), with the embeddings or the head at the ends."""
    blocks = stage_blocks(model.cfg.layers, pp, stage)
    return Stage(model, blocks, first=stage == 0, last=stage == pp - 1)


def stage_plan(stage: Stage) -> dict:
    """The ``parallelize_module`` plan of a stage: every block with sequence parallelism, and the two ends.

    ``blocks.i.``'s plan is :func:`~course_lib.tensor_parallel.dtensor.block_plan` with ``sequence_parallel=True``.
    The first block of stage 0 gets its input whole (the embeddings are not split) and keeps this rank's slice of
    the sequence; the final LayerNorm of the last stage gathers the whole sequence from the last block's slices.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from ..tensor_parallel.dtensor import block_plan

    plan: dict = {}
    names = list(stage.blocks)
    for i in names:
        plan.update(block_plan(f"blocks.{i}.", sequence_parallel=True))
    if stage.first:     # whole → slice: a local cut forward, an all-gather of the gradient backward
        plan[f"blocks.{names[0]}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Shard(1),), use_local_output=True)
    if stage.last:      # slice → whole, before the final LayerNorm: an all-gather forward, a local cut backward
        plan["ln_f"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return plan


def shard_stage(stage: Stage, dp_mesh, sum_bug: bool = False) -> Stage:
    """FSDP2 over ``dp_mesh``: one unit per block, then the stage (embeddings or head); gradients averaged over dp.

    On Gloo the average is a sum divided by FSDP2 itself (:func:`course_lib.zero.fsdp2.force_sum_on_gloo`).
    ``sum_bug=True`` leaves the sum undivided (:func:`course_lib.zero.fsdp2.sum_instead_of_average`): a wrong
    model on purpose, for the check to catch.
    """
    from torch.distributed.fsdp import fully_shard

    from ..zero.fsdp2 import force_sum_on_gloo, sum_instead_of_average

    for block in stage.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
    if sum_bug:
        sum_instead_of_average(stage)
    else:
        force_sum_on_gloo(stage)
    return stage


def build_stage(cfg: TransformerConfig, seed: int, mesh, dtype: torch.dtype = torch.float64,
                sum_bug: bool = False) -> Stage:
    """This rank's stage of the model of ``cfg`` (weights from ``seed``, in ``dtype``): split, TP+SP, FSDP2.

    Every rank builds the same full model first, so each one's pieces are pieces of the same weights.
    """
    from ..models.transformer import transformer
    from ..tensor_parallel.dtensor import parallelize

    if cfg.heads % mesh["tp"].size() or cfg.seq_len % mesh["tp"].size():
        raise ValueError(f"tp={mesh['tp'].size()} must divide the heads ({cfg.heads}) and the sequence "
                         f"({cfg.seq_len}): each tp rank takes whole heads and an equal slice of the positions")
    device = torch.device(mesh.device_type)
    model = transformer(cfg, seed=seed).to(device=device, dtype=dtype)
    stage = split_stage(model, mesh["pp"].size(), mesh["pp"].get_local_rank())
    parallelize(stage, mesh["tp"], stage_plan(stage))
    return shard_stage(stage, mesh["dp"], sum_bug=sum_bug)
