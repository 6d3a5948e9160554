"""Random numbers under tensor parallelism: which dropout masks must agree across ranks, and which must not.

The rule (Megatron-LM's, and what DTensor's random tracker does for random ops on sharded DTensors):

* An activation every rank of the group holds **whole** (the output of a row-parallel layer, the residual
  stream) must get the **same** mask on every rank; otherwise the ranks' copies drift apart silently and
  each rank trains a different model. Plain ``nn.Dropout`` does this when every rank of the group seeds the
  global generator alike (``torch.manual_seed(seed)``, the same ``seed`` on each of them).
* An activation split across the group (attention probabilities of this rank's heads, anything inside a
  sequence-parallel region) must get a **different** mask on each rank; with one shared generator, head 0 on
  rank 0 and head 0 on rank 1 would be dropped at the same places: correlated, not independent, dropout.

Megatron-LM keeps, on each rank, two random states: the default one (seeded alike across the tensor-parallel
group, for replicated activations) and one "model-parallel" state seeded ``seed + 2718 + tp_rank``, which
every dropout of a sharded region draws from in turn (its ``get_cuda_rng_tracker().fork()``). Being **one**
state per rank that advances with each draw matters as much as the seed: block 0 and block 1 then get
different masks, and so does every step. :class:`RankGenerator` is that state; one of them is shared by every
:class:`ShardedDropout` of a model (:func:`use_sharded_dropout` puts them in place).

Under activation recomputation the forward runs again in the backward pass, and ``torch.utils.checkpoint``
restores only torch's default generators: a :class:`ShardedDropout` would draw a new mask there and the gradients
would be silently wrong. :func:`checkpoint` saves and restores the :class:`RankGenerator`'s state as well.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint

from ..models.transformer import MLP, CausalSelfAttention

RANK_OFFSET = 2718   # Megatron's offset between the shared seed and the per-rank ones


def sharded_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s own dropout generator: distinct per rank, derived from the shared seed."""
    return seed + RANK_OFFSET + rank


class RankGenerator:
    """One random stream per rank of a tensor-parallel group, for the dropouts of its sharded regions.

    Seeded ``sharded_seed(seed, rank)``; every :class:`ShardedDropout` given this object draws from the same
    generator, one after the other, so no two layers and no two steps reuse a mask. Build **one** per model
    (per rank) and pass it to every block; two objects with equal seeds repeat each other's masks.
    """

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = sharded_seed(seed, rank), rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The stream on ``device`` (created, seeded, on first use; then it only advances)."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def get_state(self) -> dict:
        """The state of every stream (one per device used so far), to hand back to :meth:`set_state`."""
        return {device: g.get_state() for device, g in self._generators.items()}

    def set_state(self, state: dict) -> None:
        """Put every stream back where :meth:`get_state` found it (a stream made since starts afresh)."""
        for device, g in self._generators.items():
            if device in state:
                g.set_state(state[device])
            else:
                g.manual_seed(self.seed)

    def __repr__(self) -> str:
        return f"RankGenerator(rank={self.rank}, seed={self.seed})"


def checkpoint(fn, *args, rng: RankGenerator, **kwargs):
    """``torch.utils.checkpoint.checkpoint(fn, *args)`` that replays ``rng``'s masks in the recomputation.

    Recomputation runs ``fn``'s forward again in the backward pass. ``torch.utils.checkpoint`` restores only
    torch's default generators, so a :class:`ShardedDropout` would draw a *new* mask there and the gradients
    would be silently wrong. This saves ``rng``'s state before the forward, restores it for the recomputation,
    and afterwards puts the stream back where it was, as Megatron-LM's RNG tracker does.
    """
    saved, calls = rng.get_state(), [0]

    def replayed(*inner):
        calls[0] += 1
        if calls[0] == 1:                      # the forward pass
            return fn(*inner)
        now = rng.get_state()                  # the recomputation, in backward
        rng.set_state(saved)
        try:
            return fn(*inner)
        finally:
            rng.set_state(now)

    return torch.utils.checkpoint.checkpoint(replayed, *args, use_reentrant=False, **kwargs)


class ShardedDropout(nn.Module):
    """Dropout for a tensor split across ranks: masks drawn from this rank's :class:`RankGenerator`.

    It scales kept values by ``1/(1-p)`` like ``nn.Dropout``; ``eval()`` makes it the identity. The generator
    is shared with the model's other sharded dropouts and advances with every call.
    """

    def __init__(self, p: float, rng: RankGenerator):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if not isinstance(rng, RankGenerator):
            raise TypeError(f"rng must be a RankGenerator (one per model and rank), got {type(rng).__name__}")
        self.p, self.rng = p, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape, generator=self.rng.generator(x.device), device=x.device) >= self.p
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, {self.rng}"


def use_sharded_dropout(module: nn.Module, rng: RankGenerator, sequence_parallel: bool = False) -> nn.Module:
    """Give ``module``'s dropouts on sharded activations masks from ``rng``; returns ``module`` (changed in place).

    Attention's dropout on the probabilities (``attn_dropout``: this rank's heads) always; with
    ``sequence_parallel``, also the residual branches' dropouts (``resid_dropout``, the MLP's ``dropout``),
    which then act on this rank's slice of the sequence. The others stay ``nn.Dropout`` on the global
    generator, seeded alike across the group. Works on a block, an attention or MLP module, or a whole
    model, split from scratch or by ``parallelize_module`` (whose ``ColwiseParallel`` hands attention plain
    local tensors, so DTensor's own random tracker never sees them).
    """
    for sub in list(module.modules()):
        if isinstance(sub, CausalSelfAttention):
            names = ("attn_dropout", "resid_dropout") if sequence_parallel else ("attn_dropout",)
        elif isinstance(sub, MLP) and sequence_parallel:
            names = ("dropout",)
        else:
            continue
        for name in names:
            setattr(sub, name, ShardedDropout(getattr(sub, name).p, rng))
    return module
