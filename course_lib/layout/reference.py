"""The planner's model as real PyTorch modules, to measure what the formulas predict.

:func:`build` makes a :class:`Model`'s decoder (module names ``q k v o``, ``gate up down``, ``norm1 norm2``, as
the tensor-parallel plan below expects), on any device: on ``"meta"`` a 70 B model costs no memory, only shapes
(what :mod:`.fake` shards over 64 fake ranks). Rotary positions are left out: they hold no parameters, and a
fused kernel applies them in place. ``attention="fused"`` calls ``F.scaled_dot_product_attention`` (on the CPU,
its flash kernel saves the output and a logsumexp), ``"eager"`` writes softmax(q·kᵀ/√d)·v out and saves the s²
probabilities.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .shapes import Model


class Block(nn.Module):
    """x + attention(norm1(x)); then + SwiGLU(norm2(x)): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, m: Model):
        super().__init__()
        h, kv = m.hidden, m.kv_dim
        self.heads, self.kv_heads, self.head_dim, self.attention = m.heads, m.kv_heads, m.head_dim, m.attention
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.q, self.k, self.v = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up = nn.Linear(h, m.ffn, bias=False), nn.Linear(h, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        d = self.head_dim
        q = self.q(y).view(b, s, -1, d).transpose(1, 2)          # heads read from the width: works when TP-split
        k = self.k(y).view(b, s, -1, d).transpose(1, 2)
        v = self.v(y).view(b, s, -1, d).transpose(1, 2)
        if self.attention == "fused":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Decoder(nn.Module):
    """Embedding → blocks → final RMSNorm → LM head (untied)."""

    def __init__(self, m: Model, layers: int | None = None, embedding: bool = True, head: bool = True):
        super().__init__()
        self.embed = nn.Embedding(m.vocab, m.hidden) if embedding else None
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.layers if layers is None else layers))
        self.norm = nn.RMSNorm(m.hidden) if head else None
        self.head = nn.Linear(m.hidden, m.vocab, bias=False) if head else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build(m: Model, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
          **stage) -> Decoder:
    """The decoder of ``m`` (``stage``: :class:`Decoder`'s ``layers``, ``embedding``, ``head``, for one pipeline
    stage), built from ``seed`` without touching the caller's random generator."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return Decoder(m, **stage).to(dtype)


def tp_plan(model: Decoder) -> dict:
    """Megatron's split as a DTensor plan: q, k, v, gate, up column-parallel; o, down row-parallel; the embedding
    and the LM head split over the vocabulary; the norms whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")})
    if model.embed is not None:
        plan["embed"] = RowwiseParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    return plan
