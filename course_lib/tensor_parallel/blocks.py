"""The transformer's blocks split across a tensor-parallel group, from scratch (Megatron-LM's layout).

* :class:`ParallelMLP`: ``up`` column-parallel, ``down`` row-parallel: each rank computes ``hidden/N`` of the
  hidden units, GELU acts on them without communication, and one all-reduce (``g``) adds the partial outputs.
* :class:`ParallelAttention`: split **by heads**. ``q``, ``k``, ``v`` column-parallel give each rank whole heads
  (head ``h`` uses only its own columns), attention runs per head with no communication, ``out`` row-parallel
  adds the heads' contributions. ``f`` is applied once, before ``q``, ``k`` and ``v`` (they share one input).
* :class:`ParallelBlock`, :func:`tensor_parallel_transformer`: LayerNorms, embeddings and the LM head stay
  whole on every rank (they are cheap); every block's attention and MLP are split.

Each class subclasses the unsplit module and keeps its ``forward``: only the layers inside change. That is
the point of tensor parallelism: the maths is the same, only who holds which slice changes.

With ``sequence_parallel=True`` the block's input and output are slices of the *sequence* instead of whole
(:mod:`.sequence`): the edges become all-gather / reduce-scatter, and dropout there acts on sharded data.

Dropout on sharded activations draws from ``rng``, a :class:`~.random.RankGenerator`: give every block of a
model the **same** one (as :func:`tensor_parallel_transformer` does), so that its stream advances from block
to block; the others draw from the global generator, seeded alike on every rank.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..models.transformer import MLP, Block, CausalSelfAttention, Transformer
from .layers import ColumnParallelLinear, RowParallelLinear
from .operators import f, gather_sequence, group_rank_and_size
from .random import RankGenerator, use_sharded_dropout


def _rank_generator(rng: RankGenerator | None, group) -> RankGenerator:
    """``rng``, or a stream of this rank's own (seed 0) for a module built alone."""
    return rng if rng is not None else RankGenerator(0, group_rank_and_size(group)[0])


class ParallelMLP(MLP):
    """This rank's ``hidden/N`` units of an :class:`~course_lib.models.MLP`; ``forward`` is MLP's own."""

    def __init__(self, mlp: MLP, group=None, sequence_parallel: bool = False, rng: RankGenerator | None = None):
        nn.Module.__init__(self)
        self.up = ColumnParallelLinear(mlp.up, group, entry="gather" if sequence_parallel else "copy")
        self.down = RowParallelLinear(mlp.down, group, exit="reduce_scatter" if sequence_parallel else "reduce")
        self.dropout = nn.Dropout(mlp.dropout.p)   # whole output: the global generator, alike on every rank...
        use_sharded_dropout(self, _rank_generator(rng, group), sequence_parallel)   # ...unless a sequence slice


class ParallelAttention(CausalSelfAttention):
    """This rank's ``heads/N`` heads of a :class:`~course_lib.models.CausalSelfAttention`."""

    def __init__(self, attn: CausalSelfAttention, group=None, sequence_parallel: bool = False,
                 rng: RankGenerator | None = None):
        nn.Module.__init__(self)
        _, n = group_rank_and_size(group)
        heads = attn.q.out_features // attn.head_dim
        if heads % n:
            raise ValueError(f"{heads} heads do not divide by the {n} ranks of the group: tensor parallelism gives "
                             f"each rank whole heads, so use a number of heads that is a multiple of {n}")
        self.group, self.sequence_parallel, self.head_dim = group, sequence_parallel, attn.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(lin, group, entry="none") for lin in (attn.q, attn.k, attn.v))
        self.out = RowParallelLinear(attn.out, group, exit="reduce_scatter" if sequence_parallel else "reduce")
        self.attn_dropout, self.resid_dropout = nn.Dropout(attn.attn_dropout.p), nn.Dropout(attn.resid_dropout.p)
        use_sharded_dropout(self, _rank_generator(rng, group), sequence_parallel)   # this rank's heads: own masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, 1, self.group) if self.sequence_parallel else f(x, self.group)
        return super().forward(x)   # q, k, v, attention and out: the unsplit module's code


class ParallelBlock(Block):
    """A transformer block with its attention and MLP split; its LayerNorms whole on every rank."""

    def __init__(self, block: Block, group=None, sequence_parallel: bool = False, rng: RankGenerator | None = None):
        nn.Module.__init__(self)
        rng = _rank_generator(rng, group)   # one stream for the attention and the MLP
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelAttention(block.attn, group, sequence_parallel, rng)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel, rng)
        if sequence_parallel:   # each rank normalises only its slice of the sequence: partial gradients
            for p in (*self.ln1.parameters(), *self.ln2.parameters()):
                p.sequence_parallel = True


def tensor_parallel_transformer(model: Transformer, group=None, seed: int = 0) -> Transformer:
    """A copy of ``model`` whose blocks' attention and MLP are split over ``group`` (the rest is whole).

    Every block's sharded dropouts draw from one :class:`~.random.RankGenerator` (``seed``, this rank): one
    stream per rank, advancing across the blocks and the steps, as Megatron-LM's random tracker does.
    """
    rng = RankGenerator(seed, group_rank_and_size(group)[0])
    out = copy.deepcopy(model)
    out.blocks = nn.ModuleList(ParallelBlock(b, group, rng=rng) for b in model.blocks)
    return out


def expected_shards(full: nn.Module, parallel: nn.Module, grads: bool = True) -> dict[str, torch.Tensor]:
    """For each parameter of ``parallel``, the slice of ``full``'s matching gradient (or weight) it must equal.

    The parallel modules keep the unsplit modules' names (``attn.q``, ``mlp.up``...), so ``full``'s module of
    the same name is the one that was split; a layer that was not split is compared whole.
    """
    full_modules = dict(full.named_modules())
    out = {}
    for name, module in parallel.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            source = getattr(full_modules[name], pname)
            tensor = source.grad if grads else source.detach()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                tensor = module.shard(pname, tensor)
            out[f"{name}.{pname}" if name else pname] = tensor
    return out
