"""The planner: predict every layout, keep those that fit, rank them by step time, and say why the winner wins.

**The rule.** A layout is a candidate when its fullest GPU's bytes fit in :attr:`.shapes.Cluster.limit_gib`: the
memory the driver reports, less a stated reserve for the CUDA context and NCCL's buffers, less a stated share for
the allocator's fragmentation (74.2 GiB of an H100's 79.6: :func:`.shapes.h100_cluster`).
Candidates are ranked by predicted **seconds per step** for the same global batch, fastest first: the same
work in less time is the same as a higher MFU. Bytes sent are not the criterion: a byte on NVLink costs
a ninth of a byte on the network (450 against 50 GB/s on an H100 node), and a byte hidden under compute costs
nothing. (The course's first planner ranked by tensor-parallel bytes before data-parallel bytes, and called
"TP 2 × DP 32, ZeRO-3" best for 70 B on 64 GPUs: several seconds of cross-node traffic a step.)
"""
from __future__ import annotations

from .memory import memory_per_gpu
from .shapes import Cluster, Model
from .space import Layout, enumerate_layouts
from .timing import EFFICIENCY, TERMS, step_time

TERM_WORDS = {"compute": "compute", "imbalance": "the slowest pipeline stage's extra compute (the LM head)",
              "elementwise": "memory-bound element-wise work (norms, residuals, SwiGLU, rotary, logits)",
              "optimizer": "the optimizer's step (memory-bound)",
              "recompute": "recomputation's extra forward",
              "tp": "tensor-parallel collectives", "cp": "exposed context-parallel transfers",
              "dp": "exposed gradient and weight collectives (data parallel / ZeRO)",
              "pp_p2p": "pipeline sends", "bubble": "the pipeline bubble"}


def predict(layout: Layout, model: Model, cluster: Cluster, efficiency: float = EFFICIENCY) -> dict:
    """Everything the planner knows about one layout: ``"memory"`` (bytes by part, the fullest stage),
    ``"gib"``, ``"limit_gib"`` (:attr:`.shapes.Cluster.limit_gib`), ``"fits"`` (``gib <= limit_gib``),
    ``"time"`` (seconds by term, ``"step"``, ``"mfu"``), ``"name"``."""
    mem = memory_per_gpu(model, layout)
    gib = mem["total"] / 2**30
    return {"layout": layout, "name": layout.name(), "memory": mem, "gib": gib, "limit_gib": cluster.limit_gib,
            "fits": gib <= cluster.limit_gib, "time": step_time(model, cluster, layout, efficiency)}


def rank(model: Model, cluster: Cluster, global_batch: int | None = None, micro_batches=(1, 2, 4),
         global_batch_tokens: int | None = None, efficiency: float = EFFICIENCY, keep_all: bool = False,
         **space) -> list[dict]:
    """Predictions of every layout of :func:`.space.enumerate_layouts` that fits (all of them with
    ``keep_all``, fitting ones first), fastest step first."""
    rows = [predict(lay, model, cluster, efficiency)
            for lay in enumerate_layouts(model, cluster, global_batch, micro_batches, global_batch_tokens, **space)]
    rows = rows if keep_all else [r for r in rows if r["fits"]]
    return sorted(rows, key=lambda r: (not r["fits"], r["time"]["step"], r["gib"]))


def find(rows: list[dict], **degrees) -> dict:
    """The fastest row of ``rows`` whose layout has these attributes (``find(rows, tp=8, dp=8, zero=2)``)."""
    for r in rows:
        if all(getattr(r["layout"], k) == v for k, v in degrees.items()):
            return r
    raise LookupError(f"no layout with {degrees} among {len(rows)} rows")


def table(rows: list[dict], top: int = 10) -> list[str]:
    """The first ``top`` rows as text: name, GiB, each term in seconds, step, MFU."""
    head = f"{'layout':58} {'GiB':>5} " + " ".join(f"{t:>8}" for t in TERMS) + f" {'step s':>7} {'MFU':>5}"
    lines = [head]
    for r in rows[:top]:
        t = r["time"]
        lines.append(f"{r['name']:58} {r['gib']:5.1f} " + " ".join(f"{t[k]:8.3f}" for k in TERMS)
                     + f" {t['step']:7.3f} {t['mfu']:5.1%}")
    return lines


def explain(winner: dict, runner_up: dict) -> str:
    """Why ``winner`` beats ``runner_up`` (two rows of :func:`rank`), in words: the step times, then each term
    where they differ by more than 1% of the winner's step, largest difference first."""
    a, b = winner["time"], runner_up["time"]
    gap = b["step"] - a["step"]
    words = [f"{winner['name']} takes {a['step']:.3f} s a step (MFU {a['mfu']:.1%}, {winner['gib']:.1f} GiB a "
             f"GPU); {runner_up['name']} takes {b['step']:.3f} s (MFU {b['mfu']:.1%}, {runner_up['gib']:.1f} GiB), "
             f"{gap:.3f} s more."]
    diffs = sorted(((b[k] - a[k], k) for k in TERMS if abs(b[k] - a[k]) > 0.01 * a["step"]), reverse=True)
    for d, k in diffs:
        side = "saves" if d > 0 else "costs"
        words.append(f"The winner {side} {abs(d):.3f} s in {TERM_WORDS[k]} ({a[k]:.3f} s against {b[k]:.3f} s).")
    if not diffs:
        words.append("No term differs by more than 1% of a step: the two are equal within the model's accuracy.")
    return " ".join(words)
