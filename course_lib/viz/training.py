"""Pictures for data parallelism: how a DistributedSampler shards and shuffles, when buckets are
all-reduced during backward, loss curves and scaling."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..data_parallel.training import sampler_shards
from .style import rank_color


def draw_sampler(n: int, world_size: int, drop_last: bool = False):
    """Which data set index goes to which rank. Hatched: a padding repeat; crossed out: dropped."""
    shards = sampler_shards(n, world_size, drop_last=drop_last)
    fig, ax = plt.subplots(figsize=(max(6, 0.42 * n), 0.45 * world_size + 1.2))
    seen: set[int] = set()
    for rank, shard in enumerate(shards):
        y, extra = world_size - 1 - rank, 0
        for idx in shard:
            repeat = idx in seen
            seen.add(idx)
            x = idx if not repeat else n + 0.5 + extra    # repeats are drawn after the data set's end
            extra += repeat
            ax.add_patch(Rectangle((x, y + 0.1), 0.9, 0.8, color=rank_color(rank), alpha=0.4 if repeat else 0.85,
                                   hatch="//" if repeat else None))
            ax.text(x + 0.45, y + 0.5, str(idx), ha="center", va="center", fontsize=7)
    dropped = sorted(set(range(n)) - seen)
    for idx in dropped:
        ax.text(idx + 0.45, world_size / 2, "✗", ha="center", va="center", color="red", fontsize=12)
    mode = "drop_last=True: the rest is dropped" if drop_last else "drop_last=False: pads by repeating"
    ax.set_title(f"{n} samples, {world_size} ranks, {mode}; {len(shards[0])} per rank", fontsize=9)
    ax.set_xlim(0, n + 2)
    ax.set_ylim(0, world_size)
    ax.set_xticks([])
    ax.set_xlabel("data set index (repeats after the end)", fontsize=8)
    ax.set_yticks([world_size - 1 - r + 0.5 for r in range(world_size)], [f"rank {r}" for r in range(world_size)])
    fig.tight_layout()
    return fig


def draw_epoch_orders(n: int, world_size: int, epochs: int, set_epoch: bool):
    """Rank 0's order of samples in successive epochs, with and without ``set_epoch``."""
    orders = [sampler_shards(n, world_size, shuffle=True, epoch=e if set_epoch else 0)[0] for e in range(epochs)]
    fig, ax = plt.subplots(figsize=(6, 0.4 * epochs + 1))
    ax.imshow(orders, cmap="viridis", aspect="auto")
    for e, order in enumerate(orders):
        for j, idx in enumerate(order):
            ax.text(j, e, str(idx), ha="center", va="center", fontsize=7, color="w")
    ax.set_yticks(range(epochs), [f"epoch {e}" for e in range(epochs)])
    ax.set_xticks([])
    ax.set_title(f"rank 0's samples, {'with' if set_epoch else 'WITHOUT'} sampler.set_epoch(epoch)", fontsize=9)
    fig.tight_layout()
    return fig, orders


def draw_bucket_timeline(record: dict):
    """Forward, backward, and each bucket's all-reduce on one time axis (milliseconds)."""
    ms = 1e3
    buckets = record["buckets"]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(buckets) + 1.6))
    top = len(buckets) + 1
    ax.barh(top, record["forward_done"] * ms, color="0.7", label="forward")
    ax.barh(top, (record["backward_done"] - record["forward_done"]) * ms, left=record["forward_done"] * ms,
            color="0.45", label="backward")
    for b in buckets:
        y = top - 1 - b["bucket"]
        ax.barh(y, (b["finished"] - b["launched"]) * ms, left=b["launched"] * ms, color=rank_color(b["bucket"]),
                alpha=0.8)
        ax.text(b["finished"] * ms, y, f" {b['bytes'] / 2**20:.1f} MiB", va="center", fontsize=7)
    ax.axvline(record["backward_done"] * ms, color="k", ls="--", lw=1, label="backward ends")
    ax.set_yticks([top] + [top - 1 - b["bucket"] for b in buckets],
                  ["compute"] + [f"bucket {b['bucket']}" for b in buckets], fontsize=8)
    ax.set_xlabel("milliseconds since the start of forward (rank 0)")
    ax.set_title("MiniDDP: each bucket's all-reduce starts as soon as its gradients exist", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_losses(curves: dict[str, list[float]], title: str = "training loss"):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, losses in curves.items():
        ax.plot(losses, label=label)
    ax.set(xlabel="step", ylabel="cross-entropy", title=title, yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
