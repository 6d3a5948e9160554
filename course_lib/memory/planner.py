"""The bytes-only calculator: which layouts fit a model on a set of GPUs, and what each costs in communication.

Notebook 17 chooses layouts with :mod:`course_lib.layout` instead, which adds pipeline and context parallelism and
ranks by predicted step time. This module stays for :mod:`.verify`, which checks its bytes against those measured
on the course's small transformer (``tests/test_planner.py``).

For a model shape (a :class:`~course_lib.models.TransformerConfig`: layers, width, heads, vocabulary, MLP
width), a sequence length, a micro-batch per GPU, a number of GPUs and their memory, :func:`plan` tries every
layout the course built: data parallelism with ZeRO stage 0 (DDP), 1, 2 or 3 (notebook 09), a tensor-parallel
degree t (notebook 11; the other GPUs / t do data parallelism), with or without whole-layer recomputation
(notebook 13), and says for each the bytes every GPU holds, whether they fit, the bytes every GPU sends per
step and the extra compute. It does not rank layouts by cost: that needs seconds, not bytes (notebook 17).
Attention is fused by default (``attention="fused"``: FlashAttention / SDPA, no ``s²`` scores, what training
stacks run); ``"eager"`` is Korthikanti et al.'s case, the scores stored.

Everything is assembled from the pieces the notebooks measured:

* weights, gradients, optimizer states and master weights per GPU: :func:`.arithmetic.training_memory`
  (with ZeRO's 1/N), over the parameters a tensor-parallel rank holds (:func:`param_count`);
* activations: :func:`.activations.model_activation_bytes` (measured = derived, notebook 13), split by ``t``;
  whole-layer recomputation keeps one ``b·s·h`` input per layer and rebuilds one layer at a time in backward;
  ZeRO-3 also holds one gathered layer;
* communication: the collectives of one step, each priced as a ring (:func:`course_lib.comm.costmodel.
  ring_steps_and_bytes`): DDP all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the
  weights (the same bytes); ZeRO-3 all-gathers the weights twice (forward, backward); tensor parallelism
  all-reduces one activation four times per layer (:func:`course_lib.tensor_parallel.cost.layer_collectives`),
  five with recomputation: the forward runs again, but PyTorch's non-reentrant checkpoint stops it as soon as
  the last tensor backward needs is rebuilt (the MLP's ``down`` input), so the ``down`` matrix product and the
  all-reduce after it are not repeated (notebooks 13 and 14 count them). Data-parallel traffic overlaps the backward;
  tensor-parallel traffic sits on the critical path (notebook 11).

What it leaves out, and says so: temporary buffers (activation gradients, the allocator's fragmentation: hence
``fits`` keeps 10% spare), the CUDA context, pipeline parallelism, and operator-level recomputation (notebook 13
measures it between the two). Activations are counted in the training precision on a GPU (16-bit values,
fp32 LayerNorm statistics, 1-byte dropout masks); autocast's real activations are somewhat larger (notebook 13).
"""
from __future__ import annotations

from ..models.transformer import TransformerConfig
from .activations import block_activation_bytes, model_activation_bytes
from .arithmetic import DTYPE_BYTES, ZERO_STAGES, fits, training_memory

RECOMPUTE = ("none", "full")

PRESETS = {   # GPT-style shapes (MLP 4x wide, learned positions, untied head): parameters from param_count
    "course transformer (0.1 M)": TransformerConfig(),
    "GPT-2 small shape (124 M)": TransformerConfig(vocab=50257, seq_len=1024, dim=768, heads=12, layers=12,
                                                   hidden=3072),
    "1.3 B (24 x 2048)": TransformerConfig(vocab=50257, seq_len=2048, dim=2048, heads=16, layers=24, hidden=8192),
    "6.7 B (32 x 4096)": TransformerConfig(vocab=50257, seq_len=2048, dim=4096, heads=32, layers=32, hidden=16384),
    "13 B (40 x 5120)": TransformerConfig(vocab=50257, seq_len=2048, dim=5120, heads=40, layers=40, hidden=20480),
    "70 B (80 x 8192)": TransformerConfig(vocab=50257, seq_len=4096, dim=8192, heads=64, layers=80, hidden=32768),
}


def block_params(cfg: TransformerConfig, tp: int = 1) -> int:
    """Parameters of one block on one of ``tp`` tensor-parallel ranks (notebook 11's split): the Linear
    weights and the column-parallel biases (``q``, ``v``, ``up``; ``k`` has none) are cut ``tp`` ways; the
    row-parallel biases (``out``, ``down``) and the LayerNorms are whole on every rank."""
    h, f = cfg.dim, cfg.hidden
    weights = (4 * h * h + 2 * h * f) // tp
    biases = ((2 * h + f) // tp + 2 * h) if cfg.bias else 0
    return weights + biases + 4 * h


def param_count(cfg: TransformerConfig, tp: int = 1) -> int:
    """Parameters one tensor-parallel rank holds: the split blocks, and the embeddings, final LayerNorm and LM
    head whole."""
    return cfg.layers * block_params(cfg, tp) + cfg.vocab * cfg.dim + cfg.seq_len * cfg.dim + 2 * cfg.dim \
        + cfg.dim * cfg.vocab


def collectives(cfg: TransformerConfig, seq: int, batch: int, tp: int = 1, dp: int = 1, zero: int = 0,
                recompute: str = "none", dtype: str = "bf16") -> list[tuple[str, str, int, int]]:
    """The collectives of one training step on one GPU: ``(group, kind, bytes of the whole tensor, count)``,
    ``group`` being ``"data"`` (over ``dp`` ranks) or ``"tensor"`` (over ``tp``)."""
    from ..tensor_parallel.cost import layer_collectives
    d = DTYPE_BYTES[dtype]
    p = param_count(cfg, tp) * d                  # gradients and gathered weights travel in the model's precision
    out = []
    if dp > 1:
        if zero == 0:
            out.append(("data", "all-reduce", p, 1))
        elif zero in (1, 2):
            out += [("data", "reduce-scatter", p, 1), ("data", "all-gather", p, 1)]
        else:
            out += [("data", "all-gather", p, 2), ("data", "reduce-scatter", p, 1)]
    if tp > 1:
        per_layer = layer_collectives(batch, seq, cfg.dim, d)
        forward_again = [c for c in per_layer if c[2] == "forward"][:1] if recompute == "full" else []
        for kind, nbytes, _ in per_layer + forward_again:
            out.append(("tensor", kind, nbytes, cfg.layers))
    return out


def predict(cfg: TransformerConfig, seq: int, batch: int, tp: int = 1, dp: int = 1, zero: int = 0,
            recompute: str = "none", dtype: str = "bf16", optimizer: str = "adam", device: str = "cuda",
            attention: str = "fused") -> dict:
    """Bytes one GPU holds for one layout (``"memory"``: each part and ``"total"``), the step's collectives,
    bytes sent per GPU (``"sent"``: by group), and the extra compute of recomputation (fraction of a step)."""
    from ..comm.costmodel import ring_steps_and_bytes
    from ..tensor_parallel.cost import layer_flops
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if zero not in ZERO_STAGES or min(tp, dp, seq, batch) < 1:
        raise ValueError(f"need zero in {ZERO_STAGES} and positive tp, dp, seq, batch; got zero={zero}, tp={tp}, "
                         f"dp={dp}, seq={seq}, batch={batch}")
    d = DTYPE_BYTES[dtype]
    acts = model_activation_bytes(cfg, batch, seq, d, device, tp=tp, attention=attention)
    if recompute == "full":
        one_layer = block_activation_bytes(batch, seq, cfg.dim, cfg.heads, cfg.hidden, d, cfg.dropout > 0, device,
                                           tp=tp, attention=attention)["total"]
        activations = acts["total"] - acts["blocks"] + cfg.layers * batch * seq * cfg.dim * d
    else:
        one_layer, activations = 0, acts["total"]
    memory = training_memory(param_count(cfg, tp), dtype, optimizer, activations, zero_stage=zero, world_size=dp)
    memory["layer rebuilt in backward"] = one_layer
    memory["ZeRO-3 gathered layer"] = block_params(cfg, tp) * d if zero == 3 and dp > 1 else 0
    memory["total"] += memory["layer rebuilt in backward"] + memory["ZeRO-3 gathered layer"]
    coll = collectives(cfg, seq, batch, tp, dp, zero, recompute, dtype)
    sent = {"data": 0.0, "tensor": 0.0}
    for group, kind, nbytes, count in coll:
        sent[group] += count * ring_steps_and_bytes(kind, nbytes, dp if group == "data" else tp)[1]
    layer = layer_flops(batch, seq, cfg.dim, cfg.hidden // cfg.dim)          # forward + backward of one layer
    head = 3 * 2 * batch * seq * cfg.dim * cfg.vocab
    again = layer / 3 - 2 * batch * seq * cfg.dim * cfg.hidden               # the forward but its last matmul
    extra = cfg.layers * again / (cfg.layers * layer + head) if recompute == "full" else 0.0
    return {"memory": memory, "collectives": coll, "sent": sent, "extra_compute": extra}


def plan(cfg: TransformerConfig, seq: int, batch: int, gpus: int, gib_per_gpu: float, dtype: str = "bf16",
         optimizer: str = "adam", attention: str = "fused") -> list[dict]:
    """Every layout for ``gpus`` GPUs: tensor-parallel degree ``tp`` (dividing the GPUs, the heads and the MLP
    width, at most 8: one NVLink node), ``dp = gpus / tp``, ZeRO stage (only 0 when ``dp = 1``), recomputation.
    Each row: the layout, GiB per GPU, whether it fits in 90% of ``gib_per_gpu``, GB sent per GPU per step (data
    and tensor groups) and the extra compute. Fitting rows first, then by GiB per GPU, least first: a memory
    order, not a cost ranking. Bytes sent say nothing of seconds (a tensor-parallel byte crosses NVLink, a
    data-parallel byte the network, mostly hidden behind backward): :func:`course_lib.layout.rank` (notebook 17)
    ranks layouts by predicted step time."""
    if gpus < 1 or gib_per_gpu <= 0 or seq > cfg.seq_len:
        raise ValueError(f"need gpus >= 1, gib_per_gpu > 0 and seq <= the model's {cfg.seq_len} positions; got "
                         f"gpus={gpus}, gib_per_gpu={gib_per_gpu}, seq={seq}")
    rows = []
    for tp in (t for t in (1, 2, 4, 8) if gpus % t == 0 and cfg.heads % t == 0 and cfg.hidden % t == 0):
        dp = gpus // tp
        for zero in (ZERO_STAGES if dp > 1 else (0,)):
            for recompute in RECOMPUTE:
                p = predict(cfg, seq, batch, tp, dp, zero, recompute, dtype, optimizer, attention=attention)
                rows.append({"tp": tp, "dp": dp, "zero": zero, "recompute": recompute,
                             "gib": p["memory"]["total"] / 2**30, "fits": fits(p["memory"], gib_per_gpu),
                             "data_gb": p["sent"]["data"] / 1e9, "tensor_gb": p["sent"]["tensor"] / 1e9,
                             "extra_compute": p["extra_compute"], "memory": p["memory"]})
    rows.sort(key=lambda r: (not r["fits"], r["gib"]))
    return rows


def layout_name(row: dict) -> str:
    """``"TP 2 x DP 4, ZeRO-3, recompute"``-style name of a row of :func:`plan`."""
    sharding = "DDP" if row["zero"] == 0 else f"ZeRO-{row['zero']}"
    parts = [f"TP {row['tp']} x DP {row['dp']}" if row["tp"] > 1 else f"DP {row['dp']}", sharding]
    return ", ".join(parts + (["recompute"] if row["recompute"] == "full" else []))
