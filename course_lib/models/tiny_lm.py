"""A tiny language model with everything that trips up a sharding wrapper (notebook 09's tests).

* the output layer **shares its weight** with the embedding (tied weights: one tensor, two layers);
* a **frozen** parameter (``requires_grad=False``), owned by the top module itself;
* a **buffer** used in ``forward`` (a fixed table of position vectors);
* sizes (13 tokens, 7 dimensions, 11 hidden units) that **no world size from 2 to 4 divides**.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    """Embedding -> (+ positions) -> residual MLP block -> (* frozen scale) -> output layer tied to the embedding."""

    def __init__(self, vocab: int = 13, dim: int = 7, hidden: int = 11, max_length: int = 16, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.block = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.embed.weight                        # tied: one tensor, two layers
            self.scale = nn.Parameter(torch.rand(dim) + 0.5, requires_grad=False)   # frozen
            self.register_buffer("positions", 0.1 * torch.randn(max_length, dim))   # a buffer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.positions[: tokens.shape[1]]
        h = h + self.block(h)
        return self.head(h * self.scale)


def token_batch(n: int, length: int = 6, vocab: int = 13, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random token sequences and their next tokens (inputs, targets), the same for the same seed.
    Its loss is :func:`..transformer.lm_loss`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (n, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
