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


def overlap_schedule(backward_ms: list[float], allreduce_ms: list[float]) -> dict:
    """When each bucket's all-reduce runs, without and with overlap: layer i's gradients (last layer first) form
    bucket i; one all-reduce at a time. Without overlap all of them wait for the end of backward; with overlap
    bucket i starts as soon as its layer is done and the previous bucket has been sent. Returns both schedules
    as lists of (start, end) and the step's end in each."""
    ends = [sum(backward_ms[:i + 1]) for i in range(len(backward_ms))]
    schedule = {}
    for mode in ("without", "with"):
        t, spans = 0.0 if mode == "with" else ends[-1], []
        for ready, cost in zip(ends, allreduce_ms):
            start = max(t, ready)
            spans.append((start, start + cost))
            t = start + cost
        schedule[mode] = {"spans": spans, "step": max(ends[-1], t)}
    return {"backward": ends, **schedule}


def draw_overlap(backward_ms: list[float], allreduce_ms: list[float]):
    """A schematic step: backward's layers (last first) on the compute row, each bucket's all-reduce on the network
    row, first without overlap, then with it. Returns the figure and :func:`overlap_schedule`'s result."""
    s = overlap_schedule(backward_ms, allreduce_ms)
    fig, axes = plt.subplots(2, 1, figsize=(8, 2.6), sharex=True)
    starts = [0.0] + s["backward"][:-1]
    n = len(backward_ms)
    for ax, mode in zip(axes, ("without", "with")):
        for i, (a, b) in enumerate(zip(starts, s["backward"])):
            ax.barh(1, b - a, left=a, color="0.55", edgecolor="w")
            ax.text((a + b) / 2, 1, f"layer {n - i}", ha="center", va="center", fontsize=7, color="w")
        for i, (a, b) in enumerate(s[mode]["spans"]):
            ax.barh(0, b - a, left=a, color=rank_color(i), edgecolor="w")
            ax.text((a + b) / 2, 0, f"bucket {i}", ha="center", va="center", fontsize=7)
        ax.axvline(s[mode]["step"], color="k", ls="--", lw=1)
        ax.set_yticks([1, 0], ["backward", "all-reduce"], fontsize=8)
        ax.set_title(f"{mode} overlap: the step ends at {s[mode]['step']:g} ms", fontsize=9)
    axes[-1].set_xlabel("milliseconds since backward began (schematic)")
    fig.tight_layout()
    return fig, s


def draw_torchrun(nnodes: int, nproc_per_node: int):
    """Nodes, one torchrun agent per node, and its workers, each labelled with the variables torchrun sets:
    RANK (global), LOCAL_RANK (on its node) and GROUP_RANK (the node's number). Returns the figure and the
    labels, one dict per worker in RANK order."""
    workers = [{"RANK": node * nproc_per_node + local, "LOCAL_RANK": local, "GROUP_RANK": node,
                "WORLD_SIZE": nnodes * nproc_per_node} for node in range(nnodes) for local in range(nproc_per_node)]
    width = 1.25
    fig, ax = plt.subplots(figsize=(max(6, nnodes * nproc_per_node * width + 1), 3.2))
    for node in range(nnodes):
        x0 = node * (nproc_per_node * width + 0.4)
        w = nproc_per_node * width
        ax.add_patch(Rectangle((x0, 0), w, 3, fill=False, lw=1.5))
        ax.text(x0 + w / 2, 2.8, f"node {node}", ha="center", va="center", fontsize=9, weight="bold")
        ax.add_patch(Rectangle((x0 + 0.1, 1.9), w - 0.2, 0.55, color="0.85"))
        ax.text(x0 + w / 2, 2.17, f"torchrun agent (GROUP_RANK={node})", ha="center", va="center", fontsize=8)
        for local in range(nproc_per_node):
            rank = node * nproc_per_node + local
            x = x0 + local * width + 0.1
            ax.add_patch(Rectangle((x, 0.15), width - 0.2, 1.4, color=rank_color(rank), alpha=0.8))
            ax.text(x + (width - 0.2) / 2, 0.85, f"worker\nRANK={rank}\nLOCAL_RANK={local}\nGROUP_RANK={node}",
                    ha="center", va="center", fontsize=7)
            ax.annotate("", (x + (width - 0.2) / 2, 1.55), (x + (width - 0.2) / 2, 1.9),
                        arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.set_xlim(-0.2, nnodes * (nproc_per_node * width + 0.4))
    ax.set_ylim(0, 3.1)
    ax.axis("off")
    ax.set_title(f"torchrun --nnodes={nnodes} --nproc-per-node={nproc_per_node}: each agent starts its node's "
                 f"workers (WORLD_SIZE={nnodes * nproc_per_node})", fontsize=9)
    fig.tight_layout()
    return fig, workers
