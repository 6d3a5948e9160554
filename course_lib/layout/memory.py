"""Bytes one GPU holds under a layout: the model's states, the activations in flight, and the transient buffers.

**States** (bf16 training with Adam, notebook 14's 16 bytes a parameter): 2 for the bf16 weight, 2 for its
gradient, 8 for Adam's two fp32 moments, 4 for the fp32 master copy (:func:`course_lib.memory.arithmetic.
training_memory`). A GPU holds its pipeline stage's layers (``layers / pp``), each matrix cut ``tp`` ways (the
RMSNorm weights are whole on every TP rank), the vocabulary-parallel embedding on the first stage and the LM
head on the last. ZeRO then shards over the ``dp·cp`` GPUs that hold the same weights: stage 1 the optimizer
states and master weights, stage 2 the gradients too, stage 3 the weights too.

**Activations** of one layer and one micro-batch of ``t = micro_batch·seq/cp`` tokens, in bf16 (``d = 2``), with
sequence parallelism, so every term is cut ``tp`` ways but one (Korthikanti et al. 2022's ``sbh·34/t`` has the
same form). The exception is the norms' outputs: sequence parallelism all-gathers each over the TP group before
the column-parallel products, and DTensor (``PrepareModuleInput``, what :mod:`course_lib.composed.stages` runs)
saves the gathered tensor for their backward, whole on every rank. Megatron-LM instead keeps its own slice and
gathers it again in the backward: ``2·t·h·d·(1 − 1/tp)`` bytes less a layer, two more all-gathers a layer (the
planner's TP term counts DTensor's four and four):

=================================  ==========================  ============================================
saved tensor                       bytes                       saved by
=================================  ==========================  ============================================
the two RMSNorms' inputs           ``2·t·h·d``                 the norms (and the residual stream)
the two norms' 1/rms               ``2·t·4``                   the norms (fp32)
the two norms' outputs, gathered   ``2·t·h·d`` (not cut)       q, k, v (one storage); gate, up (one)
q, k, v                            ``t·(h + 2·kv_dim)·d``      the attention
attention output                   ``t·h·d``                   o (and the fused kernel's backward)
fused: logsumexp                   ``t·heads·4``               FlashAttention / SDPA: no s² scores
eager: softmax output              ``b·heads·(s/cp)·s·d``      softmax and probs·v: the s² term
eager: causal mask                 ``(s/cp)·s`` (bool)         masked_fill (one per layer, not per sequence)
SwiGLU: gate, up, silu(gate), gxu  ``4·t·f·d``                 silu, the product, down
=================================  ==========================  ============================================

With fewer key/value heads than TP ranks each rank keeps one. Eager attention repeats k and v to all the query
heads before its products, as :mod:`.reference` and Hugging Face's ``repeat_kv`` do, and saves the repeated
copies: its q, k, v row is ``3·t·h·d``. The norms are priced as a fused RMSNorm kernel (Apex, Transformer
Engine, Liger, ``torch.compile``): it saves its input and 1/rms. PyTorch's plain ``nn.RMSNorm`` in bf16 computes
in fp32 and saves fp32 copies, 6·t·h bytes more a norm (``norm="composite"``).

**Checked against measurement** (``tests/test_layout.py``): the bytes autograd saves for one block of
:mod:`.reference` on the CPU in bf16, counted by storage with ``saved_tensors_hooks``
(:mod:`course_lib.memory.saved`), equal ``layer_activation_bytes(..., norm="composite")`` to the byte, fused
and eager, one and two sequences.

**The last stage** adds the final norm's input and output and the logits in fp32 for the loss (``t·vocab·4``).
It follows :func:`.reference.tp_plan` (Megatron's): the LM head is vocabulary-parallel, its logits cut ``tp``
ways. The composed code's small model keeps its final norm and head whole on every TP rank
(:mod:`course_lib.composed.stages`: it gathers the sequence before the final norm); the planner does not price
that variant.

**How many micro-batches are in flight.** Under 1F1B, stage ``s`` of ``pp`` runs ``pp − s`` forwards before its
first backward: the first stage holds ``min(pp, m)`` micro-batches' activations, the last one (notebook 07).
Without a pipeline, gradient accumulation frees each micro-batch's activations in its backward: one at a time.
**Full recomputation** keeps only each layer's input and rebuilds one layer at a time in the backward.
**Gradients in fp32** (:data:`FP32_GRADS`, on by default): Megatron-LM accumulates every micro-batch's gradient
into an fp32 ``main_grad`` and reduces it in fp32; torchtitan's FSDP2 reduces in fp32
(``MixedPrecisionPolicy(reduce_dtype=torch.float32)``). So a GPU holds 2 bytes a parameter more than bf16
gradients for the whole gradient (ZeRO 0–1), for its shard (ZeRO-2), and nothing more under ZeRO-3 (FSDP2's fp32
gradient shard belongs to its fp32 master shard, and no separate bf16 weight shard is kept: 16 bytes either way).
**Transient buffers**: ZeRO-3 holds two gathered layers (the one computing and the one FSDP2 prefetches) and one
layer's unsharded gradients before their reduce-scatter (in fp32). What is left out (the allocator's
fragmentation, NCCL's buffers, the CUDA context: a few GiB) is why a layout fits only in 90% of the GPU
(``arithmetic.fits``).
"""
from __future__ import annotations

from ..memory.arithmetic import training_memory
from .shapes import Model
from .space import Layout

D = 2            # bytes of a bf16 activation, weight or gradient
FP32_GRADS = True   # gradients accumulated and reduced in fp32 (module docstring): Megatron's main_grad,
                    # torchtitan's MixedPrecisionPolicy(reduce_dtype=float32)
STAT = 4         # bytes of an fp32 statistic (RMSNorm's 1/rms, attention's logsumexp, the loss's logits)
NORMS = ("fused", "composite")


def _kv_heads_local(model: Model, tp: int) -> int:
    return max(model.kv_heads // tp, 1)


def layer_params_on_gpu(model: Model, tp: int) -> int:
    """One layer's parameters on one of ``tp`` ranks: q, o and the MLP cut ``tp`` ways, k and v cut by key/value
    heads (at least one head each), the two norm weights whole."""
    h, f = model.hidden, model.ffn
    return (2 * h * h + 3 * h * f) // tp + 2 * h * model.head_dim * _kv_heads_local(model, tp) + 2 * h


def params_on_gpu(model: Model, layout: Layout, stage: int = 0) -> int:
    """Parameters one GPU of pipeline ``stage`` holds before ZeRO shards them."""
    p = model.layers // layout.pp * layer_params_on_gpu(model, layout.tp)
    head = -(-model.vocab // layout.tp) * model.hidden
    p += head if stage == 0 else 0                                      # the embedding
    p += head + model.hidden if stage == layout.pp - 1 else 0           # the LM head and the final norm
    return p


def layer_activation_bytes(model: Model, layout: Layout, norm: str = "fused") -> dict:
    """The table of the module docstring: bytes one layer saves for one micro-batch on one GPU, and ``"total"``.

    ``norm="composite"``: PyTorch's own ``nn.RMSNorm`` on bf16 (no fused kernel: it computes in fp32 and saves
    the fp32 input and the fp32 normalised tensor, 8·t·h bytes a norm instead of a fused kernel's 2·t·h), what
    :mod:`.reference` runs on the CPU and what the measurement in the tests sees."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    h, f, tp, d = model.hidden, model.ffn, layout.tp, D
    s_local = model.seq // layout.cp
    t = layout.micro_batch * s_local
    eager = model.attention == "eager"
    kv = 2 * model.head_dim * (model.heads // tp if eager else _kv_heads_local(model, tp))
    composite = norm == "composite"
    parts = {"norm inputs": 2 * t * h * (STAT if composite else d) // tp, "norm 1/rms": 2 * t * STAT // tp,
             "norm fp32 outputs (composite)": 2 * t * h * STAT // tp if composite else 0,
             "norm outputs": 2 * t * h * d, "q, k, v": t * (h // tp + kv) * d,
             "attention output": t * h * d // tp,
             "logsumexp (fused)": t * model.heads // tp * STAT if not eager else 0,
             "scores (eager)": layout.micro_batch * model.heads // tp * s_local * model.seq * d if eager else 0,
             "mask (eager)": s_local * model.seq if eager else 0,
             "SwiGLU": 4 * t * f * d // tp}
    parts["total"] = sum(parts.values())
    return parts


def activation_bytes(model: Model, layout: Layout, stage: int = 0) -> dict:
    """Activations one GPU of pipeline ``stage`` holds at its peak: ``"layers"``, ``"recompute buffer"`` (the
    layer rebuilt in the backward), ``"loss"`` (the last stage's final norm and logits) and ``"total"``."""
    t = layout.micro_batch * model.seq // layout.cp
    in_flight = min(layout.pp - stage, layout.m)
    layers = model.layers // layout.pp
    one_layer = layer_activation_bytes(model, layout)["total"]
    if layout.recompute == "full":
        kept, rebuilt = in_flight * layers * t * model.hidden * D // layout.tp, one_layer
    else:
        kept, rebuilt = in_flight * layers * one_layer, 0
    loss = 0
    if stage == layout.pp - 1:
        loss = 2 * t * model.hidden * D // layout.tp + t * -(-model.vocab // layout.tp) * STAT
    parts = {"layers": kept, "recompute buffer": rebuilt, "loss": loss}
    parts["total"] = sum(parts.values())
    return parts


def stage_memory(model: Model, layout: Layout, stage: int = 0) -> dict:
    """Bytes one GPU of pipeline ``stage`` holds, by part (``arithmetic.training_memory``'s names, then the
    activations' parts, the ZeRO-3 buffers) and ``"total"``."""
    acts = activation_bytes(model, layout, stage)
    mem = training_memory(params_on_gpu(model, layout, stage), "bf16", "adam", acts["total"],
                          zero_stage=layout.zero, world_size=layout.dp * layout.cp)
    params, n = params_on_gpu(model, layout, stage), layout.dp * layout.cp
    layer = layer_params_on_gpu(model, layout.tp) * D
    zero3 = layout.zero == 3 and n > 1
    # two gathered layers and one layer's unsharded gradients (fp32 for the reduction: 2 bytes more a value)
    mem["ZeRO-3 gathered layers"] = (3 * layer + (layer if FP32_GRADS else 0)) if zero3 else 0
    # fp32 gradient accumulation: 2 bytes a parameter over the bf16 gradient counted above, on the whole
    # gradient (ZeRO 0-1) or its shard (ZeRO-2); ZeRO-3's fp32 shard is the gradient of FSDP2's fp32 master
    # shard, whose bf16 copy it does not keep: the 16 bytes a parameter already counted
    extra = 2 * params if layout.zero <= 1 else -(-2 * params // n) if layout.zero == 2 else 0
    mem["fp32 gradient accumulation"] = extra if FP32_GRADS else 0
    mem["total"] += mem["ZeRO-3 gathered layers"] + mem["fp32 gradient accumulation"]
    mem["activation parts"] = acts
    return mem


def memory_per_gpu(model: Model, layout: Layout) -> dict:
    """The fullest GPU's bytes: the first pipeline stage (most micro-batches in flight, the embedding) or the last
    (the LM head, the logits), whichever holds more; ``"stage"`` says which."""
    first = stage_memory(model, layout, 0)
    last = stage_memory(model, layout, layout.pp - 1)
    worst, stage = (first, 0) if first["total"] >= last["total"] else (last, layout.pp - 1)
    return {**worst, "stage": stage}
