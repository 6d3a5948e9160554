"""ZeRO stages 1 and 2: every rank keeps the whole model, but the optimizer's state only for its shard.

Adam keeps two fp32 tensors per parameter (8 bytes), twice the weights themselves. Under DDP every
rank holds all of it, N identical copies. **ZeRO-1** cuts it: rank r keeps the optimizer state of
its slice of every parameter (see :mod:`.flat` for the slicing), and a step becomes

1. average the gradients over the ranks, keeping only this rank's slice (a **reduce-scatter**);
2. step this rank's slices of the parameters (an ordinary optimizer, built on the slices);
3. **all-gather** the updated slices, so that every rank ends the step with every parameter.

A reduce-scatter and an all-gather are the two halves of a ring all-reduce: done that way, ZeRO-1 sends what
DDP sends. :class:`ShardedOptimizer` under DDP is an all-reduce (DDP's) plus an all-gather: 1.5 x DDP's bytes,
like torch's ``ZeroRedundancyOptimizer``; ``shard(model, 1)`` is the reduce-scatter + all-gather form.

Sharding the optimizer matches one process (to rounding) only for an **element-wise** optimizer (SGD, Adam,
Lion: each element's update reads that element's gradient and state alone). A factored one (Adafactor: row and
column statistics) or a global-norm gradient clip needs the whole tensor: :func:`.clip.clip_grad_norm_`
all-reduces the squared norms.

:class:`ShardedOptimizer` is steps 2 and 3 as a drop-in optimizer (what torch's
``ZeroRedundancyOptimizer`` offers): it expects gradients already averaged (by DDP, MiniDDP...) and
leaves them as it finds them. Its slices are views of the parameters, so stepping them in place
updates the parameters' own memory.

:class:`LayerwiseZero1` adds step 1 for a bare model, one layer per collective. :class:`LayerwiseZero2`
moves step 1 into the backward pass: a hook reduce-scatters each layer's gradients as soon as they
are complete and frees the full gradients at once, so gradients too are held at 1/N between steps.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from .flat import FlatGroup, agree_on_next_collective, owned_parameters, parameter_names, require_process_group


class Bucket:
    """Parameters updated together: their layout, and this rank's slice of each (views of the parameters)."""

    def __init__(self, params: list[torch.Tensor]):
        for p in params:
            if not p.is_contiguous():
                raise ValueError("ZeRO slices parameters through flat views: make the parameters contiguous first")
        self.params = params
        self.group = FlatGroup([p.shape for p in params])
        self.shards = [p.detach().view(-1)[slice(*self.group.bounds(i))] for i, p in enumerate(params)]
        for s in self.shards:
            s.requires_grad_(True)                     # a leaf the inner optimizer accepts and steps

    def gather(self) -> None:
        """All-gather the updated slices into every rank's parameters."""
        self.group.all_gather(self.shards, [p.detach().view(-1) for p in self.params], self.params[0].dtype)


def _as_groups(params) -> list[dict]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of parameter-group dicts, like any optimizer's; "
                        "got a single tensor (pass [tensor])")
    params = list(params)
    if not params:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    return [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]


class ShardedOptimizer(Optimizer):
    """ZeRO-1 as a drop-in for an element-wise optimizer: each rank keeps the state of its share of every parameter.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` behaves like
    ``torch.optim.AdamW(model.parameters(), lr=1e-3)`` on every rank (same weights after every step)
    while holding 1/N of its state. Gradients must already be averaged over the ranks (pair it with
    DDP or MiniDDP); they are left as they are. Parameter groups, learning-rate schedulers and
    ``zero_grad`` work as usual; ``state_dict()`` is this rank's share of the state.
    Frozen parameters (``requires_grad=False``) are never stepped, so they are not sharded.
    """

    bucket_cap_mb = 25.0          # parameters gathered in one all-gather, at most about this much

    def __init__(self, params: Iterable, optimizer_class: type[Optimizer], **optimizer_kwargs):
        require_process_group(type(self).__name__)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be an optimizer class such as torch.optim.AdamW, "
                            f"got {optimizer_class!r}")
        groups = _as_groups(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.buckets: list[Bucket] = []
        inner_groups = []
        for group in groups:
            group["params"] = list(group["params"])
            trainable = [p for p in group["params"] if p.requires_grad]
            buckets = [Bucket(b) for b in self._bucket(trainable)]
            self.buckets += buckets
            inner_groups.append({**group, "params": [s for b in buckets for s in b.shards]})
        self.inner = optimizer_class(inner_groups, **optimizer_kwargs)   # steps this rank's slices only
        super().__init__(groups, self.inner.defaults)

    def _bucket(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive parameters of one dtype and device, about ``bucket_cap_mb`` per bucket."""
        cap, buckets, current, size = self.bucket_cap_mb * 2**20, [], [], 0
        for p in params:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                buckets.append(current)                 # one collective moves one dtype
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    def _shard_gradients(self) -> None:
        """Step 1. Gradients are averaged already: each slice's gradient is a view of its parameter's."""
        for b in self.buckets:
            for i, (p, s) in enumerate(zip(b.params, b.shards)):
                s.grad = None if p.grad is None else p.grad.view(-1)[slice(*b.group.bounds(i))]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})   # e.g. a scheduler's new lr
        self._shard_gradients()
        self.inner.step()                      # step 2: this rank's slices, in place in the parameters
        for b in self.buckets:
            b.gather()                         # step 3: everyone's slices, into everyone's parameters
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """This rank's share of the optimizer state (save one per rank; load it on the same rank)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)


class LayerwiseZero1(ShardedOptimizer):
    """ZeRO-1 for a bare model: local gradients, reduce-scattered layer by layer when ``step()`` runs.

    After the step, ``p.grad`` holds the average over ranks in this rank's slice (that is where the
    reduce-scatter writes) and this rank's own gradient elsewhere, which ZeRO-1 never needs again.
    """

    def __init__(self, model: nn.Module, optimizer_class: type[Optimizer], **optimizer_kwargs):
        self._layers = [[p for _, p in own if p.requires_grad] for _, own in owned_parameters(model)]
        names = parameter_names(model)
        self._names = [[names[id(p)] for p in layer] for layer in self._layers if layer]   # one per bucket
        super().__init__(model.parameters(), optimizer_class, **optimizer_kwargs)

    def _bucket(self, params):
        return [layer for layer in self._layers if layer]        # one collective per layer

    def _agree(self, k: int, phase: int) -> None:
        """Every rank is about to reduce bucket ``k`` (``len(buckets)``: to end), else a clear error on all."""
        if self.buckets:
            agree_on_next_collective(self._names, k, phase, self.buckets[0].shards[0].device)

    def _shard_gradients(self) -> None:
        for k, b in enumerate(self.buckets):
            grads = [p.grad for p in b.params]
            if all(g is None for g in grads):
                continue
            self._agree(k, 2)                           # a layer with no gradient on some ranks only: an error
            dtype = next(g.dtype for g in grads if g is not None)
            averaged = b.group.reduce_scatter_mean(grads, dtype)
            for i, (p, s, mean) in enumerate(zip(b.params, b.shards, averaged)):
                if p.grad is not None:
                    s.grad = p.grad.view(-1)[slice(*b.group.bounds(i))].copy_(mean)
        self._agree(len(self.buckets), 3)


class LayerwiseZero2(LayerwiseZero1):
    """ZeRO-2: each layer's gradients are reduce-scattered as soon as backward has produced all of them,
    and the full gradients are freed right away: between steps a rank holds 1/N of the gradients.

    A hook on every parameter (``register_post_accumulate_grad_hook``) notes that its gradient is
    ready; the last one of a layer triggers the reduce-scatter. Layers with a parameter that got no
    gradient are reduce-scattered at the end of backward (an autograd callback), in layer order on
    every rank, so that the ranks' collectives always match. A layer with gradients on some ranks only (a
    forward that skips it elsewhere) is a ValueError on every rank (:func:`.flat.agree_on_next_collective`).
    """

    def __init__(self, model: nn.Module, optimizer_class: type[Optimizer], **optimizer_kwargs):
        super().__init__(model, optimizer_class, **optimizer_kwargs)
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._callback_queued = False
        for k, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(lambda _, k=k, i=i: self._grad_ready(k, i))

    def _grad_ready(self, k: int, i: int) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._ready[k].add(i)
        if len(self._ready[k]) == len(self.buckets[k].params):
            self._reduce(k)

    @torch.no_grad()
    def _reduce(self, k: int) -> None:
        self._agree(k, 2)
        b = self.buckets[k]
        grads = [p.grad for p in b.params]
        dtype = next(g.dtype for g in grads if g is not None)
        for p, s, mean in zip(b.params, b.shards, b.group.reduce_scatter_mean(grads, dtype)):
            if p.grad is not None:
                mean = mean.to(s.dtype)                                  # a bf16 model keeps bf16 gradients
                s.grad = mean if s.grad is None else s.grad.add_(mean)   # accumulates over backward passes
                p.grad = None                                            # the full gradient is freed now
        self._ready[k].clear()

    def _end_of_backward(self) -> None:
        for k, ready in enumerate(self._ready):
            if ready:
                self._reduce(k)
        self._callback_queued = False
        self._agree(len(self.buckets), 3)

    def _shard_gradients(self) -> None:
        """Nothing left to do: backward has reduce-scattered every gradient."""
