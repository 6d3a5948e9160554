"""The experts: small MLPs, of which each rank holds a contiguous block, built the same from one seed.

An **expert** is a two-layer MLP (dim → hidden → dim, GELU), the same shape as a transformer's MLP. With ``W`` ranks
and ``E`` experts, rank ``r`` owns experts ``r·E/W`` to ``(r+1)·E/W − 1``. Every rank draws *all* the experts'
weights from the same generator, in the same order, and keeps its own: so the weights of expert ``e`` are the same
whichever rank holds it, and the same as in the one-process reference.
"""
from __future__ import annotations

import torch
from torch import nn


def draw(generator: torch.Generator, *shape, scale: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=generator) * scale)


def expert_mlp(dim: int, hidden: int, generator: torch.Generator) -> nn.Sequential:
    """One expert, its weights drawn from ``generator`` (biases small and random, so their gradients show)."""
    mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
    mlp[0].weight = draw(generator, hidden, dim, scale=dim ** -0.5)
    mlp[0].bias = draw(generator, hidden, scale=0.1)
    mlp[2].weight = draw(generator, dim, hidden, scale=hidden ** -0.5)
    mlp[2].bias = draw(generator, dim, scale=0.1)
    return mlp


class LocalExperts(nn.Module):
    """The experts ``first`` .. ``first + count − 1`` of ``num_experts``; ``forward(tokens, local)`` runs them.

    ``local[i]`` is the index, among this rank's experts, of the expert row ``i`` goes to (0 .. count − 1).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, first: int, count: int,
                 generator: torch.Generator):
        super().__init__()
        mlps = [expert_mlp(dim, hidden, generator) for _ in range(num_experts)]   # all drawn, in order
        self.mlps = nn.ModuleList(mlps[first:first + count])
        self.first, self.num_experts = first, num_experts

    def forward(self, tokens: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for i, mlp in enumerate(self.mlps):
            rows = (local == i).nonzero().squeeze(1)
            out = out.index_copy(0, rows, mlp(tokens[rows]))  # connected to tokens even with no rows
        return out
