"""Notebook 11's second exercise: the column- and row-parallel layers of a parallel MLP (:func:`check_parallel_mlp`).

The learner writes two classes, ``column(linear, group)`` and ``row(linear, group)``, each built from a full
``nn.Linear`` that every rank holds alike. The check swaps them into a copy of an MLP (``up`` column-parallel,
GELU, ``down`` row-parallel: the MLP's own ``forward``) and runs it on 4 ranks, as two groups of 2 and as one
group of 4, each group on its own input. The output, the input's gradient and each parameter's gradient (against
the slice of the unsplit gradient this rank holds) must equal the unsplit MLP's, in float64. Each parameter's
*value* must be this rank's contiguous slice of the full layer's (a row bias divided by n gives the right output and
gradients, but the sum over the ranks, the effective bias, then moves n times too fast). The collectives are
counted: one all-reduce in the forward (``g``) and one in the backward (``f``). The library's own layers are
switched off in the worker, so an answer that wraps them is refused. Each usual mistake is named.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..comm.record import CollectiveLog
from ..models.transformer import MLP
from ..tensor_parallel import blocks, layers
from . import Feedback, passed, run_attempt, wrong

GROUPS = ([0, 1], [2, 3])
DIM, HIDDEN = 8, 16
TIMEOUT = 90   # a first launch in a fresh kernel takes 15-20 s on a busy 2-core machine
NAMES = ("up.weight", "up.bias", "down.weight", "down.bias")
ERROR_HINTS = {"is not defined": "a name your code uses was never imported in this kernel: run the cell with its "
                                 "imports (import torch.distributed as dist, ...) first, then this one again"}


def with_died_hint(feedback: Feedback, hint: str) -> Feedback:
    """``feedback`` with ``hint`` added when a rank died without a Python error (an abort)."""
    if feedback.status == "wrong" and " died (exit code" in feedback.message:
        return wrong(f"{feedback.message}\nHint: {hint}")
    return feedback


def make_groups(rank: int):
    """The two groups of 2 (every rank must create every group); this rank's."""
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    return groups[rank // 2]


@contextmanager
def library_switched_off():
    """The course's column-, row-parallel layers and MLP refuse to be built: the learner writes their own."""
    def refuse(self, *args, **kwargs):
        raise RuntimeError("the course's tensor-parallel layers are switched off in this check: write the layer "
                           "yourself (nn.Parameter slices of linear.weight, tp.f and tp.g)")
    saved = [(cls, cls.__init__) for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear,
                                            blocks.ParallelMLP)]
    for cls, _ in saved:
        cls.__init__ = refuse
    try:
        yield
    finally:
        for cls, init in saved:
            cls.__init__ = init


def _tensor(module, name: str):
    layer, attr = name.split(".")
    t = getattr(getattr(module, layer), attr, None)
    return t if isinstance(t, torch.Tensor) else None


def _shape(module, name: str):
    t = _tensor(module, name)
    return None if t is None else tuple(t.shape)


def _slices(full, r: int, n: int, step: bool = False) -> dict:
    """This rank's values of the full MLP's parameters: the contiguous block r of n, or every n-th (``step``)."""
    k = HIDDEN // n
    mine = slice(r, HIDDEN, n) if step else slice(r * k, (r + 1) * k)
    return {"up.weight": full.up.weight[mine], "up.bias": full.up.bias[mine],
            "down.weight": full.down.weight[:, mine], "down.bias": full.down.bias}


def _want(n: int) -> dict:
    return {"up.weight": (HIDDEN // n, DIM), "up.bias": (HIDDEN // n,), "down.weight": (DIM, HIDDEN // n),
            "down.bias": (DIM,)}


def _grad(p):
    return None if p is None or p.grad is None else p.grad.detach().clone()


def _one(rank: int, column, row, group, members: list[int]) -> dict:
    """One group: the split MLP against the unsplit one, with what the usual mistakes would give."""
    n, r = len(members), members.index(rank)
    torch.manual_seed(0)
    full = MLP(DIM, HIDDEN).double()
    g = torch.Generator().manual_seed(1 + members[0])           # one input per group, the same on its ranks
    x, grad_y = (torch.randn(3, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    y_full.backward(grad_y)
    part = copy.deepcopy(full)
    for p in part.parameters():
        p.grad = None
    with library_switched_off():
        part.up, part.down = column(full.up, group), row(full.down, group)
    shapes = {k: _shape(part, k) for k in NAMES}
    base = {"n": n, "rank in group": r, "global rank": rank, "shapes": shapes}
    if shapes != _want(n):
        return {"type": "wrong shapes", **base}         # named by _shape_message, before a forward that would raise
    values = {k: _tensor(part, k).detach().clone() for k in NAMES}
    base.update(values=values, contiguous=_slices(full, r, n), interleaved=_slices(full, r, n, step=True))
    x_part = x.clone().requires_grad_()
    with CollectiveLog() as log:
        y = part(x_part)
        if not isinstance(y, torch.Tensor):
            return {"type": type(y).__name__, **base}
        with log.during("backward"):
            y.backward(grad_y)
    mine = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)      # this rank's hidden units
    up, down = full.up, full.down
    expected = {"up.weight": up.weight.grad[mine], "up.bias": up.bias.grad[mine],
                "down.weight": down.weight.grad[:, mine], "down.bias": down.bias.grad}
    got = {k: _grad(getattr(getattr(part, k.split(".")[0]), k.split(".")[1], None)) for k in expected}
    return {"type": "Tensor", **base, "y": y.detach(), "y full": y_full.detach(),
            "y bias n times": (y_full + (n - 1) * down.bias).detach(),
            "input grad": x_part.grad, "input grad full": x_full.grad, "grads": got, "expected": expected,
            "forward": [c.kind for c in log.records if c.phase == "forward"],
            "backward": [c.kind for c in log.records if c.phase == "backward"]}


def worker(rank, world_size, column, row):
    """Worker: the split MLP in groups of 2, then in one group of all the ranks."""
    pair = make_groups(rank)
    return {"groups of 2": _one(rank, column, row, pair, GROUPS[rank // 2]),
            "one group of 4": _one(rank, column, row, dist.group.WORLD, list(range(world_size)))}


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-6, atol=1e-9))


def _shape_message(r, where) -> str | None:
    n, s = r["n"], r["shapes"]
    want = _want(n)
    missing = [k for k in want if s[k] is None]
    if missing:
        return (f"{where}: {missing[0]} is missing (no tensor attribute of that name): each layer keeps its slices "
                "as nn.Parameters named self.weight and self.bias.")
    if s["up.weight"] == (HIDDEN, DIM // n):
        return (f"{where}: the column-parallel layer kept columns of W, shape {s['up.weight']}. Column-parallel "
                f"splits the output features: keep rows of W (linear.weight[rows]), shape {want['up.weight']}.")
    if s["down.weight"] == (DIM // n, HIDDEN):
        return (f"{where}: the row-parallel layer kept rows of W, shape {s['down.weight']}. Row-parallel splits the "
                f"input features: keep columns of W (linear.weight[:, cols]), shape {want['down.weight']}.")
    for k in want:
        if s[k] is not None and 0 in s[k]:
            return (f"{where}: rank {r['global rank']}'s {k} is empty, shape {s[k]}: slice by the rank in the group, "
                    "dist.get_rank(group), not the global rank.")
    if s["up.weight"] == want["up.weight"] and s["up.bias"] == (HIDDEN,):
        return (f"{where}: the column-parallel layer kept the whole bias, shape {s['up.bias']}: it adds one bias per "
                f"output feature, so keep the same rows of the bias as of W, shape {want['up.bias']}.")
    if s["down.bias"] == (DIM // n,):
        return (f"{where}: the row-parallel layer split its bias: every rank adds the whole bias of the output, once, "
                "after the all-reduce.")
    for k in want:
        if s[k] is not None and s[k] != want[k]:
            return (f"{where}: {k} has shape {s[k]}, expected {want[k]} for a group of {n} ranks: split by "
                    "dist.get_world_size(group), the group's size, not the world's.")
    return None


def _value_message(r, where) -> str | None:
    n, rank = r["n"], r["global rank"]
    if not _close(r["values"]["down.bias"], r["contiguous"]["down.bias"]):
        return (f"{where}: rank {rank}'s down.bias is not the full layer's bias. The row layer's bias must be the "
                "whole bias, added once after g. (Dividing it by the group's size gives the right output, but each "
                "rank's copy then gets the whole gradient: the effective bias, their sum, trains n times too fast.)")
    if n > 1 and all(_close(r["values"][k], r["interleaved"][k]) for k in NAMES):
        return (f"{where}: rank {rank} kept every {n}-th hidden unit (linear.weight[r::n]). That interleaved split "
                "computes the same MLP, but this course (and Megatron-LM's checkpoints) give rank r the r-th "
                "contiguous block: linear.weight[r*k:(r+1)*k] with k = out_features // n (columns for the row layer).")
    for k in NAMES:
        if not _close(r["values"][k], r["contiguous"][k]):
            return (f"{where}: rank {rank}'s {k} is not its slice of the full layer's {k}: rank r of n keeps the "
                    "r-th contiguous block of the hidden units, copied from linear.weight and linear.bias.")
    return None


def _message(results: list[dict], where: str) -> str | None:
    r0 = results[0]
    for r in results:
        m = _shape_message(r, where)
        if m:
            return m
    for r in results:
        m = _value_message(r, where)
        if m:
            return m
    if r0["type"] != "Tensor":
        return f"{where}: the MLP returned a {r0['type']}, not a tensor: each layer's forward returns a tensor"
    if not r0["forward"]:
        return (f"{where}: no collective in the forward: the row-parallel layer returns a partial sum. Add g "
                "(tp.g(partial, group): the all-reduce) before the bias.")
    if all(_close(r["y"], r["y bias n times"]) for r in results):
        return (f"{where}: the bias is counted {r0['n']} times: the row-parallel layer added it before the "
                "all-reduce. Add the whole bias once, after g.")
    if not all(_close(r["y"], r["y full"]) for r in results):
        return (f"{where}: the output differs from the unsplit MLP's: is each all-reduce over the group "
                "(tp.g(x, group)), and does each rank keep its own slice, dist.get_rank(group)?")
    if not r0["backward"]:
        return (f"{where}: no collective in the backward: the column-parallel layer's input gradient holds only its "
                "own slice's share. Pass the input through f first (tp.f(x, group)).")
    if len(r0["backward"]) > 1 and not all(_close(r["input grad"], r["input grad full"]) for r in results):
        return (f"{where}: the backward ran {r0['backward']}, more than f's one all-reduce. g's backward is the "
                "identity: an all-reduce there makes every gradient before g t times too large.")
    if not all(_close(r["input grad"], r["input grad full"]) for r in results):
        return (f"{where}: the input's gradient differs from the unsplit MLP's: f at the column layer's entry, "
                "with the group (tp.f(x, group))?")
    for k in NAMES:
        bad = [r["global rank"] for r in results if not _close(r["grads"][k], r["expected"][k])]
        if bad:
            return (f"{where}: {k}'s gradient on rank {bad[0]} is not the slice of the unsplit gradient it holds: "
                    "keep the slices as nn.Parameter (trainable), from the full layer's weights.")
    if r0["forward"] != ["all-reduce"] or r0["backward"] != ["all-reduce"]:
        return (f"{where}: right values, but the collectives were {r0['forward']} forward and {r0['backward']} "
                "backward: the pair needs one all-reduce each way (g forward, f backward).")
    return None


RANK_HINT = "slice by the rank in the group, dist.get_rank(group), not the global rank"


def check_parallel_mlp(column, row):
    """``column(linear, group)`` and ``row(linear, group)``: an MLP split with them equals the unsplit one."""
    for what in (column, row):
        if not isinstance(what, type):
            return wrong(f"pass the classes themselves (MyColumnParallel, MyRowParallel), got {what!r}")
    results, feedback = run_attempt(worker, 4, column, row, timeout=TIMEOUT,
                                    timeout_hint="every rank must call the same collectives, with the same group "
                                                 "(or the machine is very busy: run the cell again)",
                                    error_hints={"shapes cannot be multiplied": "a layer kept the wrong slice: "
                                                 "column-parallel keeps rows of W, row-parallel columns",
                                                 "exceeds dimension size": RANK_HINT, "out of range": RANK_HINT,
                                                 "out of bounds": RANK_HINT, **ERROR_HINTS})
    if feedback is not None:
        return with_died_hint(feedback, "every rank must call the same collectives, with the same group")
    for name in ("groups of 2", "one group of 4"):
        message = _message([r[name] for r in results], f"on 4 ranks as {name}")
        if message:
            return wrong(message)
    return passed("your column- and row-parallel layers give the unsplit MLP's output, input gradient and every "
                  "parameter's gradient slice, with one all-reduce forward and one backward, in groups of 2 and 4")
