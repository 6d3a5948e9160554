"""Pictures of a mixture of experts and of expert parallelism.

* :func:`draw_moe_layer`: the layer as a block diagram, router → top-k → dispatch → experts → combine, with the
  all-to-alls marked where the experts live on other ranks.
* :func:`draw_all_to_all`: who sends how many token-slots to whom (a matrix: row = sender, column = receiver).
* :func:`draw_expert_load`: token-slots per expert against the capacity, for one or more routings side by side.

Each function returns the figure; the tests read its texts back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .style import rank_color


def _box(ax, x, y, w, h, text, color="#eeeeee"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="#555555"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)


def _arrow(ax, a, b, label="", color="#333333"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=color, lw=1.2))
    if label:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12, label, ha="center", va="bottom", fontsize=7,
                color=color)


def draw_moe_layer(num_experts: int = 4, world_size: int = 2, top_k: int = 2):
    """Router → top-k → dispatch (all-to-all) → experts, coloured by the rank that holds them → combine."""
    per_rank = num_experts // world_size
    fig, ax = plt.subplots(figsize=(9, 3.2))
    _box(ax, 0.0, 1.3, 0.9, 0.6, "tokens\n(this rank)")
    _box(ax, 1.3, 1.3, 1.1, 0.6, f"router\nsoftmax, top-{top_k}")
    _arrow(ax, (0.9, 1.6), (1.3, 1.6))
    _box(ax, 2.8, 1.3, 1.0, 0.6, "capacity:\ndrop extras")
    _arrow(ax, (2.4, 1.6), (2.8, 1.6))
    height = 2.8 / num_experts
    for e in range(num_experts):
        y = 0.1 + (num_experts - 1 - e) * height
        _box(ax, 4.6, y, 1.8, height * 0.8, f"expert {e} (rank {e // per_rank})", rank_color(e // per_rank))
        _arrow(ax, (3.8, 1.6), (4.6, y + height * 0.4), color="#aa3333")
        _arrow(ax, (6.4, y + height * 0.4), (7.3, 1.6), color="#aa3333")
    ax.text(4.2, 3.05, "dispatch:\nall-to-all", ha="center", fontsize=8, color="#aa3333")
    ax.text(6.85, 3.05, "combine:\nall-to-all", ha="center", fontsize=8, color="#aa3333")
    _box(ax, 7.3, 1.3, 1.5, 0.6, "Σ gate · expert(x)\n(this rank's tokens)")
    ax.set_xlim(-0.1, 8.9)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    ax.set_title(f"a mixture-of-experts layer: {num_experts} experts on {world_size} ranks, each token to its "
                 f"top {top_k}", fontsize=9)
    return fig


def draw_all_to_all(sent, title: str = "token-slots sent in the dispatch"):
    """``sent[s][d]``: slots rank ``s`` sends to rank ``d``. The diagonal stays on its rank and crosses no link."""
    m = np.asarray(sent)
    n = len(m)
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * n, 0.8 + 0.7 * n))
    ax.imshow(m, cmap="Blues", vmin=0, vmax=max(1, m.max()))
    for s in range(n):
        for d in range(n):
            ax.text(d, s, str(int(m[s, d])), ha="center", va="center", fontsize=9,
                    color="white" if m[s, d] > 0.6 * m.max() else "black", fontweight="bold" if s == d else None)
    ax.set_xticks(range(n), [f"to {d}" for d in range(n)])
    ax.set_yticks(range(n), [f"rank {s}" for s in range(n)])
    ax.set_title(f"{title}\n(row: sender, column: receiver; bold: kept on its own rank)", fontsize=9)
    return fig


def draw_expert_load(loads: dict, cap: int | None = None):
    """Bars of slots per expert for each labelled routing (``{label: loads}``), with the capacity as a line."""
    fig, axes = plt.subplots(1, len(loads), figsize=(3.6 * len(loads), 2.6), sharey=True, squeeze=False)
    for ax, (label, load) in zip(axes[0], loads.items()):
        ax.bar(range(len(load)), load, color="#4c72b0")
        if cap is not None:
            ax.axhline(cap, color="#aa3333", lw=1.2, ls="--")
            ax.text(len(load) - 0.5, cap, f"capacity {cap}", ha="right", va="bottom", fontsize=8, color="#aa3333")
        ax.set_xticks(range(len(load)))
        ax.set_xlabel("expert")
        ax.set_title(label, fontsize=9)
    axes[0][0].set_ylabel("token-slots routed")
    fig.tight_layout()
    return fig
