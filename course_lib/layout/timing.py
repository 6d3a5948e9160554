"""A training step's time under a layout, term by term, and the MFU it implies.

``step = compute + recompute + TP + CP + DP + PP p2p + bubble``, each a term of the returned dict:

* **compute**: the model FLOPs of the step (:meth:`.shapes.Model.flops_per_token` × the global batch's tokens),
  shared equally by the GPUs, at ``efficiency`` × the data sheet's peak. ``EFFICIENCY`` is an *assumption*,
  stated: large bf16 matrix products on an H100 run at roughly 70–80% of the dense peak, never at 100%. It is
  the one knob of the model, is not fitted to any table, and :func:`.mfu.measure_matmul_peak` measures the real
  figure on the machine at hand (on this CPU: the fp32 peak the notebook compares against).
* **recompute**: full recomputation runs every layer's forward again (a third of the layers' FLOPs).
* **TP**: sequence parallelism's two all-gathers and two reduce-scatters per layer in the forward, as many in the
  backward (four more when the forward is recomputed), each of one micro-batch's activations (``t·h`` bf16),
  priced as a ring (:func:`course_lib.comm.costmodel.predict`) on NVLink. All of it exposed: the next matrix
  product waits for it (notebook 11; Megatron's ``--tp-comm-overlap`` hides part of it: this is an upper bound).
* **CP**: ring attention's K/V blocks (:func:`course_lib.context_parallel.traffic.forward_bytes`; the backward
  sends ``(2W−1)/(W−1)`` times as much). The ring overlaps each transfer with a block's attention: only what the
  attention's own FLOPs cannot hide is exposed.
* **DP**: the gradients' reduction over the ``dp·cp`` GPUs that hold the same weights, on NVLink if they sit in
  one node, else on the network. Each collective overlaps the compute next to it, and only its excess shows:
  no ZeRO all-reduces once, under the last micro-batch's backward; ZeRO-1 reduce-scatters there and all-gathers
  the updated weights under the next step's first forward; ZeRO-2 must reduce-scatter after *every* micro-batch's
  backward (it keeps no whole gradient to accumulate into); ZeRO-3 also all-gathers the weights before every
  micro-batch's forward and again before its backward (FSDP2's default).
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
TERMS = ("compute", "recompute", "tp", "cp", "dp", "pp_p2p", "bubble")


def _collective(kind: str, nbytes: float, n: int, link: tuple[float, float]) -> float:
    return float(ring(kind, nbytes, n, *link)) if n > 1 else 0.0


def step_time(model: Model, cluster: Cluster, layout: Layout, efficiency: float = EFFICIENCY) -> dict:
    """Seconds of each term of the module docstring (``TERMS``), their sum ``"step"``, ``"mfu"``, the model and
    hardware FLOPs of the step, and the DP traffic before overlap (``"dp_total"``)."""
    g, m, pp, tp, cp = layout.gpus, layout.m, layout.pp, layout.tp, layout.cp
    tokens = layout.dp * m * layout.micro_batch * model.seq
    rate = cluster.peak_flops * efficiency
    model_flops = model.flops_per_token() * tokens
    layer_flops = (6 * model.layer_matrix_params() + 12 * model.hidden * model.seq) * model.layers * tokens
    compute = model_flops / g / rate
    recompute = layer_flops / 3 / g / rate if layout.recompute == "full" else 0.0
    fwd_mb, bwd_mb = compute / m / 3, (2 * compute / 3 + recompute) / m    # one micro-batch on one GPU
    layers = model.layers // pp                                            # a stage's layers

    t = layout.micro_batch * model.seq // cp                               # tokens of a micro-batch on a GPU
    act = t * model.hidden * D                                             # one activation, gathered over TP
    nvlink = cluster.link(True)
    per_layer = 4 + 4 + (4 if layout.recompute == "full" else 0)           # half all-gathers, half reduce-scatters
    tp_s = layers * m * per_layer / 2 * (_collective("all-gather", act, tp, nvlink)
                                         + _collective("reduce-scatter", act, tp, nvlink))

    cp_s = 0.0
    if cp > 1:
        link = cluster.link(inside_node(layout, "cp", cluster.gpus_per_node))
        kv = max(model.kv_heads // tp, 1)
        sent = forward_bytes("ring", layout.micro_batch, model.heads // tp, model.seq, model.head_dim, cp, D,
                             kv)["sent"]
        both = 1 + (2 * cp - 1) / (cp - 1)                                 # forward, then backward's share
        transfer = both * ((cp - 1) * link[0] + sent * link[1])
        attention = 12 * model.hidden * model.seq * t / tp / rate         # the layer's q·kᵀ and probs·v, fwd + bwd
        cp_s = layers * m * max(0.0, transfer - attention)

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
    bubble = (pp - 1) / m * (compute + recompute + tp_s + cp_s)
    out = {"compute": compute, "recompute": recompute, "tp": tp_s, "cp": cp_s, "dp": dp_s, "pp_p2p": pp_s,
           "bubble": bubble}
    out["step"] = sum(out.values())
    out.update(mfu=model_flops / (out["step"] * g * cluster.peak_flops), model_flops=model_flops,
               hardware_flops=model_flops + (layer_flops / 3 if layout.recompute == "full" else 0.0),
               dp_total=dp_total, tokens=tokens)
    return out
