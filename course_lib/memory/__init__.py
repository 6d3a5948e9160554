"""How much memory training needs, predicted and measured (notebooks 06, 09, 10, 12, 13 and 14).

* :mod:`.arithmetic`: bytes of weights, gradients, optimizer states and activations per parameter, and
  what a model and its optimizer really hold.
* :mod:`.saved`: the activations a forward pass keeps for its backward, measured through autograd's hooks.
* :mod:`.activations`: those bytes derived term by term for the course's block and model (= measured),
  against Megatron's formula; :func:`.activations.held_bytes`, what a forward leaves allocated;
  :func:`.activations.split_block_worker`, what a block split across ranks keeps (notebook 12).
* :mod:`.fused`: the course's block with fused attention (SDPA): no scores saved, a logsumexp instead.
* :mod:`.timeline`: memory over one training step, forward and backward; chunked cross-entropy.
* :mod:`.recompute`: activation checkpointing, whole-layer and operator by operator: bytes held, FLOPs recomputed.
* :mod:`.accumulation`: gradient accumulation against a larger micro-batch (memory, time, ``no_sync``).
* :mod:`.planner`: the bytes-only calculator: which layouts (DDP, ZeRO, TP, recomputation) fit, at what traffic;
  :mod:`.verify` checks it against bytes measured on the course's transformer (notebook 17's planner, ranked
  by time, is :mod:`course_lib.layout`).
"""
from .arithmetic import (
                         DTYPE_BYTES,
                         OPTIMIZER_STATES,
                         ZERO_STAGES,
                         fits,
                         human,
                         measured_state_bytes,
                         mlp_activation_bytes,
                         training_memory,
)
from .saved import Saved, saved_bytes, saved_tensors

__all__ = ["DTYPE_BYTES", "OPTIMIZER_STATES", "ZERO_STAGES", "training_memory", "fits", "mlp_activation_bytes",
           "measured_state_bytes", "human", "Saved", "saved_tensors", "saved_bytes"]
