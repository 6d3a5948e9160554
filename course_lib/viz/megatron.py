"""Notebook 11's pictures: the Megatron block with ``f`` and ``g`` marked, and TP efficiency against the degree.

* :func:`draw_megatron_block`: one transformer layer split over the ranks: what is whole on every rank (grey),
  what is split (rank colours), and the four places ``f`` and ``g`` sit, with what each sends forward and
  backward.
* :func:`draw_tp_efficiency`: the efficiency compute / (compute + communication) of one layer against the TP
  degree, one line per compute rate, with the node boundary where the all-reduces leave NVLink.

Each function returns the figure; the tests read its texts back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

from .style import rank_color

WHOLE = "#dddddd"
OPERATOR = "#fde68a"


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="#555555",
                                lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def draw_megatron_block(world_size: int = 2):
    """One layer, left to right: LayerNorm, f, attention by heads, g, residual; LayerNorm, f, MLP, g, residual."""
    n = world_size
    fig, ax = plt.subplots(figsize=(11, 2.9))
    x = 0.0
    lane = 0.9 / n
    for split_name, inner in (("attention", ("q, k, v\ncolumn", "heads", "out\nrow")),
                              ("MLP", ("up\ncolumn", "GELU", "down\nrow"))):
        _box(ax, x, 0.3, 0.55, 0.5, "LayerNorm\n(whole)", WHOLE)
        x += 0.7
        _box(ax, x, 0.15, 0.35, 0.8, "f", OPERATOR, 12)
        ax.text(x + 0.175, -0.2, "fwd: identity\nbwd: all-reduce", ha="center", va="center", fontsize=7)
        x += 0.5
        for r in range(n):
            y = 0.1 + (n - 1 - r) * lane
            for j, label in enumerate(inner):
                _box(ax, x + j * 0.75, y, 0.65, lane * 0.85, f"{label} r{r}" if j != 1 else f"{label} of r{r}",
                     rank_color(r), 7)
        ax.text(x + 1.1, 1.12, f"{split_name}: split over {n} ranks, no communication inside", ha="center",
                fontsize=8)
        x += 2.3
        _box(ax, x, 0.15, 0.35, 0.8, "g", OPERATOR, 12)
        ax.text(x + 0.175, -0.2, "fwd: all-reduce\nbwd: identity", ha="center", va="center", fontsize=7)
        x += 0.5
        _box(ax, x, 0.3, 0.45, 0.5, "+ x\n(whole)", WHOLE)
        x += 0.65
    ax.annotate("", xy=(x, 0.55), xytext=(-0.15, 0.55), arrowprops=dict(arrowstyle="->", color="#999999", lw=0.6),
                zorder=0)
    ax.set_xlim(-0.2, x + 0.1)
    ax.set_ylim(-0.45, 1.3)
    ax.axis("off")
    ax.set_title("One transformer layer under tensor parallelism: 2 all-reduces forward (g), 2 backward (f)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def draw_tp_efficiency(efficiency: dict[str, dict[int, float]], gpus_per_node: int):
    """``efficiency[label][t]``: one line per label against the TP degree t (log scale), the node boundary drawn."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for i, (label, points) in enumerate(efficiency.items()):
        ts = sorted(points)
        ax.plot(ts, [points[t] for t in ts], marker="o", label=label)
        for t in ts:
            top = points[t] >= max(p.get(t, 0.0) for p in efficiency.values())   # the upper line's label above,
            if any(f"{p.get(t, -1):.0%}" == f"{points[t]:.0%}" for p in list(efficiency.values())[:i]):
                continue                                                       # a label equal to one shown: once
            ax.annotate(f"{points[t]:.0%}", (t, points[t]), textcoords="offset points",   # the others' below
                        xytext=(4, 4) if top else (4, -11), fontsize=7)
    ax.axvline(gpus_per_node * 1.4, color="#888888", ls="--", lw=1)
    ax.text(gpus_per_node * 1.45, 0.05, f"past {gpus_per_node} GPUs:\nacross nodes", fontsize=8, color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({t for p in efficiency.values() for t in p}))
    ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("tensor-parallel degree t (GPUs)")
    ax.set_ylabel("compute / (compute + comm)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig
