"""Load balance in training: the router learns with and without the load-balancing loss (one process).

The tokens share a common direction (as real hidden states often do), so a random router sends almost every token
to the same two experts: at step 0 the load is collapsed (imbalance E/k, or close). Training on the task alone keeps
a few experts busy (the favoured experts learn fastest, and are chosen more). The
load-balancing loss, added with a coefficient, pushes the router's mean probabilities toward uniform: the load
evens out and fewer slots are dropped.
"""
from __future__ import annotations

import torch

from .moe import MoE
from .routing import imbalance


def skewed_tokens(count: int, dim: int, seed: int = 0, shift: float = 2.0) -> torch.Tensor:
    """Random tokens plus one shared offset: what a router sees is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(dim, generator=g)
    return torch.randn(count, dim, generator=g) + shift * offset / offset.norm() * dim ** 0.5 / 2


def train(aux_coef: float, steps: int = 40, tokens: int = 256, dim: int = 16, hidden: int = 32,
          num_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25, lr: float = 0.02,
          seed: int = 0) -> dict:
    """Fit an MoE to a fixed random teacher; per step: the load of each expert, the dropped slots, the losses."""
    torch.manual_seed(seed)
    moe = MoE(dim, hidden, num_experts, top_k=top_k, capacity_factor=capacity_factor, seed=seed)
    x = skewed_tokens(tokens, dim, seed)
    teacher = torch.nn.Linear(dim, dim)
    target = teacher(x).detach()
    opt = torch.optim.Adam(moe.parameters(), lr=lr)
    history = {"load": [], "dropped": [], "imbalance": [], "task": [], "aux": []}
    for _ in range(steps):
        task = (moe(x) - target).pow(2).mean()
        loss = task + aux_coef * moe.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        history["load"].append(moe.load.tolist())
        history["dropped"].append(moe.dropped)
        history["imbalance"].append(imbalance(moe.load))
        history["task"].append(float(task.detach()))
        history["aux"].append(float(moe.aux_loss.detach()))
    return history
