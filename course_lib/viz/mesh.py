"""A picture of a 3-D device mesh: every rank, its coordinates, and the groups of each dimension.

:func:`draw_mesh` draws the ``pp`` pipeline stages side by side; inside a stage, a grid with one row per dp
replica and one column per tp shard. Each box is a rank, coloured as in every picture of the course
(:func:`.style.rank_color`), labelled with its number and its ``(pp, dp, tp)`` coordinates. Three kinds of lines
join the ranks of one group: tp groups (a row of a grid), dp groups (a column), pp groups (the same place in
consecutive stages). With ``gpus_per_node``, a dashed frame shows which ranks would share a node on a cluster
numbered the same way (consecutive ranks in one node).

The ranks and groups come from :mod:`course_lib.composed.mesh`, so the picture is the mesh the code builds.
Returns the figure; the tests read its texts back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

from ..composed.mesh import coords, groups
from .style import rank_color

GROUP_STYLE = {"tp": ("#d62728", "-"), "dp": ("#1f77b4", "-"), "pp": ("#2ca02c", "--")}
WHAT = {"tp": "tp group: SP all-gathers / reduce-scatters, every block",
        "dp": "dp group: FSDP2 all-gather / reduce-scatter, once a step (reshard_after_forward=False)",
        "pp": "pp group: send / recv of activations and gradients"}


def mesh_positions(pp: int, dp: int, tp: int, gap: float = 1.0) -> dict[int, tuple[float, float]]:
    """Each rank's box centre: stage ``p`` at x offset ``p·(tp + gap)``, tp along x, dp down y."""
    out = {}
    for r in range(pp * dp * tp):
        c = coords(r, pp, dp, tp)
        out[r] = (c["pp"] * (tp + gap) + c["tp"], -c["dp"])
    return out


def draw_mesh(pp: int = 2, dp: int = 2, tp: int = 2, gpus_per_node: int | None = None, title: str | None = None):
    """The ranks of a (pp, dp, tp) mesh and the lines of their groups (module docstring)."""
    pos = mesh_positions(pp, dp, tp)
    fig, ax = plt.subplots(figsize=(max(1.5 * pp * (tp + 1), 6), 1.1 * dp + 2.6))
    gs = groups(pp, dp, tp)
    for dim in ("pp", "dp", "tp"):
        color, style = GROUP_STYLE[dim]
        for g in gs[dim]:
            for a, b in zip(g, g[1:]):
                (x0, y0), (x1, y1) = pos[a], pos[b]
                xs, ys = [x0, x1], [y0, y1]
                if dim == "pp":   # an arc over (top half) or under (bottom half) the ranks between
                    c = coords(a, pp, dp, tp)
                    bend = (0.45 + 0.2 * c["tp"]) * (1 if c["dp"] < dp / 2 else -1)
                    t = [i / 20 for i in range(21)]
                    xs = [x0 + (x1 - x0) * u for u in t]
                    ys = [y0 + 4 * bend * u * (1 - u) for u in t]
                ax.plot(xs, ys, color=color, ls=style, lw=2, zorder=1,
                        label=WHAT[dim] if (g is gs[dim][0] and a == g[0]) else None)
    for r, (x, y) in pos.items():
        c = coords(r, pp, dp, tp)
        ax.add_patch(FancyBboxPatch((x - 0.3, y - 0.22), 0.6, 0.44, boxstyle="round,pad=0.02",
                                    facecolor=rank_color(r), alpha=0.85, edgecolor="#333333", zorder=2))
        ax.text(x, y + 0.06, f"rank {r}", ha="center", va="center", fontsize=8, color="white", weight="bold",
                zorder=3)
        ax.text(x, y - 0.11, f"({c['pp']}, {c['dp']}, {c['tp']})", ha="center", va="center", fontsize=7,
                color="white", zorder=3)
    for p in range(pp):
        x = p * (tp + 1) + (tp - 1) / 2
        ax.text(x, 0.5 + 0.2 * tp, f"stage {p} (pp = {p})", ha="center", fontsize=9)
    if gpus_per_node:
        for start in range(0, pp * dp * tp, gpus_per_node):
            members = [pos[r] for r in range(start, min(start + gpus_per_node, pp * dp * tp))]
            xs, ys = [m[0] for m in members], [m[1] for m in members]
            ax.add_patch(Rectangle((min(xs) - 0.42, min(ys) - 0.34), max(xs) - min(xs) + 0.84,
                                   max(ys) - min(ys) + 0.68, fill=False, ls=":", lw=1.2, edgecolor="#555555"))
            ax.text(min(xs) - 0.4, min(ys) - 0.45, f"node {start // gpus_per_node}", fontsize=7, va="top",
                    color="#555555")
    ax.set_xlim(-0.7, pp * (tp + 1) - 1.3)
    reach = 0.5 + 0.2 * tp
    ax.set_ylim(-(dp - 1) - reach - 0.25, reach + 0.35)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1, fontsize=7, frameon=False)
    ax.set_title(title or f"{pp * dp * tp} ranks as (pp, dp, tp) = ({pp}, {dp}, {tp}): rank = (pp·{dp} + dp)·{tp} + tp",
                 fontsize=9)
    fig.tight_layout()
    return fig
