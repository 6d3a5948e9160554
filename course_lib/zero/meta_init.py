"""ZeRO-3 without ever holding the whole model: build on ``meta``, shard, make each rank's slice (notebook 09).

A model built under ``torch.device("meta")`` has every parameter's shape and dtype and no memory. Sharding
it needs no values; then each rank makes only the elements of its own slice. For every rank to agree with
one process, the value of an element must not depend on who makes it: :func:`block_init` draws each
parameter in blocks of ``BLOCK`` elements, block j from its own generator (seeded by the parameter's number
and j), so a rank draws only the blocks its slice touches. (FSDP2 does the same job with ``to_empty`` and
``reset_parameters`` on sharded DTensors, notebook 10; DTensor's shard-offset random numbers are for CUDA-like
devices, not checked here.)

:class:`LargestTensor` watches every operator: the largest real (not meta) tensor any of them returned, and the
peak of the bytes alive at once, which tells a model built on meta (this rank's shards plus one parameter's
buffer) from one built whole and then sharded (the whole model).
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .api import full_state_dict
from .stage3 import fully_shard
from .training import OPTIMIZERS, batches, build, loss_fn

BLOCK = 64


def block_init(seed: int = 0, std_of=lambda shape: 0.0 if len(shape) < 2 else 1 / math.sqrt(shape[-1])):
    """``init(index, shape, lo, hi)`` for :func:`..fully_shard`: elements ``[lo, hi)`` of parameter ``index``,
    normal with standard deviation ``std_of(shape)`` (weights 1/sqrt(fan-in), biases zero by default)."""
    def init(index: int, shape: torch.Size, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo)
        for j in range(lo // BLOCK, math.ceil(hi / BLOCK)):
            g = torch.Generator().manual_seed(seed * 1_000_003 + index * 10_007 + j)
            block = torch.randn(BLOCK, generator=g) * std_of(shape)
            a, b = max(lo, j * BLOCK), min(hi, (j + 1) * BLOCK)
            out[a - lo:b - lo] = block[a - j * BLOCK:b - j * BLOCK]
        return out
    return init


def materialise_whole(model: nn.Module, init) -> nn.Module:
    """What one process does: ``to_empty`` on the CPU, then every parameter filled whole by ``init``."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, p in enumerate(p for _, own in _owned(model) for _, p in own):
            p.view(-1).copy_(init(index, p.shape, 0, p.numel()))
    return model


def _owned(model):
    from .flat import owned_parameters
    return owned_parameters(model)


class LargestTensor(TorchDispatchMode):
    """While active: ``largest``, the bytes of the largest real (not meta) tensor any operator returned, and
    ``peak``, the most bytes alive at once of the real storages operators made meanwhile (a storage lives as
    long as any tensor or parameter on it; its size is read as each operator returns, so a storage resized to
    nothing counts nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = self.peak = 0
        self._storages: list[weakref.ref] = []

    def live_bytes(self) -> int:
        self._storages = [r for r in self._storages if r() is not None]
        return sum(r().nbytes() for r in self._storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                self.largest = max(self.largest, storage.nbytes())
                if all(r() is not storage for r in self._storages):
                    self._storages.append(weakref.ref(storage))
        self.peak = max(self.peak, self.live_bytes())
        return out


def _train(model, step_model, optimizer, rank: int, world_size: int, steps: int, batch: int = 4):
    for x, y in batches("mlp", world_size * batch, steps):
        mine = slice(rank * batch, (rank + 1) * batch)
        optimizer.zero_grad()
        loss_fn("mlp", step_model(x[mine]), y[mine]).backward()
        optimizer.step()


def meta_worker(rank: int, world_size: int, steps: int = 3, on_meta: bool = True) -> dict:
    """The MLP built on ``meta``, sharded and made slice by slice, trained ``steps`` AdamW steps: the largest
    tensor this rank made while building and sharding, the most bytes alive at once meanwhile (``peak bytes``),
    the parameters' bytes it holds, the whole model's bytes, and the trained full state dict. ``on_meta=False``:
    the naive way, the whole model built on this rank, then sharded."""
    init = block_init()
    with LargestTensor() as watch:
        if on_meta:
            with torch.device("meta"):
                model = build("mlp")
        else:
            model = materialise_whole(build("mlp"), init)
        whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest_parameter = max(p.numel() * p.element_size() for p in model.parameters())
        fully_shard(model, init=init)
    cls, kwargs = OPTIMIZERS["adamw"]
    _train(model, model, cls(model.parameters(), **kwargs), rank, world_size, steps)
    return {"largest tensor made": watch.largest, "peak bytes": watch.peak, "largest parameter": largest_parameter,
            "parameter bytes held": sum(p.numel() * p.element_size() for p in model.parameters()),
            "whole model": whole_bytes, "state": full_state_dict(model)}


def meta_reference(world_size: int, steps: int = 3) -> dict:
    """One process: the same model made whole by the same ``init``, trained on the global batch."""
    with torch.device("meta"):
        model = build("mlp")
    materialise_whole(model, block_init())
    cls, kwargs = OPTIMIZERS["adamw"]
    _train(model, model, cls(model.parameters(), **kwargs), 0, 1, steps, batch=4 * world_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
