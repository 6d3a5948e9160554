"""Pictures of tensor parallelism: which rank holds which part of each matrix.

* :func:`draw_matmul_split`: ``Y = X · Wᵀ`` split by columns (each rank a slice of the output features) or by
  rows (each rank a slice of the input features, a partial sum of the whole output).
* :func:`draw_local_parts`: what each rank holds of one DTensor, for several placements (``Shard``,
  ``Replicate``, ``Partial``), or before and after a ``redistribute``: drawn from the ranks' real local tensors.
* :func:`draw_holdings`: on a device mesh, which rank holds which element of each weight (from the real shards).

A cell is coloured by the rank that holds it (the course's rank colours); grey marks a value every rank holds,
or a sum over ranks. Each function returns the figure; the tests read its texts and colours back.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import REDUCED, rank_color

WHOLE = "#dddddd"


def _block(ax, x, y, w, h, color, label="", alpha=0.85):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", lw=1.5, alpha=alpha))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8)


def _matrix(ax, x0, name, rows, cols, split, n, shape_label):
    """A rows×cols matrix at x0 (height scaled to rows), cut in n bands ``split``: 'cols', 'rows' or None."""
    for r in range(n if split else 1):
        if split == "cols":
            _block(ax, x0 + cols * r / n, 0, cols / n, rows, rank_color(r), f"r{r}")
        elif split == "rows":
            _block(ax, x0, rows * (n - 1 - r) / n, cols, rows / n, rank_color(r), f"r{r}")
        else:
            _block(ax, x0, 0, cols, rows, WHOLE, "all ranks")
    ax.text(x0 + cols / 2, rows + 0.4, f"{name}\n{shape_label}", ha="center", va="bottom", fontsize=9)
    return x0 + cols


def draw_matmul_split(kind: str, world_size: int = 2, batch: int = 3, d_in: int = 4, d_out: int = 4):
    """``Y = X · Wᵀ`` with ``Wᵀ`` split by columns (``kind="column"``) or by rows (``kind="row"``)."""
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    n = world_size
    fig, ax = plt.subplots(figsize=(8.5, 2.6))
    if kind == "column":
        x = _matrix(ax, 0, "X: whole", batch, d_in, None, n, f"{batch}×{d_in}")
        ax.text(x + 0.5, batch / 2, "·", fontsize=20, ha="center", va="center")
        x = _matrix(ax, x + 1, "Wᵀ: columns split", d_in, d_out, "cols", n, f"{d_in}×{d_out}")
        ax.text(x + 0.5, batch / 2, "=", fontsize=16, ha="center", va="center")
        _matrix(ax, x + 1, "Y: columns split", batch, d_out, "cols", n, f"{batch}×{d_out}")
        ax.set_title(f"column-parallel on {n} ranks: rank r computes X · Wᵀ[:, slice r] = Y[:, slice r]; "
                     "no communication forward", fontsize=9)
    else:
        x = _matrix(ax, 0, "X: columns split", batch, d_in, "cols", n, f"{batch}×{d_in}")
        ax.text(x + 0.5, batch / 2, "·", fontsize=20, ha="center", va="center")
        x = _matrix(ax, x + 1, "Wᵀ: rows split", d_in, d_out, "rows", n, f"{d_in}×{d_out}")
        ax.text(x + 0.5, batch / 2, "=", fontsize=16, ha="center", va="center")
        _block(ax, x + 1, 0, d_out, batch, REDUCED, "Σ over ranks\nof r's partial")
        ax.text(x + 1 + d_out / 2, batch + 0.4, f"Y = Σᵣ (rank r's partial)\n{batch}×{d_out}",
                ha="center", va="bottom", fontsize=9)
        ax.set_title(f"row-parallel on {n} ranks: rank r's partial sum has Y's full shape; "
                     "an all-reduce adds them", fontsize=9)
    ax.set_xlim(-0.2, 3 * max(d_in, d_out) + 2.5)
    ax.set_ylim(-0.2, max(batch, d_in) + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_local_parts(rows: dict, title: str = "what each rank holds"):
    """One row per entry ``label: (placement, [local tensor of rank 0, rank 1, ...])``, one column per rank.

    The local tensors' values are written in their cells. A ``Replicate`` part is grey (every rank has it),
    a ``Partial`` part is grey-framed with its rank's colour (a term of a sum), a ``Shard`` part has its rank's
    colour.
    """
    n = max(len(parts) for _, parts in rows.values())
    fig, axes = plt.subplots(len(rows), n, figsize=(2.3 * n + 0.5, 1.35 * len(rows) + 0.6), squeeze=False)
    for i, (label, (placement, parts)) in enumerate(rows.items()):
        for rank, part in enumerate(parts):
            ax = axes[i][rank]
            values = part.reshape(part.shape[0] if part.dim() > 1 else 1, -1)
            color = WHOLE if placement == "Replicate" else rank_color(rank)
            alpha = 0.35 if placement == "Partial" else 0.85
            top = max(4, values.shape[0])   # every panel the same size, parts drawn from the top left
            for r in range(values.shape[0]):
                for c in range(values.shape[1]):
                    _block(ax, c, top - 1 - r, 1, 1, color, f"{values[r, c].item():g}", alpha)
            ax.set_xlim(0, max(4, values.shape[1]))
            ax.set_ylim(0, top)
            ax.set_aspect("equal")
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_visible(False)
            if i == 0:
                ax.set_title(f"rank {rank}", fontsize=9)
            if rank == 0:
                ax.set_ylabel(label, fontsize=9, rotation=0, ha="right", va="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def holders(indices_per_rank: list, numel: int) -> list[list[int]]:
    """For each element of a tensor of ``numel`` elements, the ranks holding it.

    ``indices_per_rank[r]``: the *values* of rank r's local shard of a tensor whose full value was
    ``arange(numel)`` (each element its own index), so the shard names the elements it holds.
    """
    out: list[list[int]] = [[] for _ in range(numel)]
    for rank, idx in enumerate(indices_per_rank):
        for i in idx.flatten().long().tolist():
            out[i].append(rank)
    return out


def draw_holdings(weights: dict, mesh_shape: tuple[int, int] = (2, 2), dims: tuple[str, str] = ("dp", "tp")):
    """The mesh, then each weight's elements coloured by the rank that holds them.

    ``weights[name] = (full_shape, [local shard of rank 0, ...])`` with the shards as in :func:`holders`.
    A cell held by several ranks shows them all (``0,1``) in the first one's colour.
    """
    fig, axes = plt.subplots(1, len(weights) + 1, figsize=(3.0 * (len(weights) + 1), 3.2),
                             gridspec_kw={"width_ratios": [1.2] + [1.0] * len(weights)})
    ax = axes[0]
    rows, cols = mesh_shape
    for r in range(rows):
        for c in range(cols):
            rank = r * cols + c
            _block(ax, c, rows - 1 - r, 1, 1, rank_color(rank), f"rank {rank}\n{dims[0]}={r} {dims[1]}={c}")
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"mesh {rows}×{cols}: rows = {dims[0]}, columns = {dims[1]}", fontsize=9)
    for ax, (name, (shape, shards)) in zip(axes[1:], weights.items()):
        h, w = shape if len(shape) == 2 else (shape[0], 1)
        who = holders(shards, h * w)
        for i, ranks in enumerate(who):
            r, c = divmod(i, w)
            _block(ax, c, h - 1 - r, 1, 1, rank_color(ranks[0]) if ranks else "white",
                   ",".join(map(str, ranks)) if w <= 8 else "")
        ax.set_xlim(0, w)
        ax.set_ylim(0, h)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{name} {h}×{w}", fontsize=9)
    fig.tight_layout()
    return fig
