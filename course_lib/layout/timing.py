"""A training step's time under a layout, term by term, and the MFU it implies.

``step = compute + imbalance + recompute + elementwise + TP + CP + DP + optimizer + PP p2p + bubble``, each a
term of the returned dict:

* **compute**: the model FLOPs of the step (:meth:`.shapes.Model.flops_per_token` × the global batch's tokens),
  shared equally by the GPUs, at ``efficiency`` × the data sheet's peak. ``EFFICIENCY`` is an *assumption*,
  stated: large bf16 matrix products on an H100 run at roughly 70–80% of the dense peak, never at 100%. It is
  the one knob of the model, is not fitted to any table, and :func:`.mfu.measure_matmul_peak` measures the real
  figure on the machine at hand (on this CPU: the fp32 peak the notebook compares against). A product too small
  to be compute-bound runs slower: :func:`gemm_efficiency` prices each of a layer's products on the roofline
  (its FLOPs at ``efficiency·peak`` or its bytes at the HBM bandwidth, whichever is longer, both data-sheet
  figures) and lowers the rate by the FLOP-weighted share (1.0 × ``efficiency`` for every preset here; a 64-wide
  toy's products are memory-bound). Not modelled: wave quantisation and tile effects (stated, not fitted).
* **imbalance**: a pipeline runs at the pace of its slowest stage. Every stage holds ``layers/pp`` layers, but the
  last one also runs the LM head (``6·V·h`` FLOPs a token: 6% of Llama-3-8B's model FLOPs, but on PP 8 the last
  stage's 4 layers and the head do 1.5 times another stage's work). The first stage's embedding is a lookup.
  The term is the slowest stage's compute minus the average GPU's (zero without a pipeline); the bubble scales
  with the slowest stage too.
* **elementwise**: the memory-bound work between the products (norms, residual adds, SwiGLU's product, rotary,
  the fp32 logits), :func:`elementwise_bytes` at the HBM bandwidth; nothing overlaps it (it is on the GPU's
  critical path, like the products).
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
  the unmasked ``4·h·s·t`` PaLM counts for the whole ring, priced on the roofline like the products (its FLOPs
  at ``efficiency·peak`` or its tile's q, output and K/V bytes at HBM speed: FlashAttention reads no scores).
  Each ring step also pays what no transfer hides: :data:`CP_STEP_LAUNCH` twice (its kernels and its
  send/receive launched and synchronised, forward and backward: an assumption, stated) and the online-softmax
  merge of its partial result into the running one, memory-bound (fp32 output and logsumexp read and written
  forward; dQ accumulated and the dK, dV block received, added and passed on backward).

  *The overlap rule, the same for every group*: a transfer hides only under compute that does not need it. The
  ring's next K/V block does not feed the current step's attention, so it overlaps; TP's all-gather feeds the
  very next product, and DP's gradient reduction overlaps the backward of the layers still to come, less one
  layer (below). That is why TP is priced exposed and CP's transfer is not: not a different assumption, a
  different dependence.
* **DP**: the gradients' reduction over the ``dp·cp`` GPUs that hold the same weights, on NVLink if they sit in
  one node, else on the network, in fp32 (:data:`.memory.FP32_GRADS`: 4 bytes a parameter; the weights' gathers
  move bf16). Each collective overlaps the compute next to it, and only its excess shows:
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

  *Overlap is never complete*: the last layer's gradients to be reduced (the first layer's, computed last) have
  no backward left beside them, and the first layer's gathered weights are needed before any forward: one
  layer's reduction (and gather) is always exposed (``over``'s ``tail``).
* **optimizer**: the optimizer's step after the last reduction, memory-bound: :data:`ADAM_BYTES` = 28 bytes
  moved for each parameter this GPU updates (its ZeRO shard from stage 1 on), 30 when the gradient it reads is
  fp32, at the HBM bandwidth (3.35 TB/s).
* **PP p2p**: the activation (and its gradient) crossing each of the ``pp − 1`` stage boundaries once on the
  critical path of the warm-up and the cool-down, each paying the link's latency α; the steady state's sends
  overlap compute (asynchronous).
* **bubble**: 1F1B leaves each stage idle ``(pp − 1)/m`` of its busy time (notebook 07's formula).

**MFU** (model FLOPs utilisation, PaLM's definition) = model FLOPs of the step / (step time × GPUs × peak): the
share of the hardware's data-sheet rate spent on the model's own arithmetic. Recomputation lowers it (it takes
time but adds no model FLOPs); so does every exposed second of communication and bubble.
"""
from __future__ import annotations

from functools import lru_cache

from ..comm.costmodel import predict as ring
from ..context_parallel.traffic import forward_bytes
from .memory import FP32_GRADS, STAT, D, layer_params_on_gpu, params_on_gpu
from .shapes import Cluster, Model
from .space import Layout, inside_node

EFFICIENCY = 0.75   # assumed share of the dense bf16 peak that large matrix products sustain (module docstring)
TERMS = ("compute", "imbalance", "recompute", "elementwise", "tp", "cp", "dp", "optimizer", "pp_p2p", "bubble")
CP_STEP_LAUNCH = 10e-6   # seconds a ring step's kernels and send/receive take to launch and sync, forward or backward:
                         # an assumption (a few kernels at ~3-5 µs each), stated, not fitted
ADAM_BYTES = 28     # a parameter's optimizer step: read the bf16 gradient (2), read + write fp32 master, m, v
                    # (24), write the bf16 weight (2): fused Adam, memory-bound; 2 more to read an fp32 gradient


def gemms(model: Model, layout: Layout, head: bool = True) -> list[tuple[int, int, int]]:
    """``(T, K, N)`` of each matrix product of one layer (and the LM head) for one micro-batch on one GPU:
    ``T = micro_batch·seq/cp`` tokens times a ``K × N`` weight, cut ``tp`` ways."""
    h, f, tp = model.hidden, model.ffn, layout.tp
    t = layout.micro_batch * model.seq // layout.cp
    kv = model.head_dim * max(model.kv_heads // tp, 1)
    out = [(t, h, h // tp), (t, h, kv), (t, h, kv), (t, h // tp, h), (t, h, f // tp), (t, h, f // tp),
           (t, f // tp, h)]
    return out + ([(t, h, -(-model.vocab // tp))] if head else [])


def gemm_efficiency(model: Model, cluster: Cluster, layout: Layout, efficiency: float = EFFICIENCY) -> float:
    """The share of the peak the layout's matrix products sustain: ``efficiency`` for a large product, less
    where a product is too small to be compute-bound. Each product of :func:`gemms` takes the longer of its
    FLOPs at ``efficiency·peak`` and its bytes (``2·(T·K + K·N + T·N)`` bf16) at the HBM bandwidth (the
    roofline, from the data sheet's two figures); the result is the FLOP-weighted share."""
    return _gemm_efficiency(model, cluster, layout.tp, layout.cp, layout.micro_batch, efficiency)


@lru_cache(maxsize=4096)
def _gemm_efficiency(model: Model, cluster: Cluster, tp: int, cp: int, micro_batch: int, efficiency: float) -> float:
    layout = Layout(1, tp, 1, cp, 0, "none", micro_batch, 1)
    rate = cluster.peak_flops * efficiency
    flops = sum(2 * t * k * n for t, k, n in gemms(model, layout))
    seconds = sum(max(2 * t * k * n / rate, 2 * (t * k + k * n + t * n) / cluster.hbm_bandwidth)
                  for t, k, n in gemms(model, layout))
    return efficiency * flops / rate / seconds


def elementwise_bytes(model: Model, layout: Layout) -> float:
    """HBM bytes a token's element-wise work moves in one layer on one GPU, forward and backward (three times
    the forward's): two RMSNorms (read and write ``h``), two residual adds (read ``2h``, write ``h``), SwiGLU's
    ``silu(gate)·up`` (read ``2f``, write ``f``), rotary on q and k (read and write ``h + kv_dim``), bf16, cut
    ``tp`` ways by sequence and tensor parallelism."""
    h, f = model.hidden, model.ffn
    forward = (2 * 2 * h + 2 * 3 * h + 3 * f + 2 * (h + model.kv_dim)) * D
    return 3 * forward / layout.tp


@lru_cache(maxsize=65536)
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
    rate = cluster.peak_flops * gemm_efficiency(model, cluster, layout, efficiency)
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
    logits = 3 * 2 * -(-model.vocab // tp) * STAT                          # fp32 logits: write, softmax, grad
    elementwise = m * t * (layers * elementwise_bytes(model, layout) + logits) / cluster.hbm_bandwidth
    fwd_mb += elementwise / m / 3
    bwd_mb += 2 * elementwise / m / 3

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
        # on the roofline, like the matrix products: a step's FLOPs at efficiency·peak or its tile's bytes (q and
        # the output, the K/V block: FlashAttention reads no s² scores) at HBM speed, whichever is longer
        attn_flops = 2 * model.hidden * model.seq * t / tp / cp
        tile_bytes = (2 * t * model.hidden // tp + 2 * (model.seq // cp) * kv * model.head_dim) * D
        attn_f = max(attn_flops / (efficiency * cluster.peak_flops), tile_bytes / cluster.hbm_bandwidth)
        # what no transfer hides, each ring step: its kernels' launches and the online-softmax merge of its partial
        # output into the running one (fp32 output and logsumexp read and written, forward; dQ accumulated and the
        # dK, dV block received, added and passed on, backward), memory-bound on the compute stream
        merge_f = 3 * t * (model.hidden // tp) * STAT / cluster.hbm_bandwidth
        merge_b = 2 * merge_f + 3 * 2 * t * kv * model.head_dim * STAT / cluster.hbm_bandwidth
        fixed = 2 * CP_STEP_LAUNCH + merge_f + merge_b
        cp_s = layers * m * (cp - 1) * (max(0.0, step_f - attn_f) + max(0.0, step_b - 2 * attn_f) + fixed)

    n = layout.dp * cp
    link = cluster.link(inside_node(layout, "dp", cluster.gpus_per_node))
    held0 = params_on_gpu(model, layout, 0)
    g_bytes = 4 if FP32_GRADS else D                                       # gradients reduced in fp32 (memory)
    rs = _collective("reduce-scatter", held0 * g_bytes, n, link)
    ag = _collective("all-gather", held0 * D, n, link)                     # bf16 weights (ZeRO 1-3)
    ag_g = _collective("all-gather", held0 * g_bytes, n, link)             # an all-reduce's second half (ZeRO 0)
    bucket = min(layer_params_on_gpu(model, tp), held0)                    # one layer: the last to be reduced
    rs_tail = _collective("reduce-scatter", bucket * g_bytes, n, link)
    ag_tail = _collective("all-gather", bucket * D, n, link)
    ag_g_tail = _collective("all-gather", bucket * g_bytes, n, link)

    def over(busy, hidden, tail):
        """What the overlap leaves: the excess over the compute beside it, and at least the ``tail`` (the last
        bucket's reduction, the first layer's gather) that has no compute left beside it."""
        return max(busy - hidden, min(busy, tail), 0.0)
    if layout.zero == 0:
        dp_s, dp_total = over(rs + ag_g, bwd_mb, rs_tail + ag_g_tail), rs + ag_g  # a ring all-reduce = RS + AG
    elif layout.zero == 1:
        dp_s, dp_total = over(rs, bwd_mb, rs_tail) + over(ag, fwd_mb, ag_tail), rs + ag
    elif layout.zero == 2:
        dp_s, dp_total = (m - 1) * over(rs, bwd_mb, 0) + over(rs, bwd_mb, rs_tail) + over(ag, fwd_mb, ag_tail), \
            m * rs + ag
    else:
        dp_s = (m - 1) * (over(ag, fwd_mb, 0) + over(ag + rs, bwd_mb, 0)) + over(ag, fwd_mb, ag_tail) \
            + over(ag + rs, bwd_mb, rs_tail)
        dp_total = m * (2 * ag + rs)
    held = max(params_on_gpu(model, layout, 0), params_on_gpu(model, layout, pp - 1))
    optimizer = held / (n if layout.zero >= 1 else 1) * (ADAM_BYTES + (2 if FP32_GRADS else 0)) / cluster.hbm_bandwidth

    pp_s = 0.0
    if pp > 1:
        a, b = cluster.link(inside_node(layout, "pp", cluster.gpus_per_node))
        pp_s = 2 * (pp - 1) * (a + act / tp * b)
    bubble = (pp - 1) / m * (compute + imbalance + recompute + elementwise + tp_s + cp_s)
    out = {"compute": compute, "imbalance": imbalance, "recompute": recompute, "elementwise": elementwise,
           "tp": tp_s, "cp": cp_s, "dp": dp_s, "optimizer": optimizer, "pp_p2p": pp_s, "bubble": bubble}
    out["step"] = sum(out.values())
    out.update(mfu=model_flops / (out["step"] * g * cluster.peak_flops), model_flops=model_flops,
               hardware_flops=model_flops + (layer_flops / 3 if layout.recompute == "full" else 0.0),
               dp_total=dp_total, tokens=tokens, slowest_stage=(0, pp - 1)[slowest],
               gemm_efficiency=rate / cluster.peak_flops)
    return out
