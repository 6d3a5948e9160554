"""Pictures of what ranks hold: before and after a collective, and a barrier's timeline.

Each rank is a row of cells.  A cell is coloured by the rank its value came from (rank 2's colour for
``23``), so data that *moved* keeps its colour; a value no rank started with (a sum) is grey.  The
drawing functions return the figure; the tests read its texts back to check what is drawn.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

REDUCED = "#bbbbbb"


def rank_color(rank: int):
    return plt.get_cmap("tab10")(rank % 10)


def owner(value: float, before: list[list[float]]) -> int | None:
    """The rank that held ``value`` before the collective, or ``None`` for a computed value."""
    for rank, row in enumerate(before):
        if value in row:
            return rank
    return None


def _draw_rows(ax, rows, before, title):
    width = max([len(r) for r in rows if r] + [1])
    for rank, row in enumerate(rows):
        y = len(rows) - 1 - rank
        if row is None:
            ax.text(0, y + 0.5, "no result", va="center", ha="left", style="italic", color="0.4")
            continue
        for i, value in enumerate(row):
            who = owner(value, before)
            ax.add_patch(Rectangle((i, y + 0.1), 0.92, 0.8, color=REDUCED if who is None else rank_color(who),
                                   alpha=0.85))
            ax.text(i + 0.46, y + 0.5, f"{value:g}", ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.1, max(width, 2) + 0.1)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 1 - r + 0.5 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))])
    ax.set_xticks([])
    ax.set_title(title)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def draw_collective(name: str, before: list[list[float]], after: list[list[float] | None]):
    """Before/after picture of collective ``name``: one row per rank, cells coloured by origin."""
    n = len(before)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 0.45 * n + 1.0), sharey=True)
    _draw_rows(left, before, before, "before")
    _draw_rows(right, after, before, f"after {name}")
    fig.suptitle(f"{name} on {n} rank{'s' if n != 1 else ''} (grey: a sum no rank held before)", fontsize=10)
    fig.tight_layout()
    return fig


def collective_texts(fig) -> list[list[str]]:
    """The values drawn in the 'after' panel, per rank (what the tests compare with the reference)."""
    after = fig.axes[1]
    n = len(after.get_yticks())
    rows: list[list[str]] = [[] for _ in range(n)]
    for t in after.texts:
        x, y = t.get_position()
        rows[n - 1 - int(y)].append((x, t.get_text()))
    return [[s for _, s in sorted(r)] for r in rows]


def draw_barrier(times: list[tuple[float, float]]):
    """Each rank's wait in a barrier: from its arrival to the moment all ranks were released."""
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(times) + 1.0))
    for rank, (arrive, leave) in enumerate(times):
        y = len(times) - 1 - rank
        ax.barh(y, arrive, color=rank_color(rank), alpha=0.5, label="working" if rank == 0 else None)
        ax.barh(y, leave - arrive, left=arrive, color="0.8", hatch="//", label="waiting in barrier" if rank == 0 else None)
    ax.axvline(max(a for a, _ in times), color="k", lw=1, ls="--", label="last rank arrives")
    ax.set_yticks(range(len(times)), [f"rank {r}" for r in reversed(range(len(times)))])
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title("barrier: nobody leaves before the last rank arrives")
    fig.tight_layout()
    return fig
