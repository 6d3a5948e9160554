"""A training step's time under a layout, term by term, and the MFU it implies.

``step = compute + imbalance + recompute + TP + CP + DP + PP p2p + bubble``, each a term of the returned dict:

* **compute**: the model FLOPs of the step (:meth:`.shapes.Model.flops_per_token` × the global batch's tokens),
  shared equally by the GPUs, at ``efficiency`` × the data sheet's peak. ``EFFICIENCY`` is an *assumption*,
  stated: large bf16 matrix products on an H100 run at roughly 70–80% of the dense peak, never at 100%. It is
  the one knob of the model, is not fitted to any table, and :func:`.mfu.measure_matmul_peak` measures the real
  figure on the machine at hand (on this CPU: the fp32 peak the notebook compares against).
* **imbalance**: a pipeline runs at the pace of its slowest stage. Every stage holds ``layers/pp`` layers, but the
  last one also runs the LM head (``6·V·h`` FLOPs a token: 12% of Llama-3-8B's model FLOPs, for 4 layers of 32
  on PP 8 more than the 4 layers' own). The first stage's embedding is a lookup. The term is the slowest stage's
  compute minus the average GPU's (zero without a pipeline); the bubble scales with the slowest stage too.
* **recompute**: full recomputation runs every layer's forward again (a third of the layers' FLOPs).
* **TP**: sequence parallelism's two all-gathers and two reduce-scatters per layer in the forward, as many in the
  backward (four more when the forward is recomputed), each of one micro-batch's activations (``t·h`` bf16),
  priced as a ring (:func:`course_lib.comm.costmodel.predict`) on NVLink. All of it exposed: the next matrix
  product waits for it (notebook 11; Megatron's ``--tp-comm-overlap`` hides part of it: this is an upper bound).
  Under sequence parallelism each rank's norm-weight gradients cover only its positions (DTensor: ``Partial``);
  they are all-reduced over TP once a step, two small all-reduces a layer (:mod:`course_lib.composed.stages`:
  FSDP2 does it before its reduce-scatter), latency-bound and exposed.
* **CP**: ring attention's K/V blocks (:func:`course_lib.context_parallel.traffic.forward_bytes`; the backward
  sends ``(2W−1)/(W−1)`` times as much). The ring overlaps each of its ``W − 1`` transfers with one step's
  attention, and only what that step's FLOPs cannot hide is exposed. Under a causal mask a rank computes about
  half of its blocks' scores; with the zigzag split every step does the same work, ``1/W`` of the causal total
  (notebook 15). So a step hides its transfer behind ``2·h·s·t/(tp·W)`` FLOPs forward (twice that backward), not
  the unmasked ``4·h·s·t`` PaLM counts for the whole ring.
* **DP**: the gradients' reduction over the ``dp·cp`` GPUs that hold the same weights, on NVLink if they sit in
  one node, else on the network. Each collective overlaps the compute next to it, and only its excess shows:
  no ZeRO all-reduces once, under the last micro-batch's backward; ZeRO-1 reduce-scatters there and all-gathers
  the updated weights under the next step's first forward; ZeRO-2 must reduce-scatter after *every* micro-batch's
  backward (it keeps no whole gradient to accumulate into); ZeRO-3 also all-gathers the weights before every
  micro-batch's forward and again before its backward (FSDP2's default, ``reshard_after_forward=True``), with
  or without a pipeline: under PP that is ``m`` re-gathers of the stage's weights a step, the price of holding
  only a shard and three gathered layers (:mod:`.memory`).

  *Where the course's composed code differs.* :mod:`course_lib.composed.stages` shards with
  ``reshard_after_forward=False``, and ``torch.distributed.pipelining`` (torch 2.13, ``stage.py``) turns off
  FSDP2's gradient sync and its reshard-after-backward for every micro-batch, reducing once after the last. So
  that code gathers a stage's weights once a step and reduce-scatters once: ZeRO-1's traffic, but it holds the
  stage's whole bf16 weights and gradients through the step (ZeRO-0's bytes for them; only the optimizer's
  states and master weights stay sharded). The planner prices FSDP2's default instead, the memory-lean end;
  the composed code's choice is the time-lean end of the same ZeRO-3 (and the same holds for ZeRO-2 under
  ``torch.distributed.pipelining``: its gradients are reduced once, as ZeRO-1's).
* **PP p2p**: the activation (and its gradient) crossing each of the ``pp − 1`` stage boundaries once on the
  critical path of the warm-up and the cool-down; the steady state's sends overlap compute (asynchronous).
* **bubble**: 1F1B leaves each stage idle ``(pp − 1)/m`` of its busy time (notebook 07's formula).

**MFU** (model FLOPs utilisation, PaLM's definition) = model FLOPs of the step / (step time × GPUs × peak): the
share of the hardware's data-sheet rate spent on the model's own arithmetic. Recomputation lowers it (it takes
time but adds no model FLOPs); so does every exposed second of communication and bubble.
"""
from __future__ import annotations

from ..comm.costmodel import predict as ring
from ..context_parallel.traffic import forward_bytes
from .memory import D, params_on_gpu
from .shapes import Cluster, Model
from .space import Layout, inside_node

EFFICIENCY = 0.75   # assumed share of the dense bf16 peak that large matrix products sustain (module docstring)
TERMS = ("compute", "imbalance", "recompute", "tp", "cp", "dp", "pp_p2p", "bubble")


def _collective(kind: str, nbytes: float, n: int, link: tuple[float, float]) -> float:
    return float(ring(kind, nbytes, n, *link)) if n > 1 else 0.0


def stage_flops(model: Model, layout: Layout, stage: int) -> float:
    """Model FLOPs one GPU of pipeline ``stage`` does for one micro-batch (forward and backward): its
    ``layers/pp`` layers, and on the last stage the LM head (``6·V·h`` a token; the first stage's embedding is
    a lookup, no FLOPs), its share of ``tp·cp``."""
    per_token = model.layers // layout.pp * (6 * model.layer_matrix_params() + 12 * model.hidden * model.seq)
    per_token += 6 * model.vocab * model.hidden if stage == layout.pp - 1 else 0
    return per_token * layout.micro_batch * model.seq / (layout.tp * layout.cp)


def step_time(model: Model, cluster: Cluster, layout: Layout, efficiency: float = EFFICIENCY) -> dict:
    """Seconds of each term of the module docstring (``TERMS``), their sum ``"step"``, ``"mfu"``, the model and
    hardware FLOPs of the step, the DP traffic before overlap (``"dp_total"``) and ``"slowest_stage"``."""
    g, m, pp, tp, cp = layout.gpus, layout.m, layout.pp, layout.tp, layout.cp
    tokens = layout.dp * m * layout.micro_batch * model.seq
    rate = cluster.peak_flops * efficiency
    model_flops = model.flops_per_token() * tokens
    layer_flops = (6 * model.layer_matrix_params() + 12 * model.hidden * model.seq) * model.layers * tokens
    compute = model_flops / g / rate                                       # the average GPU
    per_stage = [stage_flops(model, layout, s) for s in (0, pp - 1)]       # middle stages: as the first
    slowest = max(range(len(per_stage)), key=per_stage.__getitem__)
    imbalance = m * per_stage[slowest] / rate - compute                    # the slowest stage's extra seconds
    recompute = layer_flops / 3 / g / rate if layout.recompute == "full" else 0.0
    fwd_mb = per_stage[slowest] / 3 / rate                                 # one micro-batch on the slowest GPU
    bwd_mb = 2 * per_stage[slowest] / 3 / rate + recompute / m
    layers = model.layers // pp                                            # a stage's layers

    t = layout.micro_batch * model.seq // cp                               # tokens of a micro-batch on a GPU
    act = t * model.hidden * D                                             # one activation, gathered over TP
    nvlink = cluster.link(True)
    per_layer = 4 + 4 + (4 if layout.recompute == "full" else 0)           # half all-gathers, half reduce-scatters
    tp_s = layers * m * per_layer / 2 * (_collective("all-gather", act, tp, nvlink)
                                         + _collective("reduce-scatter", act, tp, nvlink))
    tp_s += layers * 2 * _collective("ring", model.hidden * D, tp, nvlink)   # SP norms' gradients, once

    cp_s = 0.0
    if cp > 1:
        link = cluster.link(inside_node(layout, "cp", cluster.gpus_per_node))
        kv = max(model.kv_heads // tp, 1)
        sent = forward_bytes("ring", layout.micro_batch, model.heads // tp, model.seq, model.head_dim, cp, D,
                             kv)["sent"]
        step_f = link[0] + sent / (cp - 1) * link[1]                      # one ring step's K/V block, forward
        step_b = (2 * cp - 1) / (cp - 1) * step_f                          # the backward's (module docstring)
        # causal q·kᵀ and probs·v: half of PaLM's 4·h·s a token forward (8·h·s backward), in cp equal steps
        attn_f = 2 * model.hidden * model.seq * t / tp / rate / cp
        cp_s = layers * m * (cp - 1) * (max(0.0, step_f - attn_f) + max(0.0, step_b - 2 * attn_f))

    n = layout.dp * cp
    link = cluster.link(inside_node(layout, "dp", cluster.gpus_per_node))
    grads = params_on_gpu(model, layout, 0) * D
    rs, ag = _collective("reduce-scatter", grads, n, link), _collective("all-gather", grads, n, link)
    over = lambda busy, hidden: max(0.0, busy - hidden)                    # noqa: E731  what the overlap leaves
    if layout.zero == 0:
        dp_s, dp_total = over(rs + ag, bwd_mb), rs + ag                    # a ring all-reduce = RS + AG
    elif layout.zero == 1:
        dp_s, dp_total = over(rs, bwd_mb) + over(ag, fwd_mb), rs + ag
    elif layout.zero == 2:
        dp_s, dp_total = m * over(rs, bwd_mb) + over(ag, fwd_mb), m * rs + ag
    else:
        dp_s, dp_total = m * (over(ag, fwd_mb) + over(ag + rs, bwd_mb)), m * (2 * ag + rs)

    pp_s = 0.0
    if pp > 1:
        a, b = cluster.link(inside_node(layout, "pp", cluster.gpus_per_node))
        pp_s = 2 * (pp - 1) * (a + act / tp * b)
    bubble = (pp - 1) / m * (compute + imbalance + recompute + tp_s + cp_s)
    out = {"compute": compute, "imbalance": imbalance, "recompute": recompute, "tp": tp_s, "cp": cp_s, "dp": dp_s,
           "pp_p2p": pp_s, "bubble": bubble}
    out["step"] = sum(out.values())
    out.update(mfu=model_flops / (out["step"] * g * cluster.peak_flops), model_flops=model_flops,
               hardware_flops=model_flops + (layer_flops / 3 if layout.recompute == "full" else 0.0),
               dp_total=dp_total, tokens=tokens, slowest_stage=(0, pp - 1)[slowest])
    return out
