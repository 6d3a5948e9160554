"""Pictures of what ranks hold: before and after a collective, a barrier's timeline, the ring's steps.

Each rank is a row of cells.  A cell is coloured by the rank its value came from (rank 2's colour for
``23``), so data that *moved* keeps its colour; a value no rank started with (a sum) is grey.  The
drawing functions return the figure; the tests read its texts back to check what is drawn.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import REDUCED, rank_color


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
        ax.barh(y, leave - arrive, left=arrive, color="0.8", hatch="//",
                label="waiting in barrier" if rank == 0 else None)
    ax.axvline(max(a for a, _ in times), color="k", lw=1, ls="--", label="last rank arrives")
    ax.set_yticks(range(len(times)), [f"rank {r}" for r in reversed(range(len(times)))])
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title("barrier: nobody leaves before the last rank arrives")
    fig.tight_layout()
    return fig


def draw_ring_state(world_size: int, step: int):
    """The ring all-reduce after ``step`` steps: what each rank's chunks contain, and what moves next.

    A cell lists the ranks whose data a chunk holds (green when it holds all of them); a red frame marks
    the chunk each rank sends to its right-hand neighbour in the next step.
    """
    from ..comm.allreduce import ring_sends, ring_state  # local import: pictures load without torch.distributed

    n = world_size
    state = ring_state(n, step)
    sends = ring_sends(n, step) if step < 2 * (n - 1) else [None] * n
    fig, ax = plt.subplots(figsize=(1.1 * n + 2.2, 0.5 * n + 1.2))
    cmap = plt.get_cmap("Blues")
    for rank in range(n):
        y = n - 1 - rank
        for chunk in range(n):
            who = state[rank][chunk]
            full = len(who) == n
            color = "#5cb85c" if full else cmap(0.15 + 0.6 * len(who) / n)
            ax.add_patch(Rectangle((chunk, y + 0.08), 0.92, 0.84, color=color))
            label = "Σ all" if full and n > 3 else "+".join(map(str, sorted(who)))
            ax.text(chunk + 0.46, y + 0.5, label, ha="center", va="center", fontsize=8)
            if sends[rank] == chunk:
                ax.add_patch(Rectangle((chunk + 0.02, y + 0.1), 0.88, 0.8, fill=False, ec="red", lw=2.5))
    phase = ("start" if step == 0 else "reduce-scatter" if step <= n - 1 else "all-gather")
    ax.set_title(f"ring all-reduce, {n} ranks: after step {step} of {2 * (n - 1)} ({phase}); "
                 "red: sent to the right next", fontsize=9)
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([c + 0.46 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=8)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


def plot_all_reduce_sweep(sizes, results: dict, world_sizes: list[int]):
    """Time and bus bandwidth against message size, one line per implementation and world size.

    ``results[world_size][implementation]`` is a list of seconds, one per entry of ``sizes`` (bytes).
    """
    from ..comm.costmodel import busbw

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = ["-", "--", ":", "-."]
    for wi, n in enumerate(world_sizes):
        for ii, (name, times) in enumerate(results[n].items()):
            kw = dict(color=rank_color(ii), ls=styles[wi % len(styles)], marker="o", ms=3,
                      label=f"{name}, {n} ranks")
            ax_t.loglog(sizes, times, **kw)
            ax_b.semilogx(sizes, [busbw(s, t, n) / 1e9 for s, t in zip(sizes, times)], **kw)
    ax_t.set(xlabel="message size (bytes)", ylabel="time per all-reduce (s)", title="time")
    ax_b.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth = algbw·2(N−1)/N")
    ax_b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
