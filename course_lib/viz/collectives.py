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


def _grid_axes(ax, xlim, xticks, xlabels, row_name: str, rows: int):
    """A grid's axes: columns labelled below, rows ``row_name 0`` at the top to ``rows - 1``, no frame."""
    ax.set_xlim(*xlim)
    ax.set_ylim(0, rows)
    ax.set_xticks(xticks, xlabels, fontsize=8)
    ax.set_yticks([rows - 1 - r + 0.5 for r in range(rows)], [f"{row_name} {r}" for r in range(rows)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


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
    _grid_axes(ax, (0, n), [c + 0.46 for c in range(n)], [f"chunk {c}" for c in range(n)], "rank", n)
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


def hierarchical_state(nodes: int, gpus_per_node: int, phase: int) -> list[list[dict[int, frozenset]]]:
    """What each GPU holds in the hierarchical all-reduce after ``phase`` (0 to 3) of its three phases.

    ``state[node][gpu]`` maps a chunk (0 to gpus_per_node - 1) to the set of GPUs ``(node, gpu)`` whose
    data it sums; only the chunks a GPU holds in final or useful form are listed. Phase 1 is the
    reduce-scatter inside each node (GPU k keeps its node's sum of chunk k), phase 2 the all-reduce of
    chunk k across the nodes (GPU k of every node with GPU k of the others), phase 3 the all-gather inside
    each node. Pure Python: what :func:`draw_hierarchical_all_reduce` draws.
    """
    if not 0 <= phase <= 3:
        raise ValueError(f"phase must be 0 (start) to 3, got {phase}")
    g = gpus_per_node
    everyone = frozenset((j, k) for j in range(nodes) for k in range(g))

    def node(j):
        return frozenset((j, k) for k in range(g))

    state = []
    for j in range(nodes):
        row = []
        for k in range(g):
            if phase == 0:
                row.append({c: frozenset({(j, k)}) for c in range(g)})
            elif phase == 1:
                row.append({k: node(j)})
            elif phase == 2:
                row.append({k: everyone})
            else:
                row.append({c: everyone for c in range(g)})
        state.append(row)
    return state


def draw_hierarchical_all_reduce(nodes: int = 2, gpus_per_node: int = 4):
    """The hierarchical all-reduce as a node x GPU grid, one panel per phase, arrows where data moves.

    A cell is one GPU; its text lists the chunks it holds and whose data they sum ("n0" = node 0's GPUs,
    "all" = every GPU). Phases 1 and 3 move data along a row (inside a node, the fast links); phase 2
    along a column (across nodes, the network).
    """
    titles = ["1. reduce-scatter inside each node\n(fast links)", "2. all-reduce chunk k across nodes\n(network)",
              "3. all-gather inside each node\n(fast links)"]
    g = gpus_per_node
    fig, axes = plt.subplots(1, 3, figsize=(4.0 * 3, 0.9 * nodes + 1.6))
    for phase, ax in enumerate(axes, start=1):
        state = hierarchical_state(nodes, g, phase)
        for j in range(nodes):
            y = nodes - 1 - j
            for k in range(g):
                held = state[j][k]
                whole = len(held) == g and all(len(s) == nodes * g for s in held.values())
                sums = {("all" if len(s) == nodes * g else f"n{j}") for s in held.values()}
                label = "all chunks\nall" if whole else "\n".join(f"c{c}: {next(iter(sums))}" for c in held)
                color = "#5cb85c" if whole else (rank_color(k) if phase == 2 else REDUCED)
                ax.add_patch(Rectangle((k, y + 0.08), 0.9, 0.84, color=color, alpha=0.75))
                ax.text(k + 0.45, y + 0.5, label, ha="center", va="center", fontsize=7)
        if phase in (1, 3):
            for j in range(nodes):
                y = nodes - 1 - j + 0.2
                ax.annotate("", xy=(g - 0.1, y), xytext=(0, y),
                            arrowprops=dict(arrowstyle="<->", color="0.3", lw=1, alpha=0.6))
        else:
            for k in range(g):
                ax.annotate("", xy=(k + 0.12, nodes - 0.05), xytext=(k + 0.12, 0.05),
                            arrowprops=dict(arrowstyle="<->", color=rank_color(k), lw=1.5))
        _grid_axes(ax, (-0.1, g + 0.1), [k + 0.45 for k in range(g)], [f"GPU {k}" for k in range(g)], "node", nodes)
        ax.set_title(titles[phase - 1], fontsize=9)
    fig.suptitle(f"hierarchical all-reduce on {nodes} nodes x {g} GPUs. c2: chunk 2; n0: summed over node 0's GPUs; "
                 "all: summed over every GPU", fontsize=10)
    fig.tight_layout()
    return fig


def plot_flat_vs_two_level(gpu_counts, flat: dict, two_level,
                           two_level_label: str = "two levels: fast links inside, network between"):
    """Predicted seconds per all-reduce as grouped bars: one group per GPU count, one bar per network.

    ``flat[label]`` and ``two_level`` are lists of seconds, one per entry of ``gpu_counts``. A log scale,
    with each bar's value written on it, so that milliseconds and seconds read side by side.
    """
    series = list(flat.items()) + [(two_level_label, list(two_level))]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(series)
    for i, (label, seconds) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(gpu_counts))]
        bars = ax.bar(xs, seconds, width, label=label, color=f"C{i}")
        for bar, s in zip(bars, seconds):
            ax.text(bar.get_x() + bar.get_width() / 2, s * 1.1, f"{s:.2g}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(gpu_counts)), [f"{n} GPUs" for n in gpu_counts])
    ax.set_ylabel("seconds per all-reduce (predicted)")
    ax.set_title("one all-reduce, predicted: a flat ring over one kind of link, or two levels", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def draw_rendezvous(world_size: int = 3):
    """The rendezvous in two panels: every rank talks to one store; then the ranks talk to each other.

    Left: each rank writes its own address into the ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` and reads
    the others'. Right: the backend has opened direct connections, one per pair of ranks; the store is no
    longer on the data's path.
    """
    import math

    n = world_size
    angles = [math.pi / 2 + 2 * math.pi * r / n for r in range(n)]
    where = [(math.cos(a), math.sin(a)) for a in angles]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    titles = ["1. every rank writes its address to the store\nand reads the others'",
              "2. the backend connects the ranks directly\n(the data never passes through the store)"]
    for panel, ax in enumerate(axes):
        faded = panel == 1
        ax.add_patch(Rectangle((-0.42, -0.2), 0.84, 0.4, color="0.85" if faded else "#f0ad4e", alpha=0.9))
        ax.text(0, 0, "TCPStore\nMASTER_ADDR:PORT", ha="center", va="center", fontsize=8,
                color="0.6" if faded else "k")
        for r, (x, y) in enumerate(where):
            if panel == 0:
                ax.annotate("", xy=(0.45 * x, 0.45 * y), xytext=(0.82 * x, 0.82 * y),
                            arrowprops=dict(arrowstyle="<->", color=rank_color(r), lw=1.5))
                ax.text(0.63 * x + (0.06 if x >= 0 else -0.06), 0.63 * y, f"set hello/{r}", fontsize=7,
                        color=rank_color(r), ha="left" if x >= 0 else "right", va="center")
            else:
                for s in range(r + 1, n):
                    xs, ys = where[s]
                    ax.plot([x, xs], [y, ys], color="0.3", lw=1.5)
            ax.add_patch(plt.Circle((x, y), 0.17, color=rank_color(r)))
            ax.text(x, y, f"rank {r}", ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(-1.35, 1.35)
        ax.set_ylim(-1.35, 1.35)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(titles[panel], fontsize=9)
    fig.tight_layout()
    return fig
