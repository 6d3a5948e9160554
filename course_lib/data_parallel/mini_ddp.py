"""Data parallelism by hand: averaging gradients, then a small DistributedDataParallel from scratch.

:func:`average_gradients` is data parallelism in four lines: after ``backward()``, all-reduce every
gradient and divide by the world size.  It works, but it waits for the whole backward pass before the
first byte moves, and sends one message per parameter.

:class:`MiniDDP` does what ``torch.nn.parallel.DistributedDataParallel`` does, in a page:

1. at construction it **broadcasts** rank 0's parameters and buffers, so every rank starts equal;
2. it groups the parameters into **buckets** of about ``bucket_cap_mb``, in reverse order of
   registration (the last layer's gradients are computed first);
3. a hook on each parameter fires when its gradient is ready; when a bucket is complete its gradients
   are flattened into one tensor and **all-reduced asynchronously**, while backward goes on computing
   the earlier layers' gradients: communication **overlaps** computation;
4. buckets are launched strictly in order (0, 1, 2, ...), so every rank issues the same collectives in
   the same order even if its gradients become ready in a different order;
5. :meth:`MiniDDP.finish_gradient_synchronization` (call it before ``optimizer.step()``) launches the
   buckets whose parameters received no gradient (an unused parameter counts as zeros), waits for every
   all-reduce, and writes the averages back.  One more all-reduce, of a mask of the parameters each rank
   used, says which were used anywhere: a parameter used on some rank gets the averaged gradient on every
   rank, even where it was unused; only a parameter unused on every rank keeps ``.grad`` ``None``, as in
   torch's DDP with ``find_unused_parameters=True``.

Buffers (BatchNorm's running statistics) are not averaged: like DDP, rank 0's are broadcast at every
forward pass.  The class is the algorithm alone; :class:`course_lib.data_parallel.measure.TimedMiniDDP`
adds the timeline (when each bucket was launched and finished) by overriding :meth:`MiniDDP._launch`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def average_gradients(model: nn.Module) -> None:
    """After backward: make every rank's gradients the average over all ranks."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


class MiniDDP(nn.Module):
    """A data-parallel wrapper with gradient buckets whose all-reduces overlap the backward pass."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module, self.broadcast_buffers = module, broadcast_buffers
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)                     # every rank starts from rank 0's weights
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, size = [], float("inf")
        for p in reversed(params):                           # gradients arrive roughly last layer first
            if size >= bucket_cap_mb * 2**20:                # this bucket is full: open the next one
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]       # gradients each bucket still waits for
        self._next = 0                                       # the next bucket to launch, in order
        self._in_flight = []                                 # (bucket index, flat tensor, work)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=0)
        self._reset()
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._missing[self._bucket_of[p]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, i: int):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, async_op=True)          # returns at once: backward goes on
        self._in_flight.append((i, flat, work))
        self._next = i + 1
        return work

    def finish_gradient_synchronization(self) -> None:
        """Launch what is left (buckets with unused parameters), wait, and write the averages back.

        A parameter used on any rank gets the average on every rank (``.grad`` is set where this rank left it
        ``None``); one unused on every rank keeps ``.grad`` ``None``."""
        while self._next < len(self.buckets):
            self._launch(self._next)
        params = [p for bucket in self.buckets for p in bucket]
        used = torch.tensor([float(p.grad is not None) for p in params])
        dist.all_reduce(used)                                # how many ranks used each parameter
        used_anywhere = dict(zip(params, (used > 0).tolist()))
        world_size = dist.get_world_size()
        for i, flat, work in self._in_flight:
            work.wait()
            flat /= world_size
            pieces = flat.split([p.numel() for p in self.buckets[i]])
            for p, piece in zip(self.buckets[i], pieces):
                if p.grad is not None:
                    p.grad.copy_(piece.view_as(p))
                elif used_anywhere[p]:                       # unused here, used on another rank
                    p.grad = piece.view_as(p).clone()
        self._in_flight = []
