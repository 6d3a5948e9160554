"""Pipeline parallelism: a model's stages on different ranks, micro-batches flowing through them.

* :mod:`.schedules`: GPipe and 1F1B as lists of ops, simulated (any plan: it says who waits for what when one
  deadlocks); the bubble formulas; activations held.
* :mod:`.stages`: a schedule run for real across processes (:func:`stage_step` is the loop of one stage,
  :func:`pipeline_worker` runs it with a :class:`StageClock`), measured (wall clock and CPU time), and replayed
  (:func:`bubble_sweep`).
* :mod:`.torch_pipelining`: the same with PyTorch's own ``torch.distributed.pipelining`` (GPipe, 1F1B,
  interleaved 1F1B). Not imported here: importing ``torch.distributed.pipelining`` takes a fresh Python
  seconds (it pulls in torch's compiler stack), so only the code that uses it pays for it
  (``from course_lib.pipeline_parallel.torch_pipelining import torch_pipeline_worker``).
* :mod:`.zero_bubble`: torch's zero-bubble schedules (ZBV, DualPipeV), their plans played, run on the course's
  MLP (not imported here either, for the same reason).
"""
from .schedules import (
                        KINDS,
                        bubble_formula,
                        bubble_overhead,
                        peak_in_flight,
                        play,
                        ranks_overlap,
                        schedule,
                        simulate,
                        simulate_plan,
)
from .stages import (
                        BALANCED,
                        UNDISTURBED,
                        StageClock,
                        bubble_sweep,
                        make_batch,
                        make_full_model,
                        make_stage,
                        measured_bubble,
                        measured_makespan,
                        most_balanced,
                        pipeline_worker,
                        rank_imbalance,
                        replay_tolerance,
                        replayed,
                        shift_to_common_origin,
                        stage_step,
                        stretch,
                        typical_costs,
                        wall_tolerance,
)

__all__ = ["KINDS", "schedule", "simulate", "simulate_plan", "play", "bubble_formula", "bubble_overhead",
           "peak_in_flight", "ranks_overlap", "make_stage", "make_full_model", "make_batch", "pipeline_worker",
           "measured_bubble",
           "measured_makespan", "replayed", "rank_imbalance", "typical_costs", "stretch", "UNDISTURBED", "BALANCED",
           "most_balanced", "shift_to_common_origin", "stage_step", "StageClock", "bubble_sweep",
           "replay_tolerance", "wall_tolerance"]
