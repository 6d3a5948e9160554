"""Random numbers under tensor parallelism: which dropout masks must agree across ranks, and which must not.

The rule (Megatron-LM's, and what DTensor's random tracker does for sharded tensors):

* An activation every rank of the group holds **whole** (the output of a row-parallel layer, the residual
  stream) must get the **same** mask on every rank; otherwise the ranks' copies drift apart silently and
  each rank trains a different model. Plain ``nn.Dropout`` does this when every rank of the group seeds the
  global generator alike (``torch.manual_seed(seed)``, the same ``seed`` on each of them).
* An activation split across the group (attention probabilities of this rank's heads, anything inside a
  sequence-parallel region) must get a **different** mask on each rank; with one shared generator, head 0 on
  rank 0 and head 0 on rank 1 would be dropped at the same places: correlated, not independent, dropout.
  :class:`ShardedDropout` draws its masks from a generator of its own, seeded by the rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn

RANK_OFFSET = 2718   # Megatron's offset between the shared seed and the per-rank ones


def sharded_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s own dropout generator: distinct per rank, derived from the shared seed."""
    return seed + RANK_OFFSET + rank


class ShardedDropout(nn.Module):
    """Dropout for a tensor split across ranks: masks drawn from a generator seeded by ``seed`` and ``rank``.

    It scales kept values by ``1/(1-p)`` like ``nn.Dropout``; ``eval()`` makes it the identity. The generator
    lives on the input's device and advances with every call, so successive steps get new masks.
    """

    def __init__(self, p: float, seed: int, rank: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed, self.rank = p, sharded_seed(seed, rank), rank
        self._generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device).manual_seed(self.seed)
        keep = torch.rand(x.shape, generator=self._generator, device=x.device) >= self.p
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, rank={self.rank}, seed={self.seed}"
