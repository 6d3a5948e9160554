"""The activations a forward pass keeps for its backward, measured by autograd itself.

Every tensor an operation saves for its backward goes through ``torch.autograd.graph.saved_tensors_hooks``:
:func:`saved_tensors` records each one (its shape, dtype and bytes) while ``fn`` runs. Tensors that share
memory (a view of a saved tensor, one input saved by three layers) are counted once, by their storage; the
parameters are left out (they are memory the model holds anyway, not activations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Saved:
    """One tensor kept for the backward pass."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def saved_tensors(fn, *args, exclude=()) -> tuple[object, list[Saved]]:
    """Run ``fn(*args)``; return its result and the distinct tensors it saved for backward.

    ``exclude``: tensors not to count (e.g. ``model.parameters()``); their storages are skipped.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, Saved] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = Saved(tuple(t.shape), str(t.dtype).replace("torch.", ""), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, list(seen.values())


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct activations ``fn(*args)`` keeps for its backward (see :func:`saved_tensors`)."""
    return sum(s.nbytes for s in saved_tensors(fn, *args, exclude=exclude)[1])
