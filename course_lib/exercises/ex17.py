"""Notebook 17's exercises: the groups of a 3-D mesh, and a layout for a given cluster.

**1. Who talks to whom.** The learner writes ``fn(rank, pp, dp, tp)``, returning ``{"pp": [...], "dp": [...],
"tp": [...]}``: the ranks of each of ``rank``'s three groups, itself included, on a mesh ``(pp, dp, tp)`` numbered
as :func:`torch.distributed.device_mesh.init_device_mesh` numbers it (row-major, ``tp`` fastest).
:func:`check_groups` asks it for every rank of several meshes, 2×2×2 and meshes whose sizes differ (where a
stride mistake shows), with the library's own answer (:mod:`course_lib.composed.mesh`) switched off while it runs.
A wrong answer is compared with the known mistakes of :data:`MISTAKES` (numbered with another dimension fastest,
the XOR trick of 2×2×2, strides of the wrong size, a group without the rank itself) and named.

**2. A layout for a cluster.** The learner picks a :class:`~course_lib.layout.Layout` for a model on a cluster;
:func:`check_layout_choice` prices it with the planner (:func:`course_lib.layout.predict`) and passes it when it
lies in the planner's space, fits in memory, and runs within ``slack`` of the fastest layout that fits. A layout
that does not fit is told its largest part; a slow one is told, term by term, where its time goes
(:func:`course_lib.layout.explain`).
"""
from __future__ import annotations

import itertools
import numbers

from ..composed import mesh as mesh_module
from . import NOT_ATTEMPTED, Feedback, passed, wrong

MESHES = [(2, 2, 2), (2, 3, 2), (1, 2, 4), (3, 2, 1), (2, 2, 3)]   # (pp, dp, tp)
DIMS = ("pp", "dp", "tp")


def reference(rank: int, pp: int, dp: int, tp: int) -> dict[str, list[int]]:
    """The groups of ``rank``: the ranks whose other two coordinates equal its own (tp fastest)."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    here = {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}
    out = {}
    for dim in DIMS:
        out[dim] = [(c["pp"] * dp + c["dp"]) * tp + c["tp"]
                    for c in ({**here, dim: k} for k in range(sizes[dim]))]
    return out


def _numbered(order: tuple[str, ...]):
    """The groups on a mesh numbered row-major in ``order`` (its last dimension fastest): a wrong numbering."""
    def groups_of(rank, pp, dp, tp):
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        here, rest = {}, rank
        for dim in reversed(order):
            here[dim], rest = rest % sizes[dim], rest // sizes[dim]

        def number(c):
            n = 0
            for dim in order:
                n = n * sizes[dim] + c[dim]
            return n
        return {dim: sorted(number({**here, dim: k}) for k in range(sizes[dim])) for dim in DIMS}
    return groups_of


def _xor(rank, pp, dp, tp):
    """2×2×2's shortcut: partners by flipping one bit."""
    return {"pp": sorted([rank, rank ^ 4]), "dp": sorted([rank, rank ^ 2]), "tp": sorted([rank, rank ^ 1])}


def _dp_stride_dp(rank, pp, dp, tp):
    """dp's partners taken ``dp`` ranks apart (its own size), not ``tp`` apart (the size numbered faster)."""
    g = reference(rank, pp, dp, tp)
    start = rank - (rank // dp % dp) * dp
    return {**g, "dp": sorted(start + k * dp for k in range(dp))}


def _without_self(rank, pp, dp, tp):
    return {d: [r for r in g if r != rank] for d, g in reference(rank, pp, dp, tp).items()}


def _dp_tp_swapped(rank, pp, dp, tp):
    g = reference(rank, pp, dp, tp)
    return {"pp": g["pp"], "dp": g["tp"], "tp": g["dp"]}


_FASTEST = "the mesh (pp, dp, tp) numbers tp fastest: rank = (pp_coord·dp + dp_coord)·tp + tp_coord"
MISTAKES = {
    "pp fastest": (_numbered(("tp", "dp", "pp")),
                   "your groups number the ranks with pp fastest (column-major): tp's neighbours would be dp·pp "
                   f"ranks apart. {_FASTEST}, so a tp group is tp consecutive ranks"),
    "tp outermost": (_numbered(("tp", "pp", "dp")),
                     "your groups put tp outermost (the slowest coordinate): a tp group would span the whole mesh, "
                     f"across nodes on a real cluster. {_FASTEST}"),
    "dp fastest": (_numbered(("pp", "tp", "dp")),
                   f"your groups number dp faster than tp (dp and tp swapped in the numbering). {_FASTEST}: dp's "
                   "partners are tp ranks apart"),
    "dp and tp swapped": (_dp_tp_swapped, "the right groups under the wrong names: what you call dp is the tp group "
                                          "and the reverse. tp's ranks are neighbours (stride 1), dp's stride by tp"),
    "xor": (_xor, "right on 2×2×2 but not on meshes of other sizes: flipping a bit (r ^ 1, r ^ 2, r ^ 4) only "
                  "works when every size is 2. Compute the rank's coordinates and vary one of them"),
    "dp stride dp": (_dp_stride_dp,
                     "your dp group strides by dp, its own size: right when dp = tp only. A group of one dimension "
                     "strides by the product of the sizes numbered faster: 1 for tp, tp for dp, dp·tp for pp"),
    "without the rank itself": (_without_self, "each group includes the rank itself: a process group of size n "
                                               "holds all n ranks"),
}
for order in itertools.permutations(DIMS):       # every other numbering has a name too
    if order != DIMS and not any(order == o for o in (("tp", "dp", "pp"), ("tp", "pp", "dp"), ("pp", "tp", "dp"))):
        fastest = order[-1]
        MISTAKES[f"{'·'.join(order)} order"] = (
            _numbered(order), f"your groups number the ranks in the order {order} ({fastest} fastest). {_FASTEST}")


def _is_rank(r) -> bool:
    """A rank is an integer (``int``, a NumPy integer), never a bool, a float or a string."""
    return isinstance(r, numbers.Integral) and not isinstance(r, bool)


def _canonical(answer) -> dict | None:
    if not isinstance(answer, dict) or set(answer) != set(DIMS):
        return None
    try:
        if not all(_is_rank(r) for d in DIMS for r in answer[d]):
            return None
        return {d: sorted(int(r) for r in answer[d]) for d in DIMS}
    except TypeError:
        return None


def _refuse(*args, **kwargs):
    raise RuntimeError("work out the groups yourself: course_lib.composed's coords, rank_at, groups and peers are off "
                       "for this check")


def without_the_library(fn, *args):
    """``fn(*args)`` with :mod:`course_lib.composed.mesh`'s answers switched off (the exercise is to write them)."""
    from .. import composed
    names = ("coords", "rank_at", "groups", "peers")
    saved = [(m, n, getattr(m, n)) for m in (composed, mesh_module) for n in names]
    for m, n, _ in saved:
        setattr(m, n, _refuse)
    try:
        return fn(*args)
    finally:
        for m, n, original in saved:
            setattr(m, n, original)


def _answers(fn) -> dict:
    return {(shape, r): fn(r, *shape) for shape in MESHES for r in range(shape[0] * shape[1] * shape[2])}


def check_groups(fn) -> Feedback:
    """Ask ``fn(rank, pp, dp, tp)`` for every rank of :data:`MESHES`; pass it when every answer is the mesh's."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    try:
        got = without_the_library(_answers, fn)
    except NotImplementedError:
        return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell again")
    except Exception as e:  # noqa: BLE001 - the learner's error, reported
        return wrong(f"your function raised {type(e).__name__}: {e}")
    shown = {key: _canonical(a) for key, a in got.items()}
    bad = next((key for key, a in shown.items() if a is None), None)
    if bad is not None:
        return wrong(f"for rank {bad[1]} of (pp, dp, tp) = {bad[0]} it returned {got[bad]!r}: return a dict "
                     "{'pp': [...], 'dp': [...], 'tp': [...]}, each a list of integer ranks (not strings, floats "
                     "or bools)")
    right = {key: reference(key[1], *key[0]) for key in got}
    if shown == right:
        return passed(f"every rank of {len(MESHES)} meshes ({', '.join('×'.join(map(str, s)) for s in MESHES)}) "
                      "gets its mesh's groups")
    for mistake, message in MISTAKES.values():
        if all(shown[key] == _canonical(mistake(key[1], *key[0])) for key in got):
            return wrong(message)
    (shape, r), = [next(key for key in got if shown[key] != right[key])]
    dim = next(d for d in DIMS if shown[(shape, r)][d] != right[(shape, r)][d])
    return wrong(f"on (pp, dp, tp) = {shape}, rank {r}'s {dim} group is {shown[(shape, r)][dim]}, but the mesh's is "
                 f"{right[(shape, r)][dim]}: the ranks whose other two coordinates equal rank {r}'s")


def check_layout_choice(layout, model=None, cluster=None, global_batch: int = 512, slack: float = 0.15) -> Feedback:
    """Price ``layout`` (a :class:`~course_lib.layout.Layout`) for ``model`` on ``cluster`` (default: Llama-3-70B's
    shape on 8 nodes of 8 H100, 512 sequences a step); pass it when it is in the planner's space, fits, and its
    predicted step is within ``slack`` of the fastest layout that fits.

    ``slack`` is 15%: the practitioners' layouts without CP (TP 8 × PP 2 × DP 4 or TP 4 × PP 4 × DP 4, ZeRO-1)
    come within 12% of the planner's winner, and the planner's own accuracy is not better than that (notebook
    17's comparison with a published table). A slow layout is told the fastest variant of its own degrees too
    (its ZeRO stage, recomputation and micro-batch may be what costs it)."""
    from ..layout import PRESETS, Layout, enumerate_layouts, explain, find, h100_cluster, predict, rank
    from ..layout.space import RECOMPUTE, ZERO
    model = PRESETS["llama-3-70b"] if model is None else model
    cluster = h100_cluster(8) if cluster is None else cluster
    if layout is NotImplemented or layout is None:
        return Feedback(NOT_ATTEMPTED, "set my_layout = Layout(dp=..., tp=..., pp=..., cp=..., zero=..., "
                                       "recompute=..., micro_batch=..., m=...), then run this cell again")
    if not isinstance(layout, Layout):
        return wrong(f"pass a Layout(dp, tp, pp, cp, zero, recompute, micro_batch, m), got {type(layout).__name__}")
    if layout.gpus != cluster.gpus:
        return wrong(f"dp·tp·pp·cp = {layout.gpus}, but the cluster has {cluster.gpus} GPUs: use all of them")
    share = layout.dp * layout.micro_batch * layout.m
    if share != global_batch:
        return wrong(f"dp·micro_batch·m = {share} sequences a step, but the global batch is {global_batch}: choose m = "
                     f"{global_batch} / (dp·micro_batch)")
    if layout.recompute not in RECOMPUTE:
        return wrong(f"recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    if layout not in enumerate_layouts(model, cluster, global_batch, micro_batches=(layout.micro_batch,)):
        why = (f"tp = {layout.tp} must divide the {cluster.gpus_per_node} GPUs of a node and the {model.heads} heads"
               if cluster.gpus_per_node % layout.tp or model.heads % layout.tp else
               f"pp = {layout.pp} must divide the {model.layers} layers" if model.layers % layout.pp else
               f"cp = {layout.cp} must divide the sequence of {model.seq}" if model.seq % layout.cp else
               f"zero must be one of {ZERO}, got {layout.zero!r}" if layout.zero not in ZERO else
               "ZeRO needs dp·cp > 1 (there is nothing to shard over otherwise)" if layout.dp * layout.cp == 1 else
               "see the rules in course_lib.layout.space's docstring")
        return wrong(f"{layout.name()} is outside the planner's space: {why}")
    mine = predict(layout, model, cluster)
    if not mine["fits"]:
        parts = {k: v for k, v in mine["memory"].items() if isinstance(v, (int, float)) and k != "total"}
        biggest = max(parts, key=parts.get)
        return wrong(f"{layout.name()} needs {mine['gib']:.1f} GiB a GPU, more than the {mine['limit_gib']:.1f} GiB "
                     f"usable; its largest part is {biggest} ({parts[biggest] / 2**30:.1f} GiB). Shard it further "
                     "(more tp or pp, a higher ZeRO stage) or, for activations, recompute or use smaller "
                     "micro-batches")
    rows = rank(model, cluster, global_batch, micro_batches=(1, 2, 4))
    best = rows[0]
    ratio = mine["time"]["step"] / best["time"]["step"]
    if ratio > 1 + slack:
        family = find(rows, dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp)
        own = ("" if family["layout"] == layout else
               f" With your degrees, the fastest variant is {family['name']} at {family['time']['step']:.2f} s "
               f"({family['time']['step'] / best['time']['step']:.2f}× the fastest).")
        why = explain(best, mine).replace(best["name"], "The fastest layout", 1)
        return wrong(f"{layout.name()} fits, but its step is {ratio:.2f}× the fastest layout's.{own} {why}")
    return passed(f"{layout.name()}: {mine['gib']:.1f} GiB a GPU, {mine['time']['step']:.2f} s a step, MFU "
                  f"{mine['time']['mfu']:.0%}, within {ratio - 1:.0%} of the fastest the planner finds")
