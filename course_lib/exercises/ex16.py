"""Notebook 16's exercise: write the dispatch and combine of an expert-parallel mixture of experts.

The learner writes ``fn(x, expert, gate, num_experts, local_experts, group=None)``: ``x`` holds this rank's
token-slots (one row each), ``expert[i]`` the global expert slot ``i`` goes to, ``gate[i]`` its weight. Rank ``r``
of ``group`` owns experts ``r·E/W .. (r+1)·E/W − 1``; ``local_experts(tokens, local)`` runs them. ``fn`` returns
``gate[i] · expert_{expert[i]}(x[i])`` in ``x``'s order, with gradients to ``x``, ``gate`` and the experts.

The check runs it in three stages (different slot counts per rank, uneven routing, a rank with no slots, a rank
that receives nothing):

1. a probe on 2 and 4 ranks whose expert ``e`` squares its rows and multiplies them by a weight that starts at
   ``e + 1``: from each output row it reads which expert computed it, so a slot sent to the wrong rank or the wrong
   local expert, a result in the wrong place, a missing gate or a gate applied before the expert (the square tells
   ``g·e(x)`` from ``e(g·x)``) is named; every ``all_to_all_single`` goes through
   :class:`~course_lib.expert_parallel.AllToAllLog` (``check=True``), which names split sizes that do not match;
2. in use on 2 and 4 ranks: ``fn`` inside :class:`~course_lib.expert_parallel.MoE` against the one-process
   reference (outputs and every gradient, :func:`~course_lib.expert_parallel.check.compare_worker`);
3. in a subgroup: 4 ranks as two expert-parallel groups of 2 (``dist.new_group``), each rank passing its group, as
   in 2 EP × 2 DP; a function that ignores ``group`` fails here.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..expert_parallel import AllToAllLog
from ..expert_parallel.check import compare_worker
from ..expert_parallel.dispatch import dispatch_combine as reference  # noqa: F401 (the reference solution)
from . import passed, run_attempt, wrong

CASES = {2: [5, 8], 4: [6, 3, 0, 9]}   # slots per rank (on 4 ranks, rank 2 has none)
MOE_TOKENS = [4, 11, 0, 7]             # tokens per rank in the MoE stages (rank 2 holds none)
DIM = 3


class ProbeExperts(nn.Module):
    """This rank's experts; expert ``e`` squares its rows and multiplies them by ``scale[e]``, which starts at
    ``e + 1``. Nonlinear, so that weighting a row before the expert, ``e(g·x) = g²·e(x)``, shows."""

    def __init__(self, first: int, count: int, num_experts: int):
        super().__init__()
        self.scale = nn.Parameter(torch.arange(first + 1, first + count + 1, dtype=torch.float64))
        self.first, self.num_experts = first, num_experts

    def forward(self, tokens, local):
        count = len(self.scale)
        if local.shape != tokens.shape[:1]:
            raise ValueError(f"local_experts got {tuple(tokens.shape[:1])} rows but local of shape "
                             f"{tuple(local.shape)}: one local index per received row")
        if local.numel() and (int(local.min()) < 0 or int(local.max()) >= count):
            raise ValueError(f"local_experts got local index {int(local.max())}, but this rank holds {count} experts: "
                             f"local[i] is row i's expert among this rank's (0 to {count - 1}), not its global id. "
                             "Global expert e is local expert e − rank·E/W; build local from the received counts")
        return tokens * tokens * self.scale[local].unsqueeze(1)


def probe_inputs(rank: int, world_size: int):
    """Rank ``rank``'s slots: routed unevenly, each rank with slots sending to another; on 4 ranks rank 2 has no
    slots and the last rank receives nothing."""
    num_experts, per_rank = 2 * world_size, 2
    g = torch.Generator().manual_seed(40 + rank)
    n = CASES[world_size][rank]
    x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    weights = torch.tensor([4.0, 1.0, 2.0, 1.0] if world_size == 2 else [4.0, 1.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0])
    expert = (torch.multinomial(weights, n, replacement=True, generator=g) if n
              else torch.zeros(0, dtype=torch.long))                        # expert 0 the busiest
    receivers = world_size if world_size == 2 else world_size - 1
    if n:
        expert[0] = ((rank + 1) % receivers) * per_rank + 1                 # to another rank, its 2nd expert
        expert[1] = 1
    gate = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return num_experts, x, expert, gate


def probe(rank, world_size, fn):
    """Worker: the learner's output and gradients, what they should be, and the all-to-alls it ran."""
    import torch.distributed as dist
    num_experts, x, expert, gate = probe_inputs(rank, world_size)
    per_rank = num_experts // world_size
    experts = ProbeExperts(rank * per_rank, per_rank, num_experts)
    x_in, gate_in = x.clone().requires_grad_(), gate.clone().requires_grad_()
    with AllToAllLog(check=True) as log:
        out = fn(x_in, expert, gate_in, num_experts, experts)
        if not isinstance(out, torch.Tensor):
            return {"type": type(out).__name__}
        w = torch.linspace(1, 2, out.numel(), dtype=torch.float64).view(out.shape) if out.dim() else None
        if out.requires_grad and w is not None:
            with log.during("backward"):
                (out * w).sum().backward()
    scale = torch.arange(1, num_experts + 1, dtype=torch.float64).requires_grad_()     # the reference's experts
    x_ref, gate_ref = x.clone().requires_grad_(), gate.clone().requires_grad_()
    expected = gate_ref.unsqueeze(1) * x_ref * x_ref * scale[expert].unsqueeze(1)
    if w is not None and w.shape == expected.shape:
        (expected * w).sum().backward()
    dist.all_reduce(scale.grad)
    own = slice(rank * per_rank, (rank + 1) * per_rank)
    return {"type": "Tensor", "out": out.detach(), "expected": expected.detach(), "x": x, "gate": gate,
            "expert": expert, "rank": rank, "per_rank": per_rank,
            "grads": [None if t.grad is None else t.grad.clone() for t in (x_in, gate_in, experts.scale)],
            "expected grads": [x_ref.grad, gate_ref.grad, scale.grad[own]],
            "splits given": [c.splits_given for c in log.calls if c.dtype.is_floating_point]}


def in_an_moe(rank, world_size, fn):
    """Worker: ``fn`` as the dispatch of an expert-parallel MoE, against the one-process layer (some slots dropped)."""
    return compare_worker(rank, world_size, MOE_TOKENS[:world_size], {"num_experts": 2 * world_size}, fn)


def in_a_subgroup(rank, world_size, fn):
    """Worker: the same on 4 ranks as two expert-parallel groups of 2, each rank's layer given its group."""
    return compare_worker(rank, world_size, MOE_TOKENS, {"num_experts": 4}, fn, ep_size=2)


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _computed_by(r: dict) -> torch.Tensor | None:
    """Which expert computed each output row, read from the probe's scales (``None`` where it cannot be read)."""
    ratio = r["out"] / (r["gate"].unsqueeze(1) * r["x"] * r["x"])
    e = ratio.mean(1).round() - 1
    consistent = torch.allclose(ratio, (e + 1).unsqueeze(1).expand_as(ratio), rtol=1e-9)
    return e.long() if consistent else None


def _source_rows(out, x) -> torch.Tensor | None:
    """For each output row, the row of ``x²`` it is a multiple of (``None`` if some row is none's multiple)."""
    unit = lambda t: t / t.norm(dim=1, keepdim=True).clamp_min(1e-300)   # noqa: E731
    cos = (unit(out) @ unit(x * x).T).abs()
    best = cos.max(1)
    return best.indices if bool((best.values > 1 - 1e-9).all()) else None


def _own_twice(r: dict) -> bool:
    """Exactly the slots for this rank's own experts come out 2×, the others right."""
    own = r["expert"] // r["per_rank"] == r["rank"]
    return bool(own.any()) and _close(r["out"][own], 2 * r["expected"][own]) and _close(r["out"][~own],
                                                                                          r["expected"][~own])


def _value_mistake(r: dict, where: str) -> str | list:
    """The name of what is wrong with rank ``r``'s values, or the slots computed by another expert."""
    i, gate = r["rank"], r["gate"].unsqueeze(1)
    if _close(r["out"] * gate, r["expected"]):
        return (f"{where}: the output is not weighted by the gates: each slot's result is "
                "gate[i] · expert(x[i]); multiply the combined rows by gate.unsqueeze(1)")
    if _close(r["out"], r["expected"] * gate):
        return (f"{where}: the gate was applied before the expert, expert(gate · x), on rank {i}: an expert is not "
                "linear, so weight its result instead, gate[i] · expert(x[i]), after the combine")
    if _own_twice(r):
        return (f"{where}: on rank {i}, the slots for its own experts count twice (exactly 2× the right result), the "
                "others are right: the all-to-all already carries what a rank sends to itself (in_splits[rank]); "
                "do not add a local computation of those slots as well")
    rows = _source_rows(r["out"], r["x"])
    if rows is not None and bool((rows != torch.arange(len(rows))).any()):
        return (f"{where}: the results come back in the wrong order on rank {i}: the combine returns them in the "
                "order they were sent (sorted by expert); put the row sent j-th back at position order[j]")
    by = _computed_by(r)
    if by is None:
        return (f"{where}: rank {i}'s output differs from gate · expert(x): row 0 is {r['out'][0].tolist()}, "
                f"expected {r['expected'][0].tolist()}")
    return [(i, j, int(r["expert"][j]), int(by[j]), r["per_rank"]) for j in range(len(by)) if by[j] != r["expert"][j]]


def _misrouted(misrouted: list, where: str) -> str:
    i, j, asked, got, per_rank = misrouted[0]
    if all(g // per == a // per for _, _, a, g, per in misrouted):
        return (f"{where}: right rank, wrong local expert: on rank {i}, slot {j} for expert {asked} reached rank "
                f"{asked // per_rank} but was computed by its expert {got}. Rows arrive grouped by sender, then by "
                "expert: build local from the received counts, recv_counts[s·E/W + j] rows from sender s for local "
                "expert j, in that order")
    if all(g // per == rank for rank, _, _, g, per in misrouted):
        return (f"{where}: rank {i} computed slots for other ranks' experts itself (it sent them to itself): "
                f"slot {j}, for expert {asked}, was computed by its own expert {got}. Expert e lives on rank "
                "e // (num_experts // world_size): the rows must travel there by the all-to-all")
    return (f"{where}: slots reached the wrong rank: on rank {i}, slot {j} for expert {asked} (on rank "
            f"{asked // per_rank}) was computed by expert {got} (on rank {got // per_rank}). all_to_all_single "
            "sends the first input_split_sizes[0] rows to rank 0, the next ones to rank 1...: sort the rows by "
            "expert and count them per destination rank")


def _diagnose(results: list[dict], n: int) -> str | None:
    where = f"on {n} ranks"
    if results[0]["type"] != "Tensor":
        return f"{where}: your function returned a {results[0]['type']}, not a tensor: return the combined rows"
    for r in results:
        if r["out"].shape != r["expected"].shape:
            return (f"{where}: rank {r['rank']} returned shape {tuple(r['out'].shape)}, expected "
                    f"{tuple(r['expected'].shape)}: one row per slot of x, in x's order")
    if any(not all(r["splits given"]) for r in results):
        return (f"{where}: the tokens went without split sizes (all_to_all_single's equal split): the ranks send "
                "different numbers of rows to each other. Exchange the counts first, then pass "
                "output_split_sizes and input_split_sizes")
    misrouted = []   # (rank, slot, expert asked, expert that computed it, experts per rank)
    for r in results:
        if not _close(r["out"], r["expected"]):
            found = _value_mistake(r, where)
            if isinstance(found, str):
                return found
            misrouted += found
    if misrouted:
        return _misrouted(misrouted, where)
    for r in results:
        got, expected = r["grads"], r["expected grads"]
        for name, g, e in zip(("x", "the gates", "the experts' weights"), got, expected):
            if g is None or not _close(g, e):
                state = "no gradient reached" if g is None or not g.abs().sum() else "a wrong gradient reached"
                if name == "the gates":
                    how = "no" if state.startswith("no") else "a wrong"
                    return (f"{where}: the output is right, but the gates got {how} gradient on rank {r['rank']}. "
                            "The gates "
                            "never travel (the all-to-alls carry x's rows only): multiply the combined rows by gate "
                            "itself, not gate.detach(), gate.data or a tensor rebuilt from its values")
                return (f"{where}: the output is right, but {state} {name} on rank {r['rank']}: the rows must travel "
                        "through a differentiable all-to-all (course_lib.expert_parallel.all_to_all, or your own "
                        "autograd.Function whose backward is the reverse all-to-all), not a plain "
                        "dist.all_to_all_single into a buffer, and nothing detached")
    return None


HINTS = {"Split sizes doesn't match": "were the two split lists swapped? ep.all_to_all(x, out_splits, in_splits) "
                                      "takes the rows received first: your sent counts give in_splits, the received "
                                      "counts give out_splits",
         "out of bounds": "local[i] is row i's expert among this rank's (0 to E/W − 1), not its global id"}
GROUP = ("passes on the whole world, but not on 4 ranks as two expert-parallel groups of 2 ([0, 1] and [2, 3], "
         "each rank passing its group, as in 2 EP × 2 DP): it ignores `group`. Pass group=group to "
         "every collective (the counts exchange and both all-to-alls) and use dist.get_world_size(group) and "
         "dist.get_rank(group)")


def _in_moe(worker, n, fn, hint):
    """``(feedback, None)`` if ``worker`` failed on ``n`` ranks, else ``(None, the largest difference)``."""
    results, feedback = run_attempt(worker, n, fn, timeout=30, timeout_hint=hint, error_hints=HINTS)
    if feedback is not None:
        return feedback, None
    return None, max(max(r[k] for k in ("output", "input grad", "router grad", "expert grads")) for r in results)


def _refuse(*args, **kwargs):
    raise RuntimeError("write the dispatch and combine yourself: the course's own ep.dispatch_combine is off for "
                       "this check")


def without_the_reference(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the library's dispatch and combine switched off (the exercise is to write them)."""
    from .. import expert_parallel as ep
    from ..expert_parallel import dispatch as dispatch_module
    saved = [(ep, ep.dispatch_combine), (dispatch_module, dispatch_module.dispatch_combine)]
    for module, _ in saved:
        module.dispatch_combine = _refuse
    try:
        return fn(*args, **kwargs)
    finally:
        for module, original in saved:
            module.dispatch_combine = original


def check_dispatch_combine(fn):
    """``fn(x, expert, gate, num_experts, local_experts, group=None)``: a probe and an MoE layer on 2 and 4 ranks,
    then an MoE layer in two expert-parallel groups of 2."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    fn = functools.partial(without_the_reference, fn)
    hint = ("A rank waits in an all-to-all that another rank never calls: every rank must call the same "
            "all-to-alls, in the same order, even a rank with nothing to send.")
    for n in CASES:
        results, feedback = run_attempt(probe, n, fn, timeout=30, timeout_hint=hint, error_hints=HINTS)
        if feedback is not None:
            return feedback
        message = _diagnose(results, n)
        if message:
            return wrong(message)
        feedback, worst = _in_moe(in_an_moe, n, fn, hint)
        if feedback is not None:
            return feedback
        if worst > 1e-9:
            return wrong(f"on {n} ranks, your function passes the probe but, inside an MoE layer, outputs or "
                         f"gradients differ from the one-process layer by up to {worst:.2g}")
    feedback, worst = _in_moe(in_a_subgroup, 4, fn, hint)
    if feedback is not None or worst > 1e-9:
        there = feedback.message if feedback is not None else f"outputs or gradients differ by up to {worst:.2g}"
        return wrong(f"your function {GROUP}. (There: {there})")
    return passed("your dispatch and combine send every slot to its expert's rank and back, in order and weighted "
                  "by its gate, with gradients to the tokens, the gates and the experts; inside an MoE layer they "
                  "give the one-process layer's outputs and every gradient, on 2 and 4 ranks and within "
                  "expert-parallel subgroups")
