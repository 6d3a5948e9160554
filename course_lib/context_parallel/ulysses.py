"""Ulysses (DeepSpeed-Ulysses): trade the sequence split for a head split, attend, trade back.

Each rank holds a part of the sequence for *all* heads. One all-to-all gives each rank the *whole* sequence for
H/W of the heads; attention runs there as on one process (the heads are independent); a second all-to-all gives
each rank its part of the sequence back, for all heads. Four all-to-alls forward (q, k, v, the output), each rank
sending (W−1)/W of each tensor, whatever W: unlike the ring, its traffic per rank does not grow with the number of
ranks. Its limit is the head count: W must divide the query heads (with grouped-query attention, implementations
repeat the key/value heads when there are fewer of them than ranks; this one takes plain multi-head attention).
"""
from __future__ import annotations

import torch.nn.functional as F

from ..comm.alltoall import all_to_all
from ..tensor_parallel.operators import group_rank_and_size
from .blocks import nbytes, record


def _exchange(x, group):
    """``x`` (W, ...) → (W, ...): slice i goes to rank i; slice j of the result came from rank j (the course's
    differentiable all-to-all with one slice to each rank; its backward is the same exchange, the other way)."""
    w = x.shape[0]
    sent = nbytes(x) * (w - 1) // w
    record(sent=sent)
    out = all_to_all(x, [1] * w, [1] * w, group)
    if out.requires_grad:                         # the backward exchange sends as many bytes
        out.register_hook(lambda grad: record(sent=sent))
    return out


def sequence_to_heads(x, world_size, group):
    """(b, H, s/W, d), a part of the sequence → (b, H/W, s, d), the whole sequence for this rank's heads."""
    b, h, s_local, d = x.shape
    x = x.reshape(b, world_size, h // world_size, s_local, d).transpose(0, 1)     # slice i: rank i's heads
    x = _exchange(x, group)                                                   # slice j: rank j's positions
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // world_size, world_size * s_local, d)


def heads_to_sequence(x, world_size, group):
    """(b, H/W, s, d) → (b, H, s/W, d): the inverse of :func:`sequence_to_heads`."""
    b, h_local, s, d = x.shape
    x = x.reshape(b, h_local, world_size, s // world_size, d).permute(2, 0, 1, 3, 4)  # slice i: rank i's positions
    x = _exchange(x, group)                                                       # slice j: rank j's heads
    return x.transpose(0, 1).reshape(b, world_size * h_local, s // world_size, d)


def ulysses_attention(q, k, v, *, causal: bool = False, group=None):
    """This rank's part of full attention, by two all-to-alls (contiguous layout: rank r holds positions
    [r·s_local, (r+1)·s_local)). Shapes (batch, heads, s_local, head_dim); the world size must divide the heads."""
    rank, world_size = group_rank_and_size(group)
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k and v must have the same shape (batch, heads, s_local, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % world_size:
        raise ValueError(f"Ulysses splits the heads over the ranks: {q.shape[1]} heads do not split over "
                         f"{world_size} ranks; use a head count the world size divides, or ring attention")
    q, k, v = (sequence_to_heads(t, world_size, group) for t in (q, k, v))
    s = q.shape[2]
    record(kv_held=nbytes(k, v), scores=q.shape[0] * q.shape[1] * (s * (s + 1) // 2 if causal else s * s))
    return heads_to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=causal), world_size, group)
