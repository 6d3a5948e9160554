"""Workers that prove the expert-parallel layer equals the reference, and count what its all-to-alls move.

* :func:`compare_worker`: on every rank, its own tokens through the expert-parallel :class:`.MoE` and through the
  one-process reference; the largest difference of each output and gradient (float64, so that the only
  difference left is the order of additions).
* :func:`ep_dp_worker`: ``world_size`` ranks as (data-parallel groups) × (expert-parallel groups); after the
  gradient all-reduces, every rank's gradients equal one process's on the global batch.
* :func:`traffic_worker`: the all-to-alls of one forward and backward, with the bytes each rank sent to others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import hardware
from .alltoall import AllToAllLog
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


def compare_worker(rank: int, world_size: int, tokens: list[int], case: dict | None = None, dispatch=None) -> dict:
    """Rank ``rank`` holds ``tokens[rank]`` tokens. Returns the largest differences (EP − reference) and the counts."""
    case = {**CASE, **(case or {})}
    device = hardware.rank_device()
    x, w = (t.to(device) for t in _tokens(rank, tokens[rank], case["dim"]))
    ref, ep = _layer(case).to(device), _layer(case, dist.group.WORLD).to(device)
    if dispatch is not None:
        ep.dispatch = dispatch
    x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    _loss(ref, x_ref, w).backward()
    y_ep = ep(x_ep)
    ((y_ep * w).sum() + 0.1 * ep.aux_loss).backward()
    own = slice(ep.owned.start, ep.owned.stop)
    summed = [torch.stack([m[i].weight.grad for m in ref.experts.mlps]) for i in (0, 2)]   # every expert's
    for g in summed:
        dist.all_reduce(g)                                   # the reference's gradients, summed over the ranks
    mine = [torch.stack([m[i].weight.grad for m in ep.experts.mlps]) for i in (0, 2)]
    return {"output": _diff(y_ep, ref(x)), "input grad": _diff(x_ep.grad, x_ref.grad),
            "aux loss": abs(float((ep.aux_loss - ref.aux_loss).detach())), "dropped": (ep.dropped, ref.dropped),
            "router grad": _diff(ep.router.weight.grad, ref.router.weight.grad),
            "expert grads": max(_diff(m, s[own]) for m, s in zip(mine, summed)),
            "sent_to": ep.sent_to, "owned": list(ep.owned)}


def ep_dp_groups(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Expert-parallel groups (consecutive ranks, one full set of experts each) and data-parallel groups (the
    ranks that hold the same experts). 4 ranks, ``ep_size=2``: EP ``[[0, 1], [2, 3]]``, DP ``[[0, 2], [1, 3]]``."""
    if world_size % ep_size:
        raise ValueError(f"an expert-parallel group of {ep_size} does not divide {world_size} ranks")
    ep = [list(range(i, i + ep_size)) for i in range(0, world_size, ep_size)]
    return ep, [list(ranks) for ranks in zip(*ep)]


def ep_dp_worker(rank: int, world_size: int, ep_size: int, tokens: list[int], case: dict | None = None) -> dict:
    """Experts sharded over the EP group, replicated over the DP group; every weight's gradient against one
    process's on all ranks' tokens (the loss: the mean over ranks of each rank's loss)."""
    case = {**CASE, **(case or {})}
    ep_groups, dp_groups = ep_dp_groups(world_size, ep_size)
    made = {tuple(r): dist.new_group(r) for r in ep_groups + dp_groups}   # every rank creates every group
    ep_group = made[tuple(next(g for g in ep_groups if rank in g))]
    dp_group = made[tuple(next(g for g in dp_groups if rank in g))]
    moe = _layer(case, ep_group)
    x, w = _tokens(rank, tokens[rank], case["dim"])
    (_loss(moe, x, w) / world_size).backward()
    with AllToAllLog():   # (nothing to log: the gradient all-reduces below are the data-parallel part)
        for p in moe.router.parameters():
            dist.all_reduce(p.grad)                               # replicated on all ranks: all-reduce over all
        for p in moe.experts.parameters():
            dist.all_reduce(p.grad, group=dp_group)               # replicated over the DP group only
    ref = _layer(case)
    sum(_loss(ref, *_tokens(s, tokens[s], case["dim"])) for s in range(world_size)).div(world_size).backward()
    own = [ref.experts.mlps[e] for e in moe.owned]
    expert_diff = max(_diff(p.grad, q.grad) for mine, full in zip(moe.experts.mlps, own)
                      for p, q in zip(mine.parameters(), full.parameters()))
    expert_bytes = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    return {"router grad": _diff(moe.router.weight.grad, ref.router.weight.grad), "expert grads": expert_diff,
            "owned": list(moe.owned), "ep group": dist.get_process_group_ranks(ep_group),
            "dp group": dist.get_process_group_ranks(dp_group), "expert bytes held": expert_bytes}


def traffic_worker(rank: int, world_size: int, tokens: int, case: dict | None = None) -> dict:
    """One forward and backward (float32): each all-to-all's kind, rows and the bytes this rank sent to others."""
    case = {**CASE, **(case or {})}
    moe = MoE(case["dim"], case["hidden"], case["num_experts"], top_k=case["top_k"],
              capacity_factor=case["capacity_factor"], group=dist.group.WORLD, seed=case["seed"])
    x = torch.randn(tokens, case["dim"], generator=torch.Generator().manual_seed(rank))
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
