"""Multi-layer perceptrons: the one builder behind every MLP of the course.

Building a model with a ``seed`` gives the same weights on every rank (that is how the ranks of a
data-parallel job can start equal without a broadcast), and it leaves the caller's global random
generator as it was: the seed is applied inside ``torch.random.fork_rng``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


def mlp(widths: Sequence[int], activation: type[nn.Module] = nn.ReLU, last_activation: bool = False,
        seed: int | None = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), activation(), Linear(widths[1], widths[2]), ...``.

    The last ``Linear`` has no activation after it unless ``last_activation`` (a stage of a deeper model
    wants one). With ``seed=None`` the weights come from the global generator, as ``nn.Linear`` does.
    """
    widths = list(widths)
    if len(widths) < 2 or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be two or more positive ints (input, ..., output), got {widths}")

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        for k, (a, b) in enumerate(zip(widths, widths[1:])):
            layers.append(nn.Linear(a, b))
            if k < len(widths) - 2 or last_activation:
                layers.append(activation())
        return nn.Sequential(*layers)

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def make_mlp(dim: int = 16, hidden: int = 64, classes: int = 4, depth: int = 2, seed: int = 0) -> nn.Sequential:
    """The classifier of the training notebooks: ``depth`` hidden ReLU layers of ``hidden`` units, then a
    linear head. Its weights depend only on ``seed``: every rank that builds it with the same seed agrees."""
    return mlp([dim] + [hidden] * depth + [classes], nn.ReLU, seed=seed)


class WithExtras(nn.Module):
    """An MLP with a buffer-carrying layer (BatchNorm's running statistics) and a parameter it never
    uses in ``forward``: the two things that trip up a data-parallel wrapper."""

    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
            self.head = nn.Linear(hidden, classes)
            self.unused = nn.Linear(hidden, classes)  # registered, never called: its gradient stays None

    def forward(self, x):
        return self.head(self.body(x))
