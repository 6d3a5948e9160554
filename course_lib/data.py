"""Data and models for the training notebooks: generated on the spot, so nothing is downloaded.

The data set is a clear-structured classification problem: each class is a cloud of points around
its own centre in ``dim`` dimensions, the clouds overlapping enough that a model needs many steps to
separate them.  A small MLP learns it in seconds on a CPU, and its loss falls visibly.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def make_dataset(n: int = 2048, dim: int = 16, classes: int = 4, noise: float = 1.5, seed: int = 0) -> TensorDataset:
    """``n`` points in ``dim`` dimensions, ``classes`` Gaussian clouds; the same for the same ``seed``."""
    if n < 1 or dim < 1 or classes < 2:
        raise ValueError(f"need n >= 1, dim >= 1 and classes >= 2, got n={n}, dim={dim}, classes={classes}")
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 1.5
    labels = torch.randint(classes, (n,), generator=g)
    points = centres[labels] + noise * torch.randn(n, dim, generator=g)
    return TensorDataset(points, labels)


def make_mlp(dim: int = 16, hidden: int = 64, classes: int = 4, depth: int = 2, seed: int = 0) -> nn.Sequential:
    """An MLP whose weights depend only on ``seed``: every rank that builds it with the same seed agrees."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class WithExtras(nn.Module):
    """An MLP with a buffer-carrying layer (BatchNorm's running statistics) and a parameter it never
    uses in ``forward``: the two things that trip up a data-parallel wrapper."""

    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.unused = nn.Linear(hidden, classes)  # registered, never called: its gradient stays None

    def forward(self, x):
        return self.head(self.body(x))
