"""Notebook 07's comparison of torch's schedules with the course's, as functions (so the cells stay short).

:func:`run_torch_schedules` runs ``torch.distributed.pipelining``'s GPipe, 1F1B and interleaved 1F1B on 2 ranks
(:func:`.torch_pipelining.torch_pipeline_worker`), once on a small model for the gradients and once on a large one
for the clock; :func:`course_grads` gives :func:`.stages.pipeline_worker`'s gradients to compare them with, and
:func:`idle_over_compute` measures a timed run's idle time the way (p-1)/(v m) counts it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .schedules import play
from .stages import BALANCED, make_batch, make_full_model, most_balanced, pipeline_worker, rank_imbalance, replayed
from .torch_pipelining import stage_indices, torch_pipeline_worker

SMALL = dict(micro_batches=4, batch=16, width=32, layers_per_stage=2)    # for the gradients
BIG = dict(micro_batches=4, batch=2048, width=512)                     # for the clock: 8 layers per rank
CONFIGS = {"gpipe": dict(schedule="gpipe", **SMALL),
           "1f1b": dict(schedule="1f1b", **SMALL),
           "1f1b, scale_grads=False": dict(schedule="1f1b", scale_grads=False, **SMALL),
           "interleaved": dict(schedule="interleaved", stages_per_rank=2, **SMALL),
           "1f1b, timed": dict(schedule="1f1b", layers_per_stage=8, **BIG),
           "interleaved, timed": dict(schedule="interleaved", stages_per_rank=2, layers_per_stage=4, **BIG)}


TIMED = ("1f1b, timed", "interleaved, timed")


def _run(names, ranks: int, timeout: float) -> dict[str, list[dict]]:
    from ..launch import run

    res = run(torch_pipeline_worker, ranks, *(CONFIGS[n] for n in names), backend="gloo", threads=1,
              show_output=False, timeout=timeout)
    return {name: [r[k] for r in res] for k, name in enumerate(names)}


def _timed_imbalance(runs: dict) -> float:
    return max(rank_imbalance(runs[name]) for name in TIMED)


def run_torch_schedules(ranks: int = 2, timeout: float = 300, tries: int = 3) -> dict[str, list[dict]]:
    """Every run of :data:`CONFIGS` on ``ranks`` processes (Gloo, one thread each), in one launch:
    ``{name: [rank 0's result, rank 1's, ...]}``, each result with ``"grads"`` (per stage) and ``"timeline"``.

    The two timed runs (:data:`TIMED`) are measured again, up to ``tries`` runs in all, while their ranks' CPU
    times differ by :data:`.stages.BALANCED` or more (:func:`.stages.most_balanced`): equal stages that measure
    unequal measured the machine (a busy one slows one rank more), not the schedule."""
    runs = _run(list(CONFIGS), ranks, timeout)
    if tries > 1 and _timed_imbalance(runs) >= BALANCED:
        timed, imbalance, _ = most_balanced(lambda: _run(TIMED, ranks, timeout), tries - 1, _timed_imbalance)
        if imbalance < _timed_imbalance(runs):
            runs.update(timed)
    return runs


def in_stage_order(results: list[dict]) -> list[torch.Tensor]:
    """The gradients of every rank's stages, stage 0 first (interleaving puts stages 0 and 2 on rank 0)."""
    by_stage = {s: grads for r in results for s, grads in r["grads"].items()}
    return [g for s in sorted(by_stage) for g in by_stage[s]]


def course_grads(stages: int, kind: str) -> list[torch.Tensor]:
    """:func:`.stages.pipeline_worker`'s gradients for :data:`SMALL` on ``stages`` processes, stage 0 first."""
    from ..launch import run

    res = run(pipeline_worker, stages, kind, SMALL["micro_batches"], SMALL["batch"], SMALL["width"],
              SMALL["layers_per_stage"], backend="gloo", show_output=False)
    return [g for r in res for g in r["grads"]]


def course_vs_unsplit(kind: str, stages: int, micro_batches: int, batch: int, width: int = 32,
                      layers_per_stage: int = 2) -> tuple[bool, list[int]]:
    """Run :func:`.stages.pipeline_worker` (schedule ``kind``) on ``stages`` processes and the unsplit model on the
    same batch; return whether every gradient is the unsplit model's (up to 1e-6) and the activations each
    stage held at most."""
    from ..launch import run

    res = run(pipeline_worker, stages, kind, micro_batches, batch, width, layers_per_stage, backend="gloo",
              show_output=False)
    full = make_full_model(stages, width, layers_per_stage)
    x, y = make_batch(batch, width)
    F.mse_loss(full(x), y).backward()
    return equal([g for r in res for g in r["grads"]], [p.grad for p in full.parameters()]), \
        [r["peak_in_flight"] for r in res]


def equal(a, b, scale: float = 1.0) -> bool:
    """Whether two lists of gradients are equal, ``b`` times ``scale`` (up to 1e-6)."""
    return len(a) == len(b) and all(torch.allclose(x, y * scale, atol=1e-6) for x, y in zip(a, b, strict=True))


def order(result: dict) -> list[tuple[str, int]]:
    """The ops a rank ran, in the order it ran them: ``[("F", 0), ("F", 1), ("B", 0), ...]``."""
    return [(op, i) for op, i, *_ in result["timeline"]]


def overhead(bubble: float) -> float:
    """Idle time over compute time, from the bubble (idle time over the whole step): b / (1 - b)."""
    return bubble / (1 - bubble)


def idle_over_compute(results: list[dict], stages_per_rank: int) -> dict[str, float]:
    """A timed run's idle time over its compute time, two ways: ``"equal ops"`` plays the ops in the order torch
    ran them with every forward 1 unit and every backward 2 (so it tests the order alone); ``"replayed"`` plays
    them at their measured CPU times (:func:`.stages.replayed`)."""
    ranks = [[(op, i, s, 1.0 if op == "F" else 2.0) for op, i, s, *_ in r["timeline"]] for r in results]
    return {"equal ops": overhead(play(ranks, len(results) * stages_per_rank)["bubble"]),
            "replayed": overhead(replayed(results)["bubble"])}


def crossings(ranks: int, stages_per_rank: int) -> int:
    """How many times a micro-batch passes from one rank to another on its way forward, from the placement
    (:func:`.torch_pipelining.stage_indices`: rank r holds stages r, r + p, r + 2p, ...)."""
    owner = {s: r for r in range(ranks) for s in stage_indices(r, ranks, stages_per_rank)}
    return sum(owner[s] != owner[s + 1] for s in range(ranks * stages_per_rank - 1))


def timeline_rows(results: list[dict], ranks: int = 2) -> list[list[tuple]]:
    """Each rank's timed ops for :func:`course_lib.viz.draw_pipeline`, a micro-batch on the rank's second stage
    marked ``i'``."""
    return [[(op, f"{i}'" if s >= ranks else i, a, e) for op, i, s, _, a, e in r["timeline"]] for r in results]
