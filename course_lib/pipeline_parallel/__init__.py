"""Pipeline parallelism: a model's stages on different ranks, micro-batches flowing through them.

* :mod:`.schedules`: GPipe and 1F1B as lists of ops, simulated; the bubble formula; activations held.
* :mod:`.stages`: a schedule run for real across processes, measured.
"""
from .schedules import KINDS, bubble_formula, peak_in_flight, schedule, simulate
from .stages import make_batch, make_full_model, make_stage, measured_bubble, pipeline_worker

__all__ = ["KINDS", "schedule", "simulate", "bubble_formula", "peak_in_flight", "make_stage", "make_full_model",
           "make_batch", "pipeline_worker", "measured_bubble"]
