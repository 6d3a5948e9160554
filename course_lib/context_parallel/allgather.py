"""Context parallelism by all-gathering the keys and values (as Llama 3's training did).

Every rank gathers the whole sequence's keys and values, then attends with its own queries only. Simple, and any
mask works (documents packed in one sequence, say); the cost is memory: each rank holds all of K and V. With
grouped-query attention K and V are a fraction of the activations, which is why Llama 3 chose it (with a
zig-zag-like layout of two chunks a rank to even the causal work). The backward pass sums each rank's gradient of
the whole K and V and keeps this rank's part: a reduce-scatter, sending as many bytes as the forward's gather.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor_parallel.operators import _reduce_scatter_single, group_rank_and_size
from .blocks import check_layout, chunk_ids, nbytes, record, shard, unshard


class GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence) in the layout's order; backward: sum the gradients, keep our part."""

    @staticmethod
    def forward(ctx, x, layout, group):
        rank, world_size = group_rank_and_size(group)
        ctx.rank, ctx.world_size, ctx.layout, ctx.group = rank, world_size, layout, group
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        record(sent=nbytes(x) * (world_size - 1))
        return unshard(parts, 2, layout)

    @staticmethod
    def backward(ctx, grad):
        # every rank's gradient of the whole sequence, summed; each keeps its own part: a reduce-scatter
        parts = torch.cat([shard(grad, 2, r, ctx.world_size, ctx.layout) for r in range(ctx.world_size)])
        ours = torch.empty_like(parts.narrow(0, 0, grad.shape[0]))
        _reduce_scatter_single(ours, parts.contiguous(), group=ctx.group)
        record(sent=nbytes(ours) * (ctx.world_size - 1))
        return ours, None, None


def positions(layout: str, rank: int, world_size: int, s_local: int) -> torch.Tensor:
    """The positions in the whole sequence of this rank's ``s_local`` tokens, in the order it holds them."""
    size = s_local // len(chunk_ids(layout, rank, world_size))
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(layout, rank, world_size)])


def allgather_attention(q, k, v, *, causal: bool = False, layout: str = "contiguous", group=None):
    """This rank's part of full attention, after all-gathering K and V (same arguments as ring attention)."""
    check_layout(layout)
    rank, world_size = group_rank_and_size(group)
    k_all, v_all = GatherSequence.apply(k, layout, group), GatherSequence.apply(v, layout, group)
    record(kv_held=nbytes(k_all, v_all))
    mask = None
    if causal:      # query at position i sees the keys at positions 0..i
        mask = (torch.arange(k_all.shape[2]) <= positions(layout, rank, world_size, q.shape[2])[:, None])
        mask = mask.to(q.device)
    record(scores=q.shape[0] * q.shape[1] * (int(mask.sum()) if causal else q.shape[2] * k_all.shape[2]))
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
