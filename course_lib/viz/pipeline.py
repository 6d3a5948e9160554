"""Pictures of pipelines: who computes which micro-batch when (simulated or measured)."""
from __future__ import annotations

import matplotlib.pyplot as plt

COLOURS = {"F": "#4a90d9", "B": "#5cb85c", "I": "#5cb85c", "W": "#f0ad4e"}


def draw_pipeline(times: list[list[tuple]], title: str, unit: str = "s", row: str = "stage"):
    """Gantt chart of a pipeline: one row per stage, forward ops blue, backward ops green, labelled by micro-batch.
    A backward split in two (zero-bubble schedules) draws its input gradient ``I`` green and its weight gradient
    ``W`` orange.

    ``times[stage]`` is a list of ``(op, micro_batch, ..., start, end)`` (the label is op and micro-batch, the bar
    from start to end); works for the output of :func:`course_lib.pipeline_parallel.simulate` and for timelines
    measured by :func:`course_lib.pipeline_parallel.pipeline_worker` alike. ``row`` names the rows ("stage", or
    "rank" where a rank holds several stages).
    """
    stages = len(times)
    fig, ax = plt.subplots(figsize=(10, 0.55 * stages + 1.2))
    for s, ops in enumerate(times):
        y = stages - 1 - s
        for op, i, *_, start, end in ops:
            ax.barh(y, end - start, left=start, color=COLOURS.get(op, "#5cb85c"), edgecolor="white")
            ax.text((start + end) / 2, y, f"{op}{i}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"{row} {s}" for s in reversed(range(stages))])
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
