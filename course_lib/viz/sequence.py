"""Pictures for notebook 12: the sequence-parallel transitions, and which dropout masks agree across ranks."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from .style import rank_color

__all__ = ["draw_sp_transitions", "draw_mask_agreement"]


def _column(ax, x, n, sliced, label, partial=False):
    """An activation (seq positions top to bottom) on each of ``n`` ranks: a slice each, or all of it."""
    for r in range(n):
        y0 = r * 1.3
        ax.add_patch(Rectangle((x, y0), 0.5, 1.0, fill=False, ec="0.6", lw=0.8))
        if sliced:
            ax.add_patch(Rectangle((x, y0 + (n - 1 - r) / n), 0.5, 1 / n, color=rank_color(r)))
        else:
            ax.add_patch(Rectangle((x, y0), 0.5, 1.0, color=rank_color(r) if partial else "0.55",
                                   alpha=0.5 if partial else 0.8, hatch="//" if partial else None))
        ax.text(x - 0.08, y0 + 0.5, f"rank {r}", ha="right", va="center", fontsize=7) if x < 0.5 else None
    ax.text(x + 0.25, n * 1.3 + 0.05, label, ha="center", va="bottom", fontsize=8)


def draw_sp_transitions(world_size: int = 2):
    """One half of a block under sequence parallelism: a sequence slice on each rank, all-gathered along the
    sequence into the column-parallel layer, the row-parallel layer's partial sums reduce-scattered back to slices.
    Backward runs the same transitions the other way: reduce-scatter where forward gathered, all-gather where it
    reduce-scattered."""
    n = world_size
    fig, ax = plt.subplots(figsize=(11, 1.0 + 1.1 * n))
    stages = [(0.0, True, "LayerNorm, dropout\n(a slice: seq/N)", False),
              (2.6, False, "whole sequence\n(column-parallel in)", False),
              (5.2, False, "partial sums\n(row-parallel out)", True),
              (7.8, True, "a slice again\n(residual, next LayerNorm)", False)]
    for x, sliced, label, partial in stages:
        _column(ax, x, n, sliced, label, partial)
    arrows = [(0.55, 2.55, "all-gather\n(backward: reduce-scatter)"),
              (3.15, 5.15, "attention or MLP\n(split by heads / columns)"),
              (5.75, 7.75, "reduce-scatter\n(backward: all-gather)")]
    for x0, x1, text in arrows:
        for r in range(n):
            ax.add_patch(FancyArrowPatch((x0, r * 1.3 + 0.5), (x1, r * 1.3 + 0.5), arrowstyle="-|>",
                                         mutation_scale=10, color="0.3"))
        ax.text((x0 + x1) / 2, -0.35, text, ha="center", va="top", fontsize=8)
    ax.set(xlim=(-1.0, 8.8), ylim=(-1.2, n * 1.3 + 0.6))
    ax.axis("off")
    ax.set_title("sequence parallelism: f's and g's all-reduces become their two halves, along the sequence",
                 fontsize=9)
    return fig


def draw_mask_agreement(masks: dict, title: str = ""):
    """A matrix of which dropout masks are equal: ``masks`` maps a label to a mask; cell (i, j) is dark where
    mask i equals mask j, light where they differ."""
    labels = list(masks)
    same = torch.tensor([[float(torch.equal(masks[a], masks[b])) for b in labels] for a in labels])
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * len(labels), 1.0 + 0.45 * len(labels)))
    ax.imshow(same, cmap="Greys", vmin=0, vmax=1.4)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    for i in range(len(labels)):
        for j in range(len(labels)):
            ax.text(j, i, "=" if same[i, j] else "≠", ha="center", va="center", fontsize=8,
                    color="white" if same[i, j] else "0.3")
    ax.set_title(title or "equal (=) or different (≠) dropout masks", fontsize=9)
    return fig
