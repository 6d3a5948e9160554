"""The pieces every context-parallel attention is built from: one block of attention with its log-sum-exp, the
merge of two partial results, and which chunks of the sequence each rank holds.

**Attention over a block of keys.** For queries ``q`` and one block of keys and values, :func:`block_attention`
returns the usual output *and* the log-sum-exp of each query's scores, ``lse = log Σ_j exp(s_j)``. The output of
attention over *all* keys is a weighted mean of the outputs over each block, the weights ``exp(lse_block − lse)``:

    lse = logaddexp(lse_a, lse_b),    out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)

That is :func:`merge` (the *online softmax* of flash attention, one block at a time). So a rank can see the keys
one block after another, in any order, and still end with exactly the softmax over all of them.

**Chunks.** A sequence of length s split over W ranks is cut into equal chunks, numbered along the sequence.
With the *contiguous* layout rank r holds chunk r of W. With the *zig-zag* layout it holds chunks r and 2W−1−r of
2W, concatenated in that order (:func:`zigzag_shard`). Under a causal mask a query of chunk a sees all of the
keys of chunks b < a, the lower triangle of chunk a itself, and nothing of chunks b > a (:func:`pairs`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

LAYOUTS = ("contiguous", "zigzag")


def block_attention(q, k, v, diagonal: bool = False):
    """Softmax attention of ``q`` over one block of keys ``k`` and values ``v``: ``(out, lse)``.

    Shapes (batch, heads, queries, head_dim) and (batch, heads, keys, head_dim); ``lse`` is (batch, heads, queries).
    ``diagonal``: the block is the queries' own chunk under a causal mask (query i sees keys 0..i).

    Computed in float32 at least (``out`` and ``lse`` come back in it): in bf16, a running merge would round at
    every block, as flash attention's and PyTorch's ring attention do not.
    """
    q, k, v = (t.to(accumulation_dtype(t)) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if diagonal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; anything narrower is computed and accumulated in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two blocks of keys, from the attention over each: ``(out, lse)``."""
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)     # a row with no key in either block stays empty, not NaN
    return out_a * torch.exp(lse_a - lse_safe).unsqueeze(-1) + out_b * torch.exp(lse_b - lse_safe).unsqueeze(-1), lse


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_ids(layout: str, rank: int, world_size: int) -> list[int]:
    """The chunks of the sequence that ``rank`` holds, in the order it holds them."""
    check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def pairs(layout: str, rank: int, source: int, world_size: int, causal: bool):
    """Which (query chunk, key chunk) products ``rank`` computes with the keys that ``source`` holds.

    Yields ``(i, j, diagonal)``: the i-th of this rank's chunks of queries against the j-th of ``source``'s chunks
    of keys; ``diagonal`` when it is the same chunk of the sequence (the causal mask's triangle). Pairs whose keys
    all lie in the queries' future are left out: they would contribute nothing.
    """
    for i, a in enumerate(chunk_ids(layout, rank, world_size)):
        for j, b in enumerate(chunk_ids(layout, source, world_size)):
            if not causal or b < a:
                yield i, j, False
            elif b == a:
                yield i, j, True


def _split(length: int, dim_name: str, parts: int, what: str) -> int:
    if length % parts:
        raise ValueError(f"{what}: {dim_name} {length} does not split into {parts} equal chunks; pad or cut the "
                         f"sequence to a multiple of {parts}")
    return length // parts


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of the whole sequence ``x`` (sequence along ``dim``) under ``layout``."""
    chunks = 2 * world_size if layout == "zigzag" else world_size
    size = _split(x.shape[dim], "a sequence of length", chunks, f"{layout} layout on {world_size} ranks")
    return torch.cat([x.narrow(dim, c * size, size) for c in chunk_ids(layout, rank, world_size)], dim=dim)


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Chunks ``rank`` and ``2·world_size − 1 − rank`` of ``2·world_size`` equal chunks of ``x`` along ``dim``."""
    return shard(x, dim, rank, world_size, "zigzag")


def unshard(parts: list[torch.Tensor], dim: int, layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence from every rank's part (``parts`` listed by rank)."""
    world_size = len(parts)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    check_layout(layout)
    halves = [_split(p.shape[dim], "a part of length", 2, "zig-zag parts hold two chunks") for p in parts]
    chunks = [None] * (2 * world_size)
    for r, (p, half) in enumerate(zip(parts, halves)):
        first, second = chunk_ids(layout, r, world_size)
        chunks[first], chunks[second] = p.narrow(dim, 0, half), p.narrow(dim, half, half)
    return torch.cat(chunks, dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of :func:`zigzag_shard`: the whole sequence from the parts of ranks 0, 1, ..."""
    return unshard(parts, dim, "zigzag")


# What the context-parallel functions did, counted while a ``count()`` is active (the notebook compares these
# counts with the formulas of :mod:`.traffic`).
_counters: list[dict] = []


@contextmanager
def count():
    """``with count() as c: ...``: ``c["scores"]`` the (query, key) scores computed in the forward passes of
    this process, without the masked ones; ``c["sent"]`` the bytes it sent; ``c["kv_held"]`` the most bytes of
    keys and values it held at once."""
    counter = {"scores": 0, "sent": 0, "kv_held": 0}
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def record(scores: int = 0, sent: int = 0, kv_held: int = 0) -> None:
    for c in _counters:
        c["scores"] += scores
        c["sent"] += sent
        c["kv_held"] = max(c["kv_held"], kv_held)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
