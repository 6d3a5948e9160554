"""Pictures of context parallelism: who holds which part of the sequence, and which scores each rank computes.

* :func:`draw_ring_steps`: at each step of the ring, whose keys and values each rank holds (coloured by their
  owner); under a causal mask the blocks a rank skips are hatched.
* :func:`draw_causal_work`: the causal score matrix (queries down, keys across), each row of chunks coloured by the
  rank that holds those queries, for the contiguous and the zig-zag layout, with each rank's share of the work.
* :func:`draw_ulysses`: the sequence split (every head, a part of the positions) and, after the all-to-all, the
  head split (every position, a part of the heads).

Each function returns the figure; the tests read its patches back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..context_parallel.blocks import chunk_ids
from ..context_parallel.traffic import causal_scores
from .style import rank_color


def draw_ring_steps(world_size: int = 4, causal: bool = True):
    """Rows: the steps of the ring; columns: the ranks; a cell: the owner of the keys and values it holds."""
    fig, ax = plt.subplots(figsize=(1.2 * world_size + 1.5, 0.7 * world_size + 1))
    for step in range(world_size):
        for rank in range(world_size):
            source = (rank - step) % world_size
            skipped = causal and source > rank
            ax.add_patch(Rectangle((rank, world_size - 1 - step), 1, 1, facecolor=rank_color(source),
                                   alpha=0.25 if skipped else 0.85, hatch="//" if skipped else None,
                                   edgecolor="white", lw=2))
            ax.text(rank + 0.5, world_size - 0.5 - step, f"K,V{source}" + (" skip" if skipped else ""),
                    ha="center", va="center", fontsize=8)
    ax.set_xlim(0, world_size), ax.set_ylim(0, world_size)
    ax.set_xticks([r + 0.5 for r in range(world_size)], [f"rank {r}" for r in range(world_size)])
    ax.set_yticks([world_size - 0.5 - s for s in range(world_size)], [f"step {s}" for s in range(world_size)])
    ax.tick_params(length=0)
    ax.set_title("each step, every rank passes its K,V block to rank + 1"
                 + ("\n(hatched: keys in the queries' future, skipped)" if causal else ""), fontsize=9)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


def draw_causal_work(world_size: int = 4, seq: int = 4096):
    """The causal mask, rows coloured by the rank holding those queries: contiguous, zig-zag, and the work."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        n = world_size * (2 if layout == "zigzag" else 1)
        owner = {c: r for r in range(world_size) for c in chunk_ids(layout, r, world_size)}
        for a in range(n):               # query chunk a (row), key chunk b (column)
            for b in range(a + 1):
                if b < a:
                    ax.add_patch(Rectangle((b, n - 1 - a), 1, 1, facecolor=rank_color(owner[a]), alpha=0.8,
                                           edgecolor="white"))
                else:
                    ax.add_patch(plt.Polygon([(b, n - 1 - a), (b, n - a), (b + 1, n - 1 - a)],
                                             facecolor=rank_color(owner[a]), alpha=0.8, edgecolor="white"))
            ax.text(-0.15, n - 0.5 - a, f"r{owner[a]}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-0.8, n), ax.set_ylim(0, n), ax.set_aspect("equal"), ax.axis("off")
        ax.set_title(f"{layout}: {n} chunks, queries ↓ keys →", fontsize=9)
    ax = axes[2]
    width = 0.38
    for i, layout in enumerate(("contiguous", "zigzag")):
        work = causal_scores(layout, seq, world_size)
        ax.bar([r + (i - 0.5) * width for r in range(world_size)], [w * world_size / sum(work) for w in work], width,
               color=[rank_color(r) for r in range(world_size)], alpha=0.9 if i else 0.45,
               hatch=None if i else "..", edgecolor="black", lw=0.5, label=layout)
    ax.set_xticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("scores computed (÷ an even share)")
    ax.set_title("each rank's causal work (dotted: contiguous)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_ulysses(world_size: int = 2, heads: int = 4, positions: int = 8):
    """Before: rank r holds positions r·s/W.. of every head. After the all-to-all: all positions of heads r·H/W.."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.6))
    for ax, split in zip(axes, ("sequence", "heads")):
        for h in range(heads):
            for p in range(positions):
                owner = p * world_size // positions if split == "sequence" else h * world_size // heads
                ax.add_patch(Rectangle((p, heads - 1 - h), 1, 1, facecolor=rank_color(owner), alpha=0.8,
                                       edgecolor="white"))
        ax.set_xlim(0, positions), ax.set_ylim(0, heads), ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([h + 0.5 for h in range(heads)], [f"head {h}" for h in reversed(range(heads))])
        ax.set_xlabel("positions of the sequence →", fontsize=8)
        ax.set_title("before: split by sequence (ring's layout)" if split == "sequence"
                     else "after one all-to-all: split by heads", fontsize=9)
    fig.tight_layout()
    return fig
