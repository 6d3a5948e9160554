"""Ring attention: each rank keeps its queries; the keys and values go round the ring of ranks.

Rank r holds a part of the sequence: its queries, keys and values. At step 0 it attends to its own keys. Then
every rank passes the keys and values it holds to the next rank (r → r+1, the last to the first) and receives the
previous rank's; after W−1 passes every rank has seen every block once. The partial results merge by their
log-sum-exp (:func:`.blocks.merge`), so the output is exactly full attention's. Besides its own keys and values,
a rank holds two blocks: the one it computes with and the one arriving. The next block's transfer is started
before the current block's product, so the two overlap. Scores, the running output and lse are kept in float32
(float64 for float64 inputs); the blocks travel in the inputs' dtype.

The backward pass goes round the ring again: each rank computes, for the block it holds, its queries'
gradient and that block's share of the key and value gradients; the latter travel one rank behind the block
and are back at their owner after W passes. A rank sends (W − 1) blocks of keys and values in the forward, and
(W − 1) blocks of keys and values plus W blocks of their gradients (in float32) in the backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.operators import group_rank_and_size
from .blocks import accumulation_dtype, block_attention, check_layout, merge, nbytes, pairs, record


def exchange(tensor, rank, world_size, group):
    """Start sending ``tensor`` to the next rank and receiving the previous rank's: ``(received, requests)``."""
    received = torch.empty_like(tensor)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    ops = [dist.P2POp(dist.isend, tensor, peer((rank + 1) % world_size), group),
           dist.P2POp(dist.irecv, received, peer((rank - 1) % world_size), group)]
    record(sent=nbytes(tensor))
    return received, dist.batch_isend_irecv(ops)


def ring_forward(q, k, v, causal, layout, group):
    """The algorithm: ``(out, lse)`` of this rank's queries against the whole sequence's keys."""
    rank, world_size = group_rank_and_size(group)
    qs = q.chunk(2 if layout == "zigzag" else 1, dim=2)             # the zig-zag layout: two chunks a rank
    out = [torch.zeros(part.shape, dtype=accumulation_dtype(q), device=q.device) for part in qs]
    lse = [torch.full(part.shape[:-1], float("-inf"), dtype=accumulation_dtype(q), device=q.device) for part in qs]
    kv = torch.stack([k, v])                                        # one message: keys and values together
    for step in range(world_size):
        source = (rank - step) % world_size                         # whose keys and values we hold now
        if step < world_size - 1:
            incoming, requests = exchange(kv, rank, world_size, group)   # the next block, while we compute
            record(kv_held=nbytes(kv, incoming))
        ks, vs = kv[0].chunk(len(qs), dim=2), kv[1].chunk(len(qs), dim=2)
        for i, j, diagonal in pairs(layout, rank, source, world_size, causal):
            block_out, block_lse = block_attention(qs[i], ks[j], vs[j], diagonal)
            out[i], lse[i] = merge(out[i], lse[i], block_out, block_lse)
            n, m = qs[i].shape[2], ks[j].shape[2]
            record(scores=q.shape[0] * q.shape[1] * (n * (n + 1) // 2 if diagonal else n * m))
        if step < world_size - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)


def _block_grads(q, k, v, out_grad, lse, delta, diagonal):
    """The gradients of one block: ``(dq, dk, dv)`` for queries ``q`` against keys ``k``, values ``v``."""
    q, k, v, out_grad = (t.to(lse.dtype) for t in (q, k, v, out_grad))
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))                  # the softmax over *all* keys, this block's columns
    dp = out_grad @ v.transpose(-2, -1)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ out_grad


def ring_backward(q, k, v, out, lse, out_grad, causal, layout, group):
    """The gradients of q, k and v of this rank's part, going round the ring a second time.

    The key and value gradients of a block travel with it, one rank behind: each rank adds its share of the block
    it holds and passes the sum on, and the transfer runs while the rank computes with the next block. After W
    passes (one more than the forward's W − 1) each block's gradients are home, summed over every rank."""
    rank, world_size = group_rank_and_size(group)
    n_chunks = 2 if layout == "zigzag" else 1
    delta = (out_grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)   # Σ_d dO·O: the softmax's backward needs it
    qs, gs, ls, ds = (t.chunk(n_chunks, dim=2) for t in (q, out_grad, lse, delta))
    dq = [torch.zeros(part.shape, dtype=lse.dtype, device=q.device) for part in qs]
    kv, passing = torch.stack([k, v]), None          # passing: the gradients on their way from the previous rank
    for step in range(world_size):
        source = (rank - step) % world_size
        if step < world_size - 1:
            incoming, requests = exchange(kv, rank, world_size, group)
        ks, vs = kv[0].chunk(n_chunks, dim=2), kv[1].chunk(n_chunks, dim=2)
        dks = [torch.zeros(part.shape, dtype=lse.dtype, device=q.device) for part in ks]
        dvs = [torch.zeros_like(part) for part in dks]
        for i, j, diagonal in pairs(layout, rank, source, world_size, causal):
            g_q, g_k, g_v = _block_grads(qs[i], ks[j], vs[j], gs[i], ls[i], ds[i], diagonal)
            dq[i], dks[j], dvs[j] = dq[i] + g_q, dks[j] + g_k, dvs[j] + g_v
        dkv = torch.stack([torch.cat(dks, dim=2), torch.cat(dvs, dim=2)])
        if passing is not None:                        # the previous ranks' shares of this block's gradients
            for request in passing[1]:
                request.wait()
            dkv = dkv + passing[0]
        if world_size > 1:
            passing = exchange(dkv, rank, world_size, group)
        if step < world_size - 1:
            for request in requests:
                request.wait()
            kv = incoming
    if passing is not None:
        for request in passing[1]:
            request.wait()
        dkv = passing[0]                               # our own block's, summed over every rank
    return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group):
        out, lse = ring_forward(q, k, v, causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = causal, layout, group
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, out_grad.contiguous(), *ctx.options)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, *, causal: bool = False, layout: str = "contiguous", group=None):
    """This rank's part of ``softmax(q kᵀ / √d) v`` over the whole sequence, by ring attention.

    ``q``, ``k``, ``v``: this rank's part of the sequence, (batch, heads, s_local, head_dim), every rank the same
    shape. ``layout``: ``"contiguous"`` (rank r holds positions [r·s_local, (r+1)·s_local)) or ``"zigzag"``
    (chunks r and 2W−1−r of 2W, see :func:`.blocks.zigzag_shard`). Differentiable.
    """
    check_layout(layout)
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k and v must have the same shape (batch, heads, s_local, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zig-zag layout holds two equal chunks a rank: s_local must be even, got {q.shape[2]}; "
                         "shard a sequence whose length 2·world_size divides (zigzag_shard)")
    return RingAttention.apply(q, k, v, causal, layout, group)
