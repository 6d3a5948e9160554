"""ZeRO-3, the way FSDP2 does it: parameters sharded too, each layer gathered only while it computes.

After :func:`fully_shard`, a layer holds only this rank's slice of each of its parameters, 1-D, as its
registered parameters: ``model.parameters()`` are the shards, so an element-wise optimizer (SGD, Adam) built
on them keeps 1/N of the state and steps 1/N of the parameters, with no change to its code (a factored one
such as Adafactor, or a global-norm clip, needs the whole tensor: see :mod:`.clip`). Around the compute:

* **forward pre-hook**: all-gather the layer's parameters and put the whole tensors in the layer's
  place (``module._parameters[name]``), so its ``forward`` runs unchanged;
* **forward hook**: put the shards back and free the whole tensors' memory (their storage is resized
  to 0: autograd keeps the tensor objects it saved for backward, now empty); hang a hook on the
  layer's outputs, which fires when backward reaches this layer;
* **pre-backward** (that output hook): all-gather again into the same tensor objects' storage, just
  before autograd uses them;
* **post-backward** (a hook on each whole parameter, after its gradient has been accumulated): once
  the layer's gradients are complete, reduce-scatter them into the shards' ``.grad`` (averaged over
  the ranks) and free the whole parameters and gradients.

So a rank holds the whole parameters of one layer at a time (the largest layer is the peak), plus
1/N of everything. A frozen layer has no gradient to say its backward is done: the gradient of its
inputs does. What is left at the end of backward (a layer with an unused parameter) is finished by an
autograd callback, so gradients are ready when ``backward()`` returns.

``compute_dtype`` (e.g. ``torch.float16``): gather in that type, compute in it (floating inputs of
each layer are cast to it), and reduce-scatter the gradients in it; shards, gradients and optimizer
stay fp32 (the fp32 "master" copy of mixed precision is the shard). Every rank must run the same
layers in the same order, as with DDP: before each collective the ranks check that they agree, and a layer
skipped on some ranks is a ValueError on every rank (:func:`.flat.agree_on_next_collective`), not a hang.
A weight shared by two layers (tied) is gathered with its first owner and stays gathered from its first
use in backward until its gradient is complete.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from .flat import FlatGroup, agree_on_next_collective, owned_parameters, parameter_names, require_process_group


class ShardedLayer:
    """One layer's parameters: this rank's shards, and the whole tensors they are gathered into."""

    def __init__(self, owner: nn.Module, own: list[tuple[str, nn.Parameter]], compute_dtype, state: Zero3State,
                 first_index: int = 0):
        self.names = [name for name, _ in own]
        self.group = FlatGroup([p.shape for _, p in own])
        self.state = state
        self.shards, self.full = [], []
        for i, (_, p) in enumerate(own):
            lo, hi = self.group.bounds(i)
            if p.is_meta:                                # meta-device model: make this rank's slice only
                data = state.init(first_index + i, p.shape, lo, hi).to(device=state.device, dtype=p.dtype)
            else:
                data = p.detach().reshape(-1)[lo:hi].clone()
            self.shards.append(nn.Parameter(data, requires_grad=p.requires_grad))
            full = torch.empty(p.shape, dtype=compute_dtype or p.dtype, device=data.device)
            full.requires_grad_(p.requires_grad)
            full.untyped_storage().resize_(0)            # no memory until gathered
            self.full.append(full)
        self.users: list[tuple[nn.Module, str, int]] = []   # (module, name, index): where each tensor is registered
        self.trainable = {i for i, f in enumerate(self.full) if f.requires_grad}
        self.ready: set[int] = set()
        self.gathered = False
        for i in self.trainable:
            self.full[i].register_post_accumulate_grad_hook(lambda _, i=i: self.grad_ready(i))

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.full)

    @torch.no_grad()
    def gather(self, phase: int = 0) -> None:
        """All-gather the whole parameters (``phase`` 0 for the forward, 1 for the backward)."""
        if self.gathered:
            return
        self.state.agree(self, phase)
        for f in self.full:
            f.untyped_storage().resize_(f.numel() * f.element_size())
        self.group.all_gather(self.shards, [f.data.view(-1) for f in self.full], self.full[0].dtype)
        for module, name, i in self.users:
            module._parameters[name] = self.full[i]      # the layer computes with the whole tensors
        self.gathered = True
        self.state.measure()

    def free(self) -> None:
        if not self.gathered:
            return
        for module, name, i in self.users:
            module._parameters[name] = self.shards[i]
        for f in self.full:
            f.untyped_storage().resize_(0)
        self.gathered = False
        self.state.measure()

    def grad_ready(self, i: int) -> None:
        self.state.in_backward()
        self.ready.add(i)
        if self.ready == self.trainable:
            self.reduce()
            self.free()

    @torch.no_grad()
    def reduce(self) -> None:
        """Average the whole gradients over the ranks, keep this rank's slice, drop the whole ones."""
        self.state.agree(self, 2)
        grads = [f.grad for f in self.full]
        for i, mean in enumerate(self.group.reduce_scatter_mean(grads, self.full[0].dtype)):
            shard = self.shards[i]
            if grads[i] is not None:
                mean = mean.to(shard.dtype)                    # a bf16 model keeps bf16 gradients
                shard.grad = mean if shard.grad is None else shard.grad.add_(mean)
                self.full[i].grad = None
        self.ready.clear()


class Zero3State:
    """What :func:`fully_shard` attaches to the model (``model.zero3``): its layers and the hooks' logic."""

    def __init__(self, model: nn.Module, compute_dtype, init=None, device=None):
        self.compute_dtype, self.init, self.device = compute_dtype, init, torch.device(device or "cpu")
        self.layers: list[ShardedLayer] = []
        self.of_module: dict[nn.Module, list[ShardedLayer]] = {}
        self.callback_queued = False
        self.gathered_bytes = self.peak_gathered_bytes = 0
        layer_of: dict[int, tuple[ShardedLayer, int]] = {}
        names = parameter_names(model)
        self.names = [[names[id(p)] for _, p in own] for _, own in owned_parameters(model)]   # for clear errors
        index = 0                                        # the parameters' order, the same on every rank
        for owner, own in owned_parameters(model):
            if init is None and any(p.is_meta for _, p in own):
                raise ValueError("the model is on the meta device: pass init=, which makes each rank's slice")
            layer = ShardedLayer(owner, own, compute_dtype, self, first_index=index)
            index += len(own)
            self.layers.append(layer)
            layer_of.update({id(p): (layer, i) for i, (_, p) in enumerate(own)})
        for module in model.modules():                   # every module using a parameter, tied ones included
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in layer_of:
                    layer, i = layer_of[id(p)]
                    layer.users.append((module, name, i))
                    module._parameters[name] = layer.shards[i]
                    if layer not in self.of_module.setdefault(module, []):
                        self.of_module[module].append(layer)

    def agree(self, layer: ShardedLayer | None, phase: int) -> None:
        """Every rank is about to run the same collective (``layer`` ``None``: end the backward), else a
        ValueError on every rank (:func:`.flat.agree_on_next_collective`)."""
        index = len(self.layers) if layer is None else self.layers.index(layer)
        agree_on_next_collective(self.names, index, phase, self.layers[0].shards[0].device)

    def measure(self) -> None:
        """Bytes of whole parameters alive right now, read from their storage (not from a counter)."""
        self.gathered_bytes = sum(f.untyped_storage().nbytes() for layer in self.layers for f in layer.full)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def in_backward(self) -> None:
        """Called from every backward hook: make sure the end of this backward pass is handled."""
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self.callback_queued = True

    def end_of_backward(self) -> None:
        for layer in self.layers:                        # the same order on every rank
            if layer.ready:
                layer.reduce()
            layer.free()
        self.callback_queued = False
        if self.layers:
            self.agree(None, 3)

    def pre_forward(self, module, args):
        for layer in self.of_module[module]:
            layer.gather()
            if not layer.trainable and torch.is_grad_enabled():   # frozen: no gradient will say "done"; the
                for t in _tensors(args):                          # inputs' gradients will (they come after)
                    if t.requires_grad:
                        t.register_hook(lambda grad, layer=layer: layer.free())
        return cast_floating(args, self.compute_dtype)

    def post_forward(self, module, args, output):
        for layer in self.of_module[module]:
            layer.free()
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, module=module: self.pre_backward(module))
        return output

    def pre_backward(self, module) -> None:
        self.in_backward()
        for layer in self.of_module[module]:
            layer.gather(phase=1)


def cast_floating(args: tuple, dtype: torch.dtype | None) -> tuple:
    """``args`` with every floating-point tensor cast to ``dtype`` (``None``: unchanged). The input rule of
    mixed precision, also used by the one-process reference that must cast the same way."""
    if dtype is None:
        return args
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):    # a module that returns a dataclass
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name))


def fully_shard(module: nn.Module, compute_dtype: torch.dtype | None = None, init=None, device=None) -> nn.Module:
    """Shard ``module``'s parameters over the ranks (ZeRO-3), in place; returns ``module``.

    Build the optimizer afterwards, on ``module.parameters()`` (the shards). Rank 0's buffers are
    broadcast so that every rank starts with the same. See the module's docstring for what happens.
    A model built on the ``meta`` device (shapes, no memory) needs ``init(index, shape, lo, hi)``: the elements
    ``[lo, hi)`` of parameter number ``index`` flattened (:mod:`.meta_init`); the shards are made on ``device``.
    """
    if any(b.is_meta for b in module.buffers()):
        raise ValueError("materialise the buffers first (module.to_empty, then fill them): fully_shard shards "
                         "parameters only")
    require_process_group("fully_shard")
    if hasattr(module, "zero3"):
        raise ValueError("this module is sharded already (fully_shard was called on it before)")
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating-point type such as torch.float16, got {compute_dtype}")
    with torch.no_grad():
        for b in module.buffers():
            dist.broadcast(b, src=0)
    state = Zero3State(module, compute_dtype, init, device)
    for m in state.of_module:
        m.register_forward_pre_hook(state.pre_forward)
        m.register_forward_hook(state.post_forward)
    module.zero3 = state
    return module


def finish_gradient_synchronization(module: nn.Module) -> None:
    """Reduce-scatter whatever is pending and free every gathered layer (backward already does this at its
    end; call it if you ran backward in a way that skipped it). Collective: call it on every rank."""
    if not hasattr(module, "zero3"):
        raise ValueError("finish_gradient_synchronization needs a module returned by fully_shard")
    module.zero3.end_of_backward()
