"""What each way of splitting attention over the sequence sends and holds, per rank, in one forward pass.

For a batch b, H heads of dimension d, a sequence of s tokens on W ranks (s/W each), and e bytes an element, one
rank's keys and values are ``kv = 2·b·H·(s/W)·d·e`` bytes:

==============  ============================  =============================  =================================
variant         sends (forward)               holds of K and V at once       limit
==============  ============================  =============================  =================================
ring            (W−1)·kv, overlapped           2·kv (the block, the next)     none on W
all-gather K/V  (W−1)·kv, before attention     W·kv (the whole sequence)      memory: all of K and V a rank
Ulysses         2·(W−1)/W·kv (q, k, v, out)    kv (all positions, H/W heads)  W divides the (key/value) heads
==============  ============================  =============================  =================================

The backward pass sends about twice the forward's (the ring passes the keys and values again, with their
gradients; the all-gather's backward is a reduce-scatter of the same size; Ulysses' all-to-alls run in reverse).
"""
from __future__ import annotations

VARIANTS = ("ring", "all-gather", "ulysses")


def forward_bytes(variant: str, batch: int, heads: int, seq: int, head_dim: int, world_size: int,
                  element_bytes: int = 4) -> dict:
    """``{"sent": bytes a rank sends, "kv_held": bytes of keys and values it holds at once}`` in the forward."""
    if seq % world_size:
        raise ValueError(f"a sequence of {seq} does not split over {world_size} ranks")
    one = batch * heads * (seq // world_size) * head_dim * element_bytes     # one tensor, this rank's part
    w = world_size
    if variant == "ring":
        return {"sent": (w - 1) * 2 * one, "kv_held": 2 * 2 * one if w > 1 else 2 * one}
    if variant == "all-gather":
        return {"sent": (w - 1) * 2 * one, "kv_held": w * 2 * one}
    if variant == "ulysses":
        if heads % w:
            raise ValueError(f"Ulysses needs the world size to divide the heads: {heads} heads, {w} ranks")
        return {"sent": 4 * one * (w - 1) // w, "kv_held": 2 * one}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def causal_scores(layout: str, seq: int, world_size: int) -> list[int]:
    """The unmasked (query, key) scores each rank computes under a causal mask, for one head and sequence."""
    from .blocks import chunk_ids
    n_chunks = world_size * (2 if layout == "zigzag" else 1)
    c = seq // n_chunks
    return [sum(a * c * c + c * (c + 1) // 2 for a in chunk_ids(layout, r, world_size)) for r in range(world_size)]
