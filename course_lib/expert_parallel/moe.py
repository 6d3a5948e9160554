"""A mixture-of-experts layer: the one-process reference, or the same layer with its experts spread over ranks.

``MoE(dim, hidden, num_experts, group=None)`` holds every expert and computes in one process. With a process
``group`` of ``W`` ranks it is **expert-parallel**: rank ``r`` holds experts ``r·E/W .. (r+1)·E/W − 1`` (the same
weights as the reference, drawn from one seed), routes its own tokens, and sends each token-slot to the rank of
its expert (:func:`.dispatch.dispatch_combine`). The router is replicated: every rank holds all of it.

What equals what (proved in ``tests/test_expert_parallel.py`` and notebook 16): on every rank the output,
``dropped``, ``aux_loss`` and the input's gradient equal the reference applied to that rank's tokens alone (routing
and capacity are decided where the tokens are); each expert's weight gradient, on the rank that owns it, is the sum
over the ranks of the reference's; the router's gradient is the rank's own (averaged across ranks like any
replicated weight, as data parallelism does).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .dispatch import dispatch_combine
from .experts import LocalExperts, draw
from .routing import capacity, route


def owned_block(num_experts: int, world_size: int, rank: int) -> range:
    """The experts rank ``rank`` owns; a ``ValueError`` that says what to do when they do not split evenly."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks: use a number of "
                         f"experts that {world_size} divides (e.g. {world_size * max(1, num_experts // world_size)}),"
                         " or an expert-parallel group whose size divides the number of experts")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


class MoE(nn.Module):
    """Router → top-k → capacity → experts → weighted sum. ``forward(x)``: (tokens, dim) → (tokens, dim).

    After each forward: ``dropped`` (token-slots over capacity), ``aux_loss`` (the load-balancing loss, to add to
    the training loss with a small coefficient), ``load`` (slots routed to each expert, before the drop) and
    ``sent_to`` (slots this rank sent to each rank of the group; ``[all]`` in the reference).
    """

    dispatch = staticmethod(dispatch_combine)   # a notebook's check swaps in the learner's function

    def __init__(self, dim: int, hidden: int, num_experts: int, *, top_k: int = 2, capacity_factor: float = 1.25,
                 group=None, seed: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        self.owned = owned_block(num_experts, world, rank)
        self.num_experts, self.top_k, self.capacity_factor, self.group = num_experts, top_k, capacity_factor, group
        generator = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.router.weight = draw(generator, num_experts, dim, scale=dim ** -0.5)
        self.experts = LocalExperts(dim, hidden, num_experts, self.owned.start, len(self.owned), generator)
        self.dropped, self.aux_loss, self.load, self.sent_to = 0, None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(dim=-1)
        r = route(probs, self.top_k, capacity(x.shape[0], self.num_experts, self.top_k, self.capacity_factor))
        self.dropped, self.aux_loss, self.load = r.dropped, r.aux_loss, r.load
        slots = x[r.token]
        if self.group is None:                                  # one process: every expert is here
            y = self.experts(slots, r.expert) * r.gate.unsqueeze(1)
        else:
            y = self.dispatch(slots, r.expert, r.gate, self.num_experts, self.experts, self.group)
        world = 1 if self.group is None else dist.get_world_size(self.group)
        self.sent_to = torch.bincount(r.expert // len(self.owned), minlength=world).tolist()
        return torch.zeros_like(x).index_add(0, r.token, y)   # a token's slots add up; dropped ones add nothing
