"""Training on the 3-D mesh, and the proof: the same weights as one process on the global batch.

:func:`train_3d_worker` runs on every rank. Each step:

1. the global batch is cut in ``dp`` equal slices; the ranks of dp replica ``d`` all take slice ``d``;
2. the pipeline schedule (``Schedule1F1B``, over this rank's pp group) cuts the slice into ``m`` micro-batches
   and runs their forwards and backwards in 1F1B order: stage 0 sends each micro-batch's activations to stage 1
   and receives their gradients back. Inside each stage's blocks, tensor and sequence parallelism talk in the tp
   group. The last stage computes each micro-batch's mean loss;
3. the schedule divides the accumulated gradients by ``m``, FSDP2 reduce-scatters them over the dp group (a sum,
   divided by ``dp``): every rank holds its shard of the gradient of the global batch's mean loss;
4. the optimizer steps on the shards.

Mean of ``m`` micro-batch means, then mean of ``dp`` slice means: the global mean, because the pieces are equal.
:func:`reference` trains the unsplit model on the global batch in one process, from the same weights.

**Tolerance.** Everything runs in float64: Gloo, DTensor, FSDP2 and pipelining all take it. The two runs add the
same numbers in different orders (micro-batches, dp shards, tp partial sums), and each order rounds differently,
by ~1e-16 of the numbers added. With SGD a weight moves by ``lr`` times its gradient, so the weights stay that
close: 3e-17 measured. Adam divides each gradient by its own size: its first step is ``lr·g/(|g| + eps)``, whose
slope at ``g = 0`` is ``lr/eps`` (1e6 at lr = 1e-2), so a rounding difference of ~1e-19 in a near-zero gradient
becomes ~1e-13 of weight: 2e-14 measured. :data:`TOLERANCE` = 1e-10 is a bound on both, with room for other
CPUs and torch versions, and far below what a real mistake makes: forgetting the ``1/m`` of the micro-batches or
the ``1/dp`` of the average moves SGD's weights by ~1e-1 (measured 0.25 and 0.08). Adam nearly hides such a
mistake, since it divides by the gradient's size: twice the gradient moves AdamW's weights by only 1.5e-3 (through
``eps``). That is why float64: in float32 (measured: SGD 6e-8, AdamW 3e-5) AdamW's rounding would come within a
factor of 50 of that mistake; in float64 they are 1e10 apart.

**Torch's quirks on this stack** (torch 2.13, CPU, Gloo), each worked around here:

* the first step is not like the others: ``PipelineStage`` infers the shapes it will send by running one extra
  forward on each stage (and one extra backward on the last), and sends them as objects (three more send/recv
  pairs). Count a later step (``count_step=-1``, the last, by default);
* a second, equal ``DeviceMesh`` in one process sends some DTensor collectives over the first mesh's groups
  (:func:`.mesh.device_mesh` builds each mesh once);
* ``full_tensor()`` on a weight sharded over (dp, tp) runs two all-gathers with a warning; :func:`full_weights`
  asks FSDP2 to unshard (dp) first, then gathers tp;
* FSDP2 all-reduces the LayerNorms' ``Partial`` gradients over tp itself before its reduce-scatter: the tp
  all-reduces at the end of the step (:mod:`.stages`).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..data import make_token_dataset
from ..models.transformer import (
    LMTrainConfig,
    TransformerConfig,
    batch_indices,
    lm_loss,
    make_optimizer,
    transformer,
)
from ..tensor_parallel.dtensor import full
from .count import GroupLog
from .mesh import DIMS, check_sizes, coords, device_mesh
from .stages import build_stage, stage_blocks

TOLERANCE = 1e-10
MISTAKES = (None, "no_microbatch_scaling", "dp_sum")

SMALL = LMTrainConfig(model=TransformerConfig(vocab=32, seq_len=16, dim=32, heads=4, layers=4, hidden=64),
                      steps=3, batch_size=16, n=64, optimizer="sgd", lr=0.1)
"""The notebook's run: 4 blocks of width 32, sequences of 16, a global batch of 16, three steps."""


def check_layout(world_size: int, cfg: LMTrainConfig, pp: int, dp: int, tp: int, micro_batches: int) -> None:
    """Raise ``ValueError`` with what to change unless the run divides evenly over the mesh."""
    check_sizes(world_size, pp, dp, tp)
    stage_blocks(cfg.model.layers, pp, 0)
    if cfg.batch_size % (dp * micro_batches):
        raise ValueError(f"a global batch of {cfg.batch_size} does not split into dp={dp} slices of "
                         f"{micro_batches} equal micro-batches: choose a batch that divides by {dp * micro_batches}")
    if cfg.model.heads % tp or cfg.model.seq_len % tp:
        raise ValueError(f"tp={tp} must divide the heads ({cfg.model.heads}) and the sequence ({cfg.model.seq_len})")
    if cfg.model.dropout:
        raise ValueError("compare with one process at dropout=0: the masks of one process and of 8 ranks differ")


def reference(cfg: LMTrainConfig, dtype: torch.dtype = torch.float64) -> dict:
    """One process, the whole model, each step's global batch: the losses and the final weights (``state``).

    :func:`course_lib.models.train_reference` in ``dtype`` (the same model, data, batches and optimizer).
    """
    inputs, targets = make_token_dataset(cfg.n, cfg.model.seq_len, cfg.model.vocab, seed=cfg.seed).tensors
    model = transformer(cfg.model, seed=cfg.seed).to(dtype)
    opt = make_optimizer(model.parameters(), cfg)
    losses = []
    for idx in batch_indices(cfg):
        opt.zero_grad()
        loss = lm_loss(model(inputs[idx]), targets[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _schedule(stage_module, mesh, micro_batches: int, scale_grads: bool):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp = mesh["pp"]
    stage = PipelineStage(stage_module, pp.get_local_rank(), pp.size(), torch.device(mesh.device_type),
                          group=pp.get_group())
    return Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=lm_loss, scale_grads=scale_grads)


def _step_loss(micro_losses: list, mesh, last: bool, dtype) -> float:
    """The global batch's mean loss, on every rank: mean over micro-batches, over dp, then shared along pp."""
    loss = torch.stack(micro_losses).mean().detach() if last else torch.zeros((), dtype=dtype)
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    dist.all_reduce(loss, group=mesh["pp"].get_group())   # only the last stage's ranks add anything
    return loss.item() / mesh["dp"].size()


def mark_forward(stage_module, log: GroupLog) -> None:
    """Label the messages of ``stage_module``'s forward (FSDP2's all-gathers among them) ``"forward"`` in ``log``."""
    def start(module, args):
        log.phase = "forward"

    def end(module, args, out):
        log.phase = "between"

    stage_module.register_forward_pre_hook(start, prepend=True)   # before FSDP2's own hook, which all-gathers
    stage_module.register_forward_hook(end)


def full_weights(stage_module) -> dict[str, torch.Tensor]:
    """The stage's whole weights, on every rank of the stage: gathered along dp, then along tp.

    ``unshard()`` is FSDP2's all-gather of each unit (dp); ``full_tensor()`` gathers what tp split.
    (``full_tensor()`` alone would gather both at once, in two all-gathers per weight, with a warning.)
    """
    from ..zero.fsdp2 import fsdp_units

    units = fsdp_units(stage_module)
    for unit in units:
        unit.unshard()
    state = {k: full(p).detach().cpu().clone() for k, p in stage_module.named_parameters()}
    for unit in units:
        unit.reshard()
    return state


def train_3d_worker(rank: int, world_size: int, cfg: LMTrainConfig = SMALL, pp: int = 2, dp: int = 2, tp: int = 2,
                    micro_batches: int = 4, dtype: torch.dtype = torch.float64, mistake: str | None = None,
                    count_step: int = -1) -> dict:
    """Train ``cfg.steps`` steps on a (pp, dp, tp) mesh and compare with :func:`reference`.

    ``launch.run`` passes arguments by position: ``run(train_3d_worker, 8, cfg, 2, 2, 2, 4, ...)``, or keywords
    through :func:`train_3d_runs`: ``run(train_3d_runs, 8, {"mistake": "dp_sum"})``.

    Returns ``coords`` (this rank's place), ``losses`` and ``reference_losses`` (each step's global mean),
    ``max_diff`` (the largest difference between this rank's stage's gathered weights and the reference's) and
    ``worst`` (which weight), ``names`` (the weights of this stage), ``shapes`` and ``placements`` (of this rank's
    shards, as DTensor prints them: one placement per mesh dimension, dp then tp),
    ``counts`` (``{dimension: {kind: n}}``: this rank's messages in step ``count_step``, the last by default),
    ``phases`` (the same, split ``{dimension: {phase: {kind: n}}}``) and ``bytes``.

    ``mistake``: ``"no_microbatch_scaling"`` (the schedule's ``scale_grads=False``: gradients ``m`` times too large)
    or ``"dp_sum"`` (FSDP2 sums over dp without dividing): a wrong run, which the comparison must catch.
    """
    if mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}: use one of {MISTAKES}")
    check_layout(world_size, cfg, pp, dp, tp, micro_batches)
    torch.set_flush_denormal(True)      # denormal floats in tiny gradients make CPU arithmetic 10-100x slower
    mesh = device_mesh(pp, dp, tp)
    here = coords(rank, pp, dp, tp)
    first, last = here["pp"] == 0, here["pp"] == pp - 1
    stage = build_stage(cfg.model, cfg.seed, mesh, dtype, sum_bug=mistake == "dp_sum")
    schedule = _schedule(stage, mesh, micro_batches, scale_grads=mistake != "no_microbatch_scaling")
    opt = make_optimizer(stage.parameters(), cfg)
    inputs, targets = make_token_dataset(cfg.n, cfg.model.seq_len, cfg.model.vocab, seed=cfg.seed).tensors
    per = cfg.batch_size // dp
    log = GroupLog({d: mesh[d].get_group() for d in DIMS})
    mark_forward(stage, log)
    steps = batch_indices(cfg)
    counted = range(len(steps))[count_step]
    losses = []
    for i, idx in enumerate(steps):
        mine = idx[here["dp"] * per:(here["dp"] + 1) * per]          # this dp replica's slice of the global batch
        micro: list = []
        with log if i == counted else nullcontext():
            opt.zero_grad()
            schedule.step(*((inputs[mine],) if first else ()),
                          **({"target": targets[mine], "losses": micro} if last else {}))
            opt.step()
        losses.append(_step_loss(micro, mesh, last, dtype))
    ref = reference(cfg, dtype)
    state = full_weights(stage)   # collectives among the ranks of this stage
    gaps = {k: (v - ref["state"][k]).abs().max().item() for k, v in state.items()}
    worst = max(gaps, key=gaps.get)
    return {"coords": here, "losses": losses, "reference_losses": ref["losses"], "max_diff": gaps[worst],
            "worst": worst, "names": list(state),
            "shapes": {k: tuple(p.to_local().shape) for k, p in stage.named_parameters()},
            "placements": {k: str(p.placements) for k, p in stage.named_parameters()},
            "counts": log.counts(), "phases": log.counts(by_phase=True), "bytes": log.bytes()}



def train_3d_runs(rank: int, world_size: int, *variants: dict) -> list[dict]:
    """:func:`train_3d_worker` once for each of ``variants`` (its keyword arguments), in one launch of the ranks:
    starting 8 processes costs seconds, so a notebook (or a test) pays it once. The mesh is built once too."""
    return [train_3d_worker(rank, world_size, **v) for v in variants]
