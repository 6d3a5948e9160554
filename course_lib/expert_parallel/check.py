"""Workers that prove the expert-parallel layer equals the reference, and count what its all-to-alls move.

* :func:`compare_worker`: on every rank, its own tokens through the expert-parallel :class:`.MoE` and through the
  one-process reference; the largest difference of each output and gradient (float64, so that the only
  difference left is the order of additions).
* :func:`ep_dp_worker`: ``world_size`` ranks as (data-parallel groups) × (expert-parallel groups); after the
  gradient all-reduces, every rank's gradients equal one process's gradient accumulation over the ranks'
  micro-batches: one forward per rank's tokens, each with its own capacity and aux loss, the losses averaged. (Not
  one forward on all the tokens at once: capacity depends on the batch, so other slots would be dropped.) It also
  measures the usual DDP habit, each rank's loss averaged over its DP group, which scales the experts' gradients
  by the EP size.
* :func:`traffic_worker`: the all-to-alls of one forward and backward, with the bytes each rank sent to others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import hardware
from ..comm.alltoall import AllToAllLog
from .moe import MoE

CASE = {"dim": 6, "hidden": 10, "num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "seed": 0}


def _tokens(rank: int, count: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and the output weights of its loss: different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(count, dim, generator=g, dtype=torch.float64), torch.randn(count, dim, generator=g,
                                                                                  dtype=torch.float64)


def _loss(moe: MoE, x, w):
    """A loss that reaches every output element with a different weight, plus the load-balancing loss."""
    return (moe(x) * w).sum() + 0.1 * moe.aux_loss


def _diff(a, b) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _layer(case: dict, group=None) -> MoE:
    return MoE(case["dim"], case["hidden"], case["num_experts"], top_k=case["top_k"],
               capacity_factor=case["capacity_factor"], group=group, seed=case["seed"]).double()


def _param_diff(mine: torch.nn.Module, full: torch.nn.Module) -> float:
    """The largest gradient difference over every parameter (weights and biases); ``inf`` for a missing one."""
    return max((_diff(p.grad, q.grad) if p.grad is not None and q.grad is not None else float("inf"))
               for p, q in zip(mine.parameters(), full.parameters()))


def _groups(rank: int, world_size: int, ep_size: int):
    """This rank's EP and DP groups (every rank creates every group, in the same order, as ``new_group`` needs)."""
    ep_groups, dp_groups = ep_dp_groups(world_size, ep_size)
    made = {tuple(r): dist.new_group(r) for r in ep_groups + dp_groups}
    return (made[tuple(next(g for g in ep_groups if rank in g))],
            made[tuple(next(g for g in dp_groups if rank in g))])


def compare_worker(rank: int, world_size: int, tokens: list[int], case: dict | None = None, dispatch=None,
                   ep_size: int | None = None) -> dict:
    """Rank ``rank`` holds ``tokens[rank]`` tokens. Returns the largest differences (EP − reference) and the counts.

    With ``ep_size``, the experts are spread over expert-parallel groups of ``ep_size`` ranks (made with
    ``dist.new_group``), and each rank's layer gets its group. Expert gradients: the owner's against the
    reference's summed over the ranks of its group, for every parameter (weights and biases)."""
    case = {**CASE, **(case or {})}
    device = hardware.rank_device()
    group = dist.group.WORLD if ep_size is None else _groups(rank, world_size, ep_size)[0]
    x, w = (t.to(device) for t in _tokens(rank, tokens[rank], case["dim"]))
    ref, ep = _layer(case).to(device), _layer(case, group).to(device)
    if dispatch is not None:
        ep.dispatch = dispatch
    x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    _loss(ref, x_ref, w).backward()
    y_ep = ep(x_ep)
    ((y_ep * w).sum() + 0.1 * ep.aux_loss).backward()
    for p in ref.experts.parameters():
        dist.all_reduce(p.grad, group=group)              # the reference's gradients, summed over the ranks
    own = [ref.experts.mlps[e] for e in ep.owned]
    router = ep.router.weight.grad
    return {"output": _diff(y_ep, ref(x)),
            "input grad": _diff(x_ep.grad, x_ref.grad) if x_ep.grad is not None else float("inf"),
            "aux loss": abs(float((ep.aux_loss - ref.aux_loss).detach())), "dropped": (ep.dropped, ref.dropped),
            "router grad": _diff(router, ref.router.weight.grad) if router is not None else float("inf"),
            "expert grads": max(_param_diff(m, f) for m, f in zip(ep.experts.mlps, own)),
            "sent_to": ep.sent_to, "owned": list(ep.owned)}


def ep_dp_groups(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Expert-parallel groups (consecutive ranks, one full set of experts each) and data-parallel groups (the
    ranks that hold the same experts). 4 ranks, ``ep_size=2``: EP ``[[0, 1], [2, 3]]``, DP ``[[0, 2], [1, 3]]``."""
    if world_size % ep_size:
        raise ValueError(f"an expert-parallel group of {ep_size} does not divide {world_size} ranks")
    ep = [list(range(i, i + ep_size)) for i in range(0, world_size, ep_size)]
    return ep, [list(ranks) for ranks in zip(*ep)]


def ep_dp_worker(rank: int, world_size: int, ep_size: int, tokens: list[int], case: dict | None = None) -> dict:
    """Experts sharded over the EP group, replicated over the DP group; every parameter's gradient against one
    process's gradient accumulation over the ranks' micro-batches (the mean over ranks of each rank's loss).

    Each rank's loss is divided by the total number of ranks, EP · DP, and the gradients are *summed* over the DP
    group (experts) or over all ranks (router). Beside it, the DDP habit (each rank's loss undivided, gradients
    averaged over the DP group, the router over all ranks): its expert gradients come out EP times too large."""
    case = {**CASE, **(case or {})}
    device = hardware.rank_device()
    ep_group, dp_group = _groups(rank, world_size, ep_size)
    dp_size = dist.get_world_size(dp_group)
    x, w = (t.to(device) for t in _tokens(rank, tokens[rank], case["dim"]))
    moe, habit = _layer(case, ep_group).to(device), _layer(case, ep_group).to(device)
    (_loss(moe, x, w) / world_size).backward()                    # divided by EP · DP
    _loss(habit, x, w).backward()                                 # the DDP habit: this rank's loss as it is
    with AllToAllLog():   # (nothing to log: the gradient all-reduces below are the data-parallel part)
        for p in moe.router.parameters():
            dist.all_reduce(p.grad)                               # replicated on all ranks: all-reduce over all
        for p in moe.experts.parameters():
            dist.all_reduce(p.grad, group=dp_group)               # replicated over the DP group only
        for p in habit.router.parameters():
            dist.all_reduce(p.grad.div_(world_size))              # averaged over all ranks
        for p in habit.experts.parameters():
            dist.all_reduce(p.grad.div_(dp_size), group=dp_group)  # averaged over the DP group, as DDP does
    ref = _layer(case).to(device)
    micro = [(t.to(device) for t in _tokens(s, tokens[s], case["dim"])) for s in range(world_size)]
    sum(_loss(ref, *xw) for xw in micro).div(world_size).backward()   # one forward per micro-batch, then the mean
    own = [ref.experts.mlps[e] for e in moe.owned]
    flat = lambda mods: torch.cat([p.grad.flatten() for m in mods for p in m.parameters()])   # noqa: E731
    expert_bytes = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    return {"router grad": _diff(moe.router.weight.grad, ref.router.weight.grad),
            "expert grads": max(_param_diff(m, f) for m, f in zip(moe.experts.mlps, own)),
            "DDP habit: router grad": _diff(habit.router.weight.grad, ref.router.weight.grad),
            "DDP habit: expert grads / reference": float(flat(habit.experts.mlps).norm() / flat(own).norm()),
            "DDP habit: expert grads - EP x reference": _diff(flat(habit.experts.mlps), ep_size * flat(own)),
            "owned": list(moe.owned), "ep group": dist.get_process_group_ranks(ep_group),
            "dp group": dist.get_process_group_ranks(dp_group), "expert bytes held": expert_bytes}


def traffic_worker(rank: int, world_size: int, tokens: int, case: dict | None = None) -> dict:
    """One forward and backward (float32): each all-to-all's kind, rows and the bytes this rank sent to others."""
    case = {**CASE, **(case or {})}
    device = hardware.rank_device()
    moe = MoE(case["dim"], case["hidden"], case["num_experts"], top_k=case["top_k"],
              capacity_factor=case["capacity_factor"], group=dist.group.WORLD, seed=case["seed"]).to(device)
    x = torch.randn(tokens, case["dim"], generator=torch.Generator().manual_seed(rank)).to(device)
    x.requires_grad_()                                   # as when x comes from the layer below
    with AllToAllLog() as log:
        y = moe(x)
        with log.during("backward"):
            y.pow(2).sum().backward()
    calls = [{"phase": c.phase, "what": "counts" if not c.dtype.is_floating_point else "tokens",
              "sent": list(c.in_splits), "bytes to others": c.bytes_to_others(rank)} for c in log.calls]
    expert_bytes = sum(p.numel() * p.element_size() for m in moe.experts.mlps for p in m.parameters())
    return {"calls": calls, "sent_to": moe.sent_to, "slots": sum(moe.sent_to), "dropped": moe.dropped,
            "expert bytes held": expert_bytes}
