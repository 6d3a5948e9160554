"""The planner against a published table, side by side (issue 28, part 4).

**The table.** The Ultra-Scale Playbook (Hugging Face, 2025) benchmarked thousands of layouts on 1 to 64 nodes of
8 × H100 and published, for each model size and node count, the best layout's MFU, its memory per GPU and the
layout itself, as two Matplotlib heatmaps in one SVG in nanotron's repository (:data:`SOURCE`). The SVG keeps each
cell's text in a ``<!-- ... -->`` comment above its glyphs, so the numbers below are read, not estimated from
colours. Panel 1, "MFU and Memory Usage for Best Configurations", prints ``MFU`` (%, the colour bar is labelled
``MFU``, 10–45) over ``memory`` (``"16.39GB"``); panel 2, "Best Configuration by Model Size and Number of Nodes",
prints ``DP: · TP: · PP:``, ``GAS: · MBS:`` and ``ZeRO-·``. The 80 B column has no cell on 1 and 2 nodes (its
squares are unfilled: nothing fitted), so :data:`ROWS` has 26 rows, not 28.

**What the Playbook's text states** (section "Benchmarking thousands of configurations"): "a sequence length of
4096 and a global batch size of 1M tokens", "1-64 nodes of 8xH100s". Every published cell has
``DP·GAS·MBS = 256`` sequences of 4096 = 1,048,576 tokens, and ``DP·TP·PP`` = the node count × 8: the table
agrees with the text, and :data:`GLOBAL_BATCH` is 256 sequences.

**What it does not state: the model shapes.** The column labels are only sizes, 1.34, 3.57, 8.86 and 80.0 B
parameters. *Assumed* here (:data:`MODELS`): Llama-style shapes of the Playbook's running examples (Llama 3.2 1B
and 3B, Llama 3.1 8B and 70B: layers, hidden, heads, FFN from Meta's config.json), with

* **no grouped-query attention** (``kv_heads = heads``), as nanotron's own ``scaling_benchmarks.py`` sets
  ("num_key_value_heads = num_attention_heads  # No GQA / MQA"), and
* a **vocabulary of 131,072**, tied embeddings for the two small ones.

Why: nanotron labels runs with ``2·V·h + L·(3·h·f + 4·h²)`` (``V·h`` once when tied; ``4·h²`` is q, k, v, o
without GQA), and these shapes give 1.342, 3.574, 8.859 and 79.99 B: all four labels to the printed digits,
which Llama 3's own vocabulary (128,256) or GQA do not. It is an inference from the labels, not a published
config. The planner's :class:`.Model` always counts an untied LM head, so for the 1.34 B and 3.57 B models it
holds ``V·h`` more weights than a tied model (0.27 and 0.40 B: states memory slightly high; FLOPs unaffected,
the head's product runs either way). Attention is assumed fused (nanotron uses FlashAttention).

**What the comparison does.** :func:`compare` ranks, for each row, the planner's own search space on
:func:`.shapes.h100_cluster` of that many nodes, for the same 256 sequences, with micro-batches of 1, 2, 4 or 8
(the sizes the table uses); nothing is fitted to the table. It also prices the *published* layout with the same
model (recomputation assumed off, since the table does not say), so the reader can see whether a gap is the
planner choosing differently or the planner's time model being optimistic or pessimistic about the same layout.

**What it shows** (run :func:`lines`; each entry's ``"reason"`` says it per cell). The planner is optimistic
everywhere: 38–69% predicted against 5–47% published, after the costs the planner counts that overlap cannot
hide (the last bucket's reduction, the optimizer's memory-bound step, element-wise work at HBM speed, the
slowest pipeline stage, CP's ring steps, products too small for the peak). Each cell's gap is split by pricing
the *published* layout with the same model: (1) the time model (the published layout priced against its
measured MFU), the larger cause, 13.8 points on average. On one node, where little is communicated, the table
reaches 44–47%: MFU is a lower bound on the products' own rate, so nanotron's products sustain at least about
half the dense peak, against the planner's assumed 0.75 (:data:`.timing.EFFICIENCY`, left as it is: no
fitting); and the gap widens with nodes (1.34 B on 64 nodes: 5.25% published). (2) the choice, 12.1 points on
average: 10.4 of them among the layouts the table itself uses (ZeRO 0/1 without CP, ``planner_same_space``:
other PP, DP and TP degrees and micro-batches), 1.7 from ZeRO-2/3 or CP, which nanotron could not run then (its
README lists ZeRO-1 only, ZeRO-3 and ring attention on its roadmap).

**Memory.** For the same layout the planner prices 0.64–1.07 of the published memory (``memory_ratio``; the
table's figure read as GB): it leaves out what the table's runs also hold (the allocator's cache, NCCL's
buffers, the CUDA context) and its activation formulas assume fused kernels.

**The MFU formula** is PaLM's (``6·N + 12·L·h·s`` FLOPs a token: :meth:`.shapes.Model.flops_per_token`);
nanotron's own formula was not checked, so the published MFUs may count slightly different FLOPs.

**Known differences not modelled** (to weigh before teaching from it): the quoted ``scaling_benchmarks.py``
line is from a version of that file (commit 38fcb8bc) whose stored versions set ``VOCAB_SIZE = 32768`` and
``TP_MODE="ALL_REDUCE"`` (no sequence parallelism), which contradicts the 131,072 inferred above: the shapes
stay an assumption.
"""
from __future__ import annotations

from .ranking import predict, rank
from .shapes import Model, h100_cluster
from .space import Layout

SOURCE = {
    "repo": "huggingface/nanotron",
    "path": "docs/benchmark_summary.svg",
    "commit": "c7fe20e7764b904afb14078239fc00e228cbd427",
    "title": "MFU and Memory Usage for Best Configurations / Best Configuration by Model Size and Number of Nodes",
    "made": "Matplotlib v3.8.2, 2025-02-13 (the SVG's metadata)",
    "text": "The Ultra-Scale Playbook (Hugging Face, 2025), section 'Benchmarking thousands of configurations': "
            "sequence length 4096, global batch size 1M tokens, 1-64 nodes of 8xH100",
    "how_read": "each cell's text from the <!-- --> comments: panel 1 (text_14..text_39, characters ~30,000-"
                "52,000), panel 2 (text_54..text_79, characters ~78,000-190,000); rows placed by the y of each "
                "text's translate() against the y-tick labels 64, 32, 16, 8, 4, 2, 1 (top to bottom)",
}

SEQ = 4096
GLOBAL_BATCH = 256            # sequences: 1M tokens / 4096, and DP·GAS·MBS of every published cell
GPUS_PER_NODE = 8
VOCAB = 131072                # assumed (module docstring)

# Assumed shapes (module docstring): Meta's Llama 3.2 1B / 3B and Llama 3.1 8B / 70B layers, hidden, heads and
# intermediate_size, without GQA, vocabulary 131,072. Keys: the published column labels (billions).
MODELS = {
    1.34: Model("1.34 B (Llama-3.2-1B shape, no GQA, V 131072; assumed)", 16, 2048, 32, 32, SEQ, VOCAB, 8192),
    3.57: Model("3.57 B (Llama-3.2-3B shape, no GQA, V 131072; assumed)", 28, 3072, 24, 24, SEQ, VOCAB, 8192),
    8.86: Model("8.86 B (Llama-3.1-8B shape, no GQA, V 131072; assumed)", 32, 4096, 32, 32, SEQ, VOCAB, 14336),
    80.0: Model("80.0 B (Llama-3.1-70B shape, no GQA, V 131072; assumed)", 80, 8192, 64, 64, SEQ, VOCAB, 28672),
}
TIED = {1.34: True, 3.57: True, 8.86: False, 80.0: False}


def nanotron_label_params(size: float) -> float:
    """Parameters by nanotron's run-name formula ``2·V·h + L·(3·h·f + 4·h²)`` (``V·h`` once when tied) for the
    assumed shape of column ``size``: what the published labels are checked against."""
    m = MODELS[size]
    vocab = m.vocab * m.hidden * (1 if TIED[size] else 2)
    return vocab + m.layers * (3 * m.hidden * m.ffn + 4 * m.hidden ** 2)


def _row(size, nodes, mfu, gb, dp, tp, pp, gas, mbs, zero):
    return {"size_b": size, "nodes": nodes, "mfu": mfu, "memory_gb": gb, "dp": dp, "tp": tp, "pp": pp,
            "gas": gas, "mbs": mbs, "zero": zero}


# (size B, nodes, MFU %, memory "GB" as printed, DP, TP, PP, GAS, MBS, ZeRO stage), read from SOURCE.
ROWS = [_row(*r) for r in [
    (1.34, 64, 5.25, 8.40, 128, 2, 2, 1, 2, 1),
    (3.57, 64, 10.49, 16.42, 128, 4, 1, 1, 2, 1),
    (8.86, 64, 18.69, 57.76, 128, 4, 1, 1, 2, 0),
    (80.0, 64, 17.79, 53.46, 32, 16, 1, 4, 2, 1),
    (1.34, 32, 23.20, 19.57, 64, 4, 1, 1, 4, 0),
    (3.57, 32, 26.77, 38.98, 64, 4, 1, 1, 4, 0),
    (8.86, 32, 32.71, 63.39, 32, 8, 1, 1, 8, 0),
    (80.0, 32, 30.75, 64.21, 4, 4, 16, 64, 1, 1),
    (1.34, 16, 29.46, 38.84, 64, 2, 1, 1, 4, 0),
    (3.57, 16, 34.59, 66.20, 32, 4, 1, 1, 8, 0),
    (8.86, 16, 36.33, 66.88, 16, 8, 1, 2, 8, 0),
    (80.0, 16, 34.29, 61.18, 1, 4, 32, 256, 1, 0),
    (1.34, 8, 32.47, 16.27, 32, 1, 2, 8, 1, 1),
    (3.57, 8, 35.53, 36.73, 32, 1, 2, 8, 1, 1),
    (8.86, 8, 39.50, 59.09, 32, 1, 2, 8, 1, 1),
    (80.0, 8, 30.65, 63.07, 1, 4, 16, 256, 1, 0),
    (1.34, 4, 38.38, 16.39, 16, 1, 2, 16, 1, 1),
    (3.57, 4, 40.39, 53.33, 16, 1, 2, 8, 2, 1),
    (8.86, 4, 43.31, 61.10, 16, 1, 2, 16, 1, 1),
    (80.0, 4, 14.76, 65.97, 1, 8, 4, 256, 1, 0),
    (1.34, 2, 41.59, 19.45, 8, 1, 2, 32, 1, 1),
    (3.57, 2, 43.77, 54.31, 8, 1, 2, 16, 2, 1),
    (8.86, 2, 43.94, 58.34, 4, 4, 1, 16, 4, 1),
    (1.34, 1, 44.32, 41.76, 4, 1, 2, 16, 4, 1),
    (3.57, 1, 46.68, 56.87, 4, 1, 2, 32, 2, 1),
    (8.86, 1, 45.22, 63.07, 2, 1, 4, 128, 1, 1),
]]
MISSING = [(80.0, 2), (80.0, 1)]   # unfilled squares in both panels: no published configuration


def published_layout(row: dict) -> Layout:
    """The row's layout in the planner's terms: no CP, recomputation unknown (assumed off), ``m = GAS``
    (gradient accumulation without a pipeline, pipeline micro-batches with one)."""
    return Layout(row["dp"], row["tp"], row["pp"], 1, row["zero"], "none", row["mbs"], row["gas"])


def _layout_words(lay: Layout) -> str:
    return (f"DP {lay.dp} TP {lay.tp} PP {lay.pp} CP {lay.cp}, ZeRO-{lay.zero}, MBS {lay.micro_batch} × "
            f"{lay.m}{', full recompute' if lay.recompute == 'full' else ''}")


def _differences(pub: Layout, best: Layout) -> str:
    parts = [f"{k.upper()} {getattr(pub, k)}→{getattr(best, k)}" for k in ("dp", "tp", "pp", "cp")
             if getattr(pub, k) != getattr(best, k)]
    if pub.zero != best.zero:
        parts.append(f"ZeRO {pub.zero}→{best.zero}")
    if pub.micro_batch != best.micro_batch:
        parts.append(f"MBS {pub.micro_batch}→{best.micro_batch}")
    if best.recompute != "none":
        parts.append("planner recomputes")
    return "same layout" if not parts else "published→planner: " + ", ".join(parts)


def _outside(lay: Layout, model: Model, gpus_per_node: int) -> str:
    """Why a published layout lies outside the planner's space (``""`` when it does not)."""
    if lay.tp > gpus_per_node:
        return f"published TP {lay.tp} spans nodes: outside the planner's space (TP ≤ {gpus_per_node})"
    if model.layers % lay.pp:
        return f"published PP {lay.pp} does not divide {model.layers} layers: uneven stages, outside the space"
    return ""


ONE_NODE_BEST = 46.68      # the table's highest MFU (3.57 B on one node): nanotron's sustained share, at most


def _reason(entry: dict, best: dict, pub_row: dict, outside: str, pub_pred: dict | None,
            same: dict | None = None) -> str:
    """One short line: the gap between the planner's MFU and the published one, split into the time model's
    optimism (the published layout priced against its measured MFU) and the planner's different choice, itself
    split into the layouts the table uses (ZeRO 0/1, no CP: ``same``, the best of them) and ZeRO-2/3 or CP."""
    planner, published = entry["planner_mfu"], entry["published_mfu"]
    base = f"{planner - published:+.1f} points: "
    if outside:
        return base + f"the published layout is outside the planner's space ({outside.split(':')[0]})"
    model_part, choice_part = pub_pred["mfu"] - published, planner - pub_pred["mfu"]
    same_mfu = planner if same is None else 100 * same["time"]["mfu"]
    return base + f"time model {model_part:+.1f}, choice {choice_part:+.1f} (ZeRO 0/1 without CP " \
                  f"{same_mfu - pub_pred['mfu']:+.1f}, ZeRO-2/3 or CP {planner - same_mfu:+.1f})"


def compare(rows: list[dict] = ROWS, micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict]:
    """For each published row: ``"published"`` (its layout in words, MFU %, memory), ``"planner"`` (the
    planner's best layout by :func:`.ranking.rank` on ``h100_cluster(nodes)`` for :data:`GLOBAL_BATCH`
    sequences, its predicted MFU % and GiB), ``"published_predicted"`` (the planner's MFU % and GiB for the
    published layout, ``None`` where that layout is outside the planner's space: TP across nodes, or stages
    of unequal layers; its ``"memory_ratio"`` is the planner's bytes over the published memory, read as GB),
    ``"planner_same_space"`` (the planner's best among the layouts the table itself uses: ZeRO 0 or 1, no CP;
    the table shows no other), and ``"differs"``, a short string saying where the two
    layouts differ and by how much the MFU; ``"planner_mfu"`` and ``"published_mfu"`` (%), and ``"reason"``, one
    line on the gap: how much of it is the time model's optimism (the published layout priced by the planner
    against its measured MFU) and how much the planner's different choice."""
    out = []
    for row in rows:
        model, cluster = MODELS[row["size_b"]], h100_cluster(row["nodes"])
        ranked = rank(model, cluster, GLOBAL_BATCH, micro_batches=micro_batches)
        pub = published_layout(row)
        entry = {"size_b": row["size_b"], "nodes": row["nodes"],
                 "published": {"layout": _layout_words(pub), "mfu": row["mfu"], "memory_gb": row["memory_gb"]},
                 "planner": None, "planner_same_space": None, "published_predicted": None}
        outside = _outside(pub, model, cluster.gpus_per_node)
        if not outside:
            p = predict(pub, model, cluster)
            entry["published_predicted"] = {"mfu": 100 * p["time"]["mfu"], "gib": p["gib"], "fits": p["fits"],
                                            "time": p["time"],
                                            "memory_ratio": p["gib"] * 2**30 / (row["memory_gb"] * 1e9)}
        if not ranked:
            entry["differs"] = entry["reason"] = "the planner finds no layout that fits"
            entry["planner_mfu"], entry["published_mfu"] = None, row["mfu"]
            out.append(entry)
            continue
        best = ranked[0]
        entry["planner"] = {"layout": _layout_words(best["layout"]), "mfu": 100 * best["time"]["mfu"],
                            "gib": best["gib"]}
        entry["planner_mfu"], entry["published_mfu"] = entry["planner"]["mfu"], row["mfu"]
        same = next((r for r in ranked if r["layout"].zero <= 1 and r["layout"].cp == 1), None)
        entry["reason"] = _reason(entry, best, row, outside, entry["published_predicted"], same)
        entry["planner_same_space"] = None if same is None else {
            "layout": _layout_words(same["layout"]), "mfu": 100 * same["time"]["mfu"], "gib": same["gib"]}
        words = [_differences(pub, best["layout"]),
                 f"MFU {row['mfu']:.1f}% published, {entry['planner']['mfu']:.1f}% predicted"]
        if same is not None and same is not best:
            words.append("within ZeRO 0/1 and no CP: " + _differences(pub, same["layout"]).replace(
                "published→planner: ", "") + f" at {entry['planner_same_space']['mfu']:.1f}%")
        if outside:
            words.append(outside)
        else:
            pp_ = entry["published_predicted"]
            words.append(f"published layout priced at {pp_['mfu']:.1f}%"
                         + ("" if pp_["fits"] else f", and predicted not to fit ({pp_['gib']:.0f} GiB)"))
        entry["differs"] = "; ".join(words)
        out.append(entry)
    return out


def lines(entries: list[dict] | None = None) -> list[str]:
    """:func:`compare` as printable lines, one per row."""
    entries = compare() if entries is None else entries
    text = []
    for e in entries:
        planner = e["planner"]["layout"] if e["planner"] else "(none fits)"
        text.append(f"{e['size_b']:>5} B {e['nodes']:>2} nodes | published {e['published']['layout']} "
                    f"{e['published']['mfu']:.1f}% | planner {planner} | {e['differs']}")
    return text
