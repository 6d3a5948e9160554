"""The planner: predict every layout, keep those that fit, rank them by step time, and say why the winner wins.

**The rule.** A layout is a candidate when its fullest GPU's bytes fit in :attr:`.shapes.Cluster.limit_gib`: the
memory the driver reports, less a stated reserve for the CUDA context and NCCL's buffers, less a stated share for
the allocator's fragmentation (74.2 GiB of an H100's 79.6: :func:`.shapes.h100_cluster`).
Candidates are ranked by predicted **seconds per step** for the same global batch, fastest first: the same
work in less time is the same as a higher MFU. Bytes sent are not the criterion: a byte on NVLink costs
a ninth of a byte on the network (450 against 50 GB/s on an H100 node), and a byte hidden under compute costs
nothing. (The course's first planner ranked by tensor-parallel bytes before data-parallel bytes, and called
"TP 2 × DP 32, ZeRO-3" best for 70 B on 64 GPUs: several seconds of cross-node traffic a step.)
"""
from __future__ import annotations

from .memory import memory_per_gpu
from .shapes import Cluster, Model
from .space import Layout, enumerate_layouts
from .timing import EFFICIENCY, TERMS, step_time

TERM_WORDS = {"compute": "compute", "imbalance": "the slowest pipeline stage's extra compute (the LM head)",
              "elementwise": "memory-bound element-wise work (norms, residuals, SwiGLU, rotary, logits)",
              "optimizer": "the optimizer's step (memory-bound)",
              "recompute": "recomputation's extra forward",
              "tp": "tensor-parallel collectives", "cp": "exposed context-parallel transfers",
              "dp": "exposed gradient and weight collectives (data parallel / ZeRO)",
              "pp_p2p": "pipeline sends", "bubble": "the pipeline bubble"}


def predict(layout: Layout, model: Model, cluster: Cluster, efficiency: float = EFFICIENCY) -> dict:
    """Everything the planner knows about one layout: ``"memory"`` (bytes by part, the fullest stage),
    ``"gib"``, ``"limit_gib"`` (:attr:`.shapes.Cluster.limit_gib`), ``"fits"`` (``gib <= limit_gib``),
    ``"time"`` (seconds by term, ``"step"``, ``"mfu"``), ``"name"``."""
    mem = memory_per_gpu(model, layout)
    gib = mem["total"] / 2**30
    return {"layout": layout, "name": layout.name(), "memory": mem, "gib": gib, "limit_gib": cluster.limit_gib,
            "fits": gib <= cluster.limit_gib, "time": step_time(model, cluster, layout, efficiency)}


def rank(model: Model, cluster: Cluster, global_batch: int | None = None, micro_batches=(1, 2, 4),
         global_batch_tokens: int | None = None, efficiency: float = EFFICIENCY, keep_all: bool = False,
         **space) -> list[dict]:
    """Predictions of every layout of :func:`.space.enumerate_layouts` that fits (all of them with
    ``keep_all``, fitting ones first), fastest step first."""
    rows = [predict(lay, model, cluster, efficiency)
            for lay in enumerate_layouts(model, cluster, global_batch, micro_batches, global_batch_tokens, **space)]
    rows = rows if keep_all else [r for r in rows if r["fits"]]
    return sorted(rows, key=lambda r: (not r["fits"], r["time"]["step"], r["gib"]))


def find(rows: list[dict], **degrees) -> dict:
    """The fastest row of ``rows`` whose layout has these attributes (``find(rows, tp=8, dp=8, zero=2)``)."""
    for r in rows:
        if all(getattr(r["layout"], k) == v for k, v in degrees.items()):
            return r
    raise LookupError(f"no layout with {degrees} among {len(rows)} rows")


COLUMNS = {"compute": ("compute",), "other": ("imbalance", "recompute", "elementwise", "optimizer"),
           "comm": ("tp", "cp", "dp", "pp_p2p"), "bubble": ("bubble",)}
"""The compact table's columns: the matrix products; the rest of the GPU's own work (the slowest stage's extra,
recomputation, element-wise work, the optimizer); exposed communication (TP, CP, DP, pipeline sends); the bubble."""


def table(rows: list[dict], top: int = 10, every_term: bool = False) -> list[str]:
    """The first ``top`` rows as text, at most 110 characters a line: name, GiB, the seconds of each of
    :data:`COLUMNS` (``every_term``: of each of :data:`.timing.TERMS`, a wider table), step, MFU."""
    cols = {t: (t,) for t in TERMS} if every_term else COLUMNS
    width = max([len("layout")] + [len(r["name"]) for r in rows[:top]])
    head = f"{'layout':{width}} {'GiB':>5} " + " ".join(f"{c:>8}" for c in cols) + f" {'step s':>7} {'MFU':>5}"
    lines = [head]
    for r in rows[:top]:
        t = r["time"]
        lines.append(f"{r['name']:{width}} {r['gib']:5.1f} "
                     + " ".join(f"{sum(t[k] for k in terms):8.3f}" for terms in cols.values())
                     + f" {t['step']:7.3f} {t['mfu']:5.1%}")
    return lines


def other_degrees(rows: list[dict]) -> dict | None:
    """The fastest row of ``rows`` (ranked) whose degrees (dp, tp, pp, cp) differ from the first's: the runner-up
    worth explaining (the next rows are often the winner under another ZeRO stage, in a tie)."""
    key = (lambda r: (r["layout"].dp, r["layout"].tp, r["layout"].pp, r["layout"].cp))
    return next((r for r in rows[1:] if key(r) != key(rows[0])), None)


def explain(winner: dict, runner_up: dict, model: Model | None = None, cluster: Cluster | None = None) -> str:
    """Why ``winner`` beats ``runner_up`` (two rows of :func:`rank`), in words: the step times, what the winner
    saves (each term where it is faster by more than 1% of its step, largest first, and their sum), then what it
    pays back (the terms where it is slower). With ``model`` and ``cluster``, also what breaks first when one
    moves away from the winner (:func:`what_breaks_first`'s text)."""
    a, b = winner["time"], runner_up["time"]
    gap = b["step"] - a["step"]
    words = [f"{winner['name']} takes {a['step']:.3f} s a step (MFU {a['mfu']:.1%}, {winner['gib']:.1f} GiB a "
             f"GPU); {runner_up['name']} takes {b['step']:.3f} s (MFU {b['mfu']:.1%}, {runner_up['gib']:.1f} GiB), "
             f"{gap:.3f} s more ({gap / a['step']:.1%})."]
    diffs = sorted(((b[k] - a[k], k) for k in TERMS if abs(b[k] - a[k]) > 0.01 * a["step"]), reverse=True)
    saves = [(d, k) for d, k in diffs if d > 0]
    costs = [(-d, k) for d, k in diffs if d < 0]

    def listed(items):
        return "; ".join(f"{d:.3f} s in {TERM_WORDS[k]} ({a[k]:.3f} against {b[k]:.3f})" for d, k in items)
    if saves:
        words.append(f"Why it wins: it saves {sum(d for d, _ in saves):.3f} s ({listed(saves)})"
                     + (f", and pays {sum(d for d, _ in costs):.3f} s back ({listed(costs)})." if costs else "."))
    elif costs:
        words.append(f"It pays {sum(d for d, _ in costs):.3f} s more in {listed(costs)}, and wins on the small "
                     "terms under 1% of a step each.")
    if not diffs:
        words.append("No term differs by more than 1% of a step: the two are equal within the model's accuracy.")
    if model is not None and cluster is not None:
        words.append(what_breaks_first(model, cluster, winner["layout"])["text"])
    return " ".join(words)

KIND = {"compute": "compute", "imbalance": "bubble", "recompute": "compute", "elementwise": "compute",
        "tp": "communication", "cp": "communication", "dp": "communication", "optimizer": "compute",
        "pp_p2p": "communication", "bubble": "bubble"}
FIX = {"memory": "shard more: a higher ZeRO stage, more TP or PP, or full recomputation",
       "communication": "keep that group inside a node or make it smaller; move the degree back",
       "bubble": "more micro-batches (smaller ones) or fewer pipeline stages",
       "compute": "drop recomputation or the extra work it brought; it fits without it"}
GROUP_WORDS = {"tp": "TP", "cp": "CP", "dp": "DP", "pp_p2p": "PP", "bubble": "PP", "imbalance": "PP"}


def _neighbours(layout: Layout, micro_batches) -> list[tuple[str, Layout]]:
    """Layouts one step away on the same GPUs and the same global batch: a factor 2 moved between two degrees,
    the ZeRO stage one up or down, recomputation switched, another micro-batch size."""
    from dataclasses import replace
    degrees = ("dp", "tp", "pp", "cp")
    seqs = layout.dp * layout.micro_batch * layout.m
    out = []
    for a in degrees:
        for b in degrees:
            if a == b or getattr(layout, b) % 2:
                continue
            new = replace(layout, **{a: getattr(layout, a) * 2, b: getattr(layout, b) // 2})
            if seqs % (new.dp * new.micro_batch):
                continue
            new = replace(new, m=seqs // (new.dp * new.micro_batch))
            out.append((f"{a.upper()} {getattr(layout, a)}→{new.__dict__[a]}, {b.upper()} "
                        f"{getattr(layout, b)}→{new.__dict__[b]}", new))
    for z in (layout.zero - 1, layout.zero + 1):
        if 0 <= z <= 3:
            out.append((f"ZeRO {layout.zero}→{z}", replace(layout, zero=z)))
    other = "none" if layout.recompute == "full" else "full"
    out.append((f"recompute {layout.recompute}→{other}", replace(layout, recompute=other)))
    for mb in micro_batches:
        if mb != layout.micro_batch and (seqs // layout.dp) % mb == 0:
            out.append((f"micro-batch {layout.micro_batch}→{mb}",
                        replace(layout, micro_batch=mb, m=seqs // (layout.dp * mb))))
    return out


def what_breaks_first(model: Model, cluster: Cluster, layout: Layout, micro_batches=(1, 2, 4),
                      efficiency: float = EFFICIENCY) -> dict:
    """What goes wrong when you step away from ``layout`` (a winner, say), one knob at a time.

    Returns ``{"layout", "step", "gib", "limit_gib", "headroom_gib", "moves", "first", "by_kind", "text"}``.
    Each of ``"moves"`` (valid neighbours of the planner's space, :func:`_neighbours`) is a dict: ``"move"``
    (words), ``"layout"`` (its name), ``"fits"``, ``"gib"``, ``"step"``, ``"slower_s"`` (its step minus this
    one's), ``"breaks"`` (``"memory"`` when it no longer fits, else the kind of the term that grows most:
    ``"communication"``, ``"bubble"`` or ``"compute"``), ``"term"`` and ``"term_s"`` (that term and its
    growth), ``"fix"`` (the knob that fixes it). ``"first"`` is the worse move that costs least time (what
    breaks first as you move away; a move that no longer fits breaks memory however fast it would be);
    ``"nearest"`` the cheapest worse move that still fits; ``"by_kind"`` maps each kind to its moves' names;
    ``"text"`` says it in words."""
    from .space import enumerate_layouts
    seqs = layout.dp * layout.micro_batch * layout.m
    space = set(enumerate_layouts(model, cluster, seqs, micro_batches=tuple(sorted(set(micro_batches)
                                                                                  | {layout.micro_batch}))))
    here = predict(layout, model, cluster, efficiency)
    moves = []
    for words, lay in _neighbours(layout, micro_batches):
        if lay not in space:
            continue
        p = predict(lay, model, cluster, efficiency)
        grow = {k: p["time"][k] - here["time"][k] for k in TERMS}
        term = max(grow, key=grow.get)
        breaks = "memory" if not p["fits"] else KIND[term]
        moves.append({"move": words, "layout": p["name"], "fits": p["fits"], "gib": p["gib"],
                      "step": p["time"]["step"], "slower_s": p["time"]["step"] - here["time"]["step"],
                      "breaks": breaks, "term": term, "term_s": grow[term], "fix": FIX[breaks]})
    moves.sort(key=lambda mv: mv["slower_s"])
    worse = [mv for mv in moves if mv["slower_s"] > 0 or not mv["fits"]]
    first = worse[0] if worse else None
    nearest = next((mv for mv in moves if mv["fits"] and mv["slower_s"] > 0), None)
    by_kind = {k: [mv["move"] for mv in moves if mv["breaks"] == k] for k in ("memory", "communication",
                                                                                "bubble", "compute")}
    t = here["time"]
    text = [f"{here['name']}: {t['step']:.3f} s a step, {here['gib']:.1f} GiB of {cluster.limit_gib:.1f} "
            f"({cluster.limit_gib - here['gib']:.1f} GiB to spare)."]
    if first is not None:
        what = (f"memory ({first['gib']:.1f} GiB > {cluster.limit_gib:.1f})" if first["breaks"] == "memory" else
                f"{first['breaks']}: {TERM_WORDS[first['term']]} grow by {first['term_s']:.3f} s")
        cost = (f"would save {-first['slower_s']:.3f} s but breaks" if first["slower_s"] < 0 else
                f"costs {first['slower_s']:.3f} s, in" if first["slower_s"] > 0 else "costs no time but breaks")
        text.append(f"What breaks first: {first['move']} {cost} {what}; the fix: {first['fix']}.")
    for kind in ("memory", "communication", "bubble"):
        if by_kind[kind] and (first is None or kind != first["breaks"]):
            mv = next(m for m in moves if m["breaks"] == kind)
            text.append(f"{kind.capitalize()} breaks on {'; '.join(f'({mv_})' for mv_ in by_kind[kind][:3])}"
                        + (f" ({mv['gib']:.1f} GiB)." if kind == "memory" else
                           f" (the cheapest: {mv['move']}, +{mv['term_s']:.3f} s in {TERM_WORDS[mv['term']]})."))
    if nearest is not None and nearest is not first:
        text.append(f"The cheapest step that still fits: {nearest['move']}, {nearest['slower_s']:+.3f} s "
                    f"({nearest['breaks']}: {TERM_WORDS[nearest['term']]}).")
    return {"layout": here["name"], "step": t["step"], "gib": here["gib"], "limit_gib": cluster.limit_gib,
            "headroom_gib": cluster.limit_gib - here["gib"], "moves": moves, "first": first,
            "nearest": nearest, "by_kind": by_kind, "text": " ".join(text)}
