"""What each way of splitting attention over the sequence sends and holds, per rank, in one forward pass.

For a batch b, H heads of dimension d (H_kv of them for keys and values), a sequence of s tokens on W ranks (s/W
each), and e bytes an element, one rank's keys and values are ``kv = 2·b·H_kv·(s/W)·d·e`` bytes:

==============  ============================  =============================  =================================
variant         sends (forward)               holds of K and V at once       limit
==============  ============================  =============================  =================================
ring            (W−1)·kv, overlapped           2·kv (the block, the next)     compute must hide each transfer
all-gather K/V  (W−1)·kv, before attention     W·kv (the whole sequence)      memory: all of K and V a rank
Ulysses         (W−1)/W of q, k, v and out     kv (all positions, H/W heads)  W divides the query heads
==============  ============================  =============================  =================================

"Holds" counts the buffers each variant allocates; the rank's own K and V come on top in every variant. The ring
hides a transfer only while a block's product (∝ (s/W)²) takes longer than its transfer (∝ s/W): s/W must stay
large enough for the links. Under grouped-query attention, when W exceeds the key/value heads, implementations
repeat those heads before the all-to-all (not modelled here).

The backward pass: the ring sends its (W−1) blocks of K and V again plus W blocks of their gradients (in float32),
(2W−1)/(W−1) times the forward's blocks; the all-gather's backward is a reduce-scatter, as many bytes as its
forward; Ulysses' four all-to-alls run in reverse, as many bytes as its forward.
"""
from __future__ import annotations

VARIANTS = ("ring", "all-gather", "ulysses")


def forward_bytes(variant: str, batch: int, heads: int, seq: int, head_dim: int, world_size: int,
                  element_bytes: int = 4, kv_heads: int | None = None) -> dict:
    """``{"sent": bytes a rank sends, "kv_held": bytes of keys and values it holds at once}`` in the forward.

    ``kv_heads``: the key/value heads under grouped-query attention (default: ``heads``, plain multi-head)."""
    if seq % world_size:
        raise ValueError(f"a sequence of {seq} does not split over {world_size} ranks")
    kv_heads = heads if kv_heads is None else kv_heads
    one = batch * (seq // world_size) * head_dim * element_bytes     # one head of this rank's part
    q, kv, w = heads * one, 2 * kv_heads * one, world_size            # queries (and the output); keys + values
    if variant == "ring":
        return {"sent": (w - 1) * kv, "kv_held": 2 * kv if w > 1 else kv}
    if variant == "all-gather":
        return {"sent": (w - 1) * kv, "kv_held": w * kv}
    if variant == "ulysses":
        if heads % w or kv_heads % w:
            raise ValueError(f"Ulysses needs the world size to divide the heads: {heads} query heads and {kv_heads} "
                             f"key/value heads on {w} ranks (repeating the key/value heads is not modelled here)")
        return {"sent": (2 * q + kv) * (w - 1) // w, "kv_held": kv}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def causal_scores(layout: str, seq: int, world_size: int) -> list[int]:
    """The unmasked (query, key) scores each rank computes under a causal mask, for one head and sequence."""
    from .blocks import chunk_ids
    n_chunks = world_size * (2 if layout == "zigzag" else 1)
    c = seq // n_chunks
    return [sum(a * c * c + c * (c + 1) // 2 for a in chunk_ids(layout, r, world_size)) for r in range(world_size)]
