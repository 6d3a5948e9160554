"""Pictures of ZeRO: which rank holds which shard of the weights, gradients and optimizer states, before and
after each collective of a training step.

Each of the three things training holds is cut into N shards (columns); each rank is a row. A cell
is filled where the rank holds that shard, in the colour of the rank that owns (updates) it:

* ``w`` a weight shard, ``w'`` one the optimizer has just updated;
* ``g`` a gradient as this rank computed it (pale), ``ḡ`` one averaged over the ranks;
* ``s`` optimizer state (Adam's two moments).

:func:`zero_step_states` is the picture as data (tested); :func:`draw_zero_step` draws it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import rank_color

KINDS = ("weights", "gradients", "optimizer states")
STAGE_NAMES = {0: "DDP (no sharding)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def zero_step_states(stage: int, world_size: int) -> list[tuple[str, list[dict[str, list[str]]]]]:
    """The phases of one step of ``stage`` (0 = DDP) on ``world_size`` ranks: ``[(what just happened,
    [rank 0's {kind: N labels}, rank 1's, ...]), ...]``; an empty label means "not held"."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size must be between 1 and 16, got {world_size}")
    n = world_size

    def every(label):
        return lambda r: [label] * n

    def own(label, others=""):
        return lambda r: [label if i == r else others for i in range(n)]

    def nothing(r):
        return [""] * n

    def rows(w, g, s):
        return [{"weights": w(r), "gradients": g(r), "optimizer states": s(r)} for r in range(n)]

    states = every("s") if stage == 0 else own("s")
    if stage == 0:
        return [("start of the step", rows(every("w"), nothing, states)),
                ("after backward", rows(every("w"), every("g"), states)),
                ("after all-reduce", rows(every("w"), every("ḡ"), states)),
                ("after the optimizer step", rows(every("w'"), every("ḡ"), states))]
    if stage == 1:
        return [("start of the step", rows(every("w"), nothing, states)),
                ("after backward", rows(every("w"), every("g"), states)),
                ("after reduce-scatter", rows(every("w"), own("ḡ", "g"), states)),
                ("after the step of each rank's shard", rows(own("w'", "w"), own("ḡ", "g"), states)),
                ("after all-gather", rows(every("w'"), own("ḡ", "g"), states))]
    if stage == 2:
        return [("start of the step", rows(every("w"), nothing, states)),
                ("backward, layer by layer: reduce-scatter, free", rows(every("w"), own("ḡ"), states)),
                ("after the step of each rank's shard", rows(own("w'", "w"), own("ḡ"), states)),
                ("after all-gather", rows(every("w'"), own("ḡ"), states))]
    return [("start of the step", rows(own("w"), nothing, states)),
            ("forward/backward of one layer: all-gather", rows(every("w"), every("g"), states)),
            ("after its reduce-scatter, the layer freed", rows(own("w"), own("ḡ"), states)),
            ("after the step: done, no all-gather", rows(own("w'"), own("ḡ"), states))]


def draw_zero_step(stage: int, world_size: int = 4):
    """One panel per phase of a step of ``stage``; rows are ranks, columns the shards of each kind."""
    phases = zero_step_states(stage, world_size)
    n = world_size
    fig, axes = plt.subplots(1, len(phases), figsize=(3.6 * len(phases), 0.42 * n + 1.5), sharey=True)
    for ax, (title, ranks) in zip(axes, phases):
        for rank, held in enumerate(ranks):
            y = n - 1 - rank
            for k, kind in enumerate(KINDS):
                for shard, label in enumerate(held[kind]):
                    x = k * (n + 0.6) + shard
                    filled = label != ""
                    ax.add_patch(Rectangle((x, y + 0.1), 0.9, 0.8, facecolor=rank_color(shard) if filled else "white",
                                           alpha=0.3 if label == "g" else 0.75 if filled else 1.0,
                                           edgecolor="0.75", lw=0.6))
                    if filled:
                        ax.text(x + 0.45, y + 0.5, label, ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.2, 3 * (n + 0.6))
        ax.set_ylim(0, n)
        ax.set_xticks([k * (n + 0.6) + n / 2 - 0.05 for k in range(3)], ["weights", "grads", "opt. states"],
                      fontsize=8)
        ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set_title(title, fontsize=9)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"{STAGE_NAMES[stage]} on {n} ranks: column i is shard i, coloured by the rank that owns it "
                 "(w' updated, g local gradient, ḡ averaged, s optimizer state)", fontsize=10)
    fig.tight_layout()
    return fig


def drawn_labels(fig) -> list[list[str]]:
    """The labels drawn in each panel, left to right then top to bottom (what the tests compare)."""
    return [[t.get_text() for t in sorted(ax.texts, key=lambda t: (-t.get_position()[1], t.get_position()[0]))]
            for ax in fig.axes]


LIFECYCLE_ROWS = ("weight shard", "whole weight", "whole gradient", "gradient shard")


def zero3_lifecycle() -> list[tuple[str, bool, set[str]]]:
    """One ZeRO-3 layer through a training step: ``[(phase, is it a collective, the rows held after it), ...]``
    (rows from :data:`LIFECYCLE_ROWS`). The whole weight exists only between a gather and the next free."""
    shard, whole, grad, grad_shard = LIFECYCLE_ROWS
    return [("all-gather", True, {shard, whole}), ("forward", False, {shard, whole}), ("free", False, {shard}),
            ("all-gather", True, {shard, whole}), ("backward", False, {shard, whole, grad}),
            ("reduce-scatter", True, {shard, whole, grad, grad_shard}), ("free", False, {shard, grad_shard})]


def draw_zero3_lifecycle(world_size: int = 4):
    """The strip of :func:`zero3_lifecycle`: phases left to right, what one rank holds in each row; the
    collectives' columns framed. Whole tensors are drawn N cells wide, shards one cell."""
    phases = zero3_lifecycle()
    fig, ax = plt.subplots(figsize=(1.55 * len(phases) + 1.6, 2.6))
    for col, (phase, collective, held) in enumerate(phases):
        x = col * 1.5
        for row, name in enumerate(LIFECYCLE_ROWS):
            y = len(LIFECYCLE_ROWS) - 1 - row
            width = 1.2 if name.startswith("whole") else 1.2 / world_size
            ax.add_patch(Rectangle((x, y + 0.15), width, 0.7, facecolor=rank_color(0) if name in held else "white",
                                   alpha=0.35 if "gradient" in name else 0.75, edgecolor="0.7", lw=0.6))
        if collective:
            ax.add_patch(Rectangle((x - 0.1, -0.1), 1.4, len(LIFECYCLE_ROWS) + 0.2, fill=False, lw=1.6,
                                   edgecolor="0.2"))
        ax.text(x + 0.6, len(LIFECYCLE_ROWS) + 0.25, phase, ha="center", fontsize=9,
                fontweight="bold" if collective else "normal")
    ax.set_yticks([len(LIFECYCLE_ROWS) - 1 - r + 0.5 for r in range(len(LIFECYCLE_ROWS))], LIFECYCLE_ROWS)
    ax.set_xticks([])
    ax.set_xlim(-0.3, 1.5 * len(phases))
    ax.set_ylim(-0.2, len(LIFECYCLE_ROWS) + 0.7)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"one ZeRO-3 layer on one rank of {world_size}: collectives framed; a shard is 1/{world_size} "
                 "of the whole", fontsize=10)
    fig.tight_layout()
    return fig
