"""Tensor parallelism: each layer's matrices split across the ranks of a group (notebooks 11 and 12).

* :mod:`.operators`: ``f`` and ``g`` (copy / all-reduce and their conjugates) as autograd functions; the
  sequence-parallel all-gather and reduce-scatter.
* :mod:`.layers`: :func:`column_parallel` and :func:`row_parallel`, from a full ``nn.Linear``.
* :mod:`.blocks`: the transformer's MLP and attention (split by heads), a block, the whole model.
* :mod:`.sequence`: sequence parallelism around the split blocks.
* :mod:`.random`: dropout masks that agree across ranks, or deliberately do not (one stream per rank).
* :mod:`.dtensor`: the same layouts with PyTorch's DTensor and ``parallelize_module``; placements drawn.
* :mod:`.comm`: the collectives a forward and backward issue, counted in bytes.
* :mod:`.cost`: their price per layer with the α-β model and published GPU figures (why TP stays in a node).
* :mod:`.check`: the proofs as workers: split blocks against unsplit ones, dropout masks across ranks.
* :mod:`.training`: the small transformer trained split (from scratch, DTensor, a 2-D mesh with FSDP2).

``column_parallel`` and ``row_parallel`` are the entry points; everything else builds on them.
"""
from .blocks import (
    ParallelAttention,
    ParallelBlock,
    ParallelMLP,
    expected_shards,
    tensor_parallel_transformer,
)
from .layers import ColumnParallelLinear, RowParallelLinear, column_parallel, row_parallel, shard_range
from .operators import f, g, gather_sequence, group_rank_and_size, reduce_scatter_sequence, scatter_sequence
from .random import RankGenerator, ShardedDropout, sharded_seed, use_sharded_dropout
from .sequence import (
    join_sequence,
    sequence_parallel_block,
    sequence_parallel_params,
    split_sequence,
    sync_sequence_parallel_grads,
)

__all__ = ["f", "g", "gather_sequence", "reduce_scatter_sequence", "scatter_sequence", "group_rank_and_size",
           "column_parallel", "row_parallel", "ColumnParallelLinear", "RowParallelLinear", "shard_range",
           "ParallelMLP", "ParallelAttention", "ParallelBlock", "tensor_parallel_transformer", "expected_shards",
           "sequence_parallel_block", "sequence_parallel_params", "sync_sequence_parallel_grads", "split_sequence",
           "join_sequence", "ShardedDropout", "RankGenerator", "use_sharded_dropout", "sharded_seed"]
