"""The course's block with fused attention: ``F.scaled_dot_product_attention`` in place of the eager scores.

Eager attention (:class:`course_lib.models.transformer.CausalSelfAttention`) runs ``q @ kᵀ``, the mask, the
softmax and ``probs @ v`` as separate operators, and autograd saves the ``b·a·s²`` softmax output between
them. A fused kernel (FlashAttention; on the CPU, PyTorch's flash kernel behind SDPA) computes the softmax
block by block and never stores the scores: for backward it keeps ``q``, ``k``, ``v``, its output and one
fp32 *logsumexp* per query row, ``(b, a, s)``, from which backward rebuilds each block of probabilities.
With dropout, the GPU kernels regenerate the mask from the random state; on the CPU, SDPA with dropout runs its
math path instead, which stores the ``s²`` probabilities like eager attention.
:func:`with_fused_attention` swaps the kernel in a copy of a model; the weights stay the same.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.transformer import CausalSelfAttention


class FusedAttention(CausalSelfAttention):
    """:class:`CausalSelfAttention` whose core is one ``scaled_dot_product_attention(is_causal=True)`` call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.out(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)))


def with_fused_attention(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (a block or the course transformer) whose attention runs the fused kernel."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if type(m) is CausalSelfAttention:
            m.__class__ = FusedAttention
    return model
