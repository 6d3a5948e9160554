"""The communication operators of tensor parallelism, as autograd functions (Megatron-LM's ``f`` and ``g``).

A layer split across the ranks of a group needs communication at its two edges, and the backward pass of each
edge is the *conjugate* of its forward:

============================  ==========================  ==========================
operator                      forward                     backward
============================  ==========================  ==========================
``f`` (enter a split region)  identity (copy)             all-reduce the gradient
``g`` (leave a split region)  all-reduce the partial sums identity
============================  ==========================  ==========================

Why: every rank feeds the *same* input to its slice of a column-split layer, so the input's gradient is the
sum of what each slice sends back (``f``'s backward all-reduces); a row-split layer's ranks each produce a
partial sum of the output, which ``g`` adds up, and the sum's gradient goes unchanged to each term.

``g``'s identity backward rests on a premise: the gradient that reaches ``g`` is the same on every rank (the
layers after it are whole and identical everywhere). A dropout after ``g`` that draws a different mask on each
rank (a seed per rank) breaks exactly that: the gradients differ and so do the ranks' weights, silently
(:mod:`.random` says which dropouts must agree across ranks).

Sequence parallelism (:mod:`.sequence`) replaces the all-reduce by its two halves, on the sequence
dimension: :func:`gather_sequence` (all-gather forward, reduce-scatter backward) where ``f`` was, and
:func:`reduce_scatter_sequence` (reduce-scatter forward, all-gather backward) where ``g`` was.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor all-gather and reduce-scatter (the old names warn);
# releases before it may have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` (the default group when ``None``) and the group's size.

    Raises ``ValueError`` when no process group is initialised or this process is not in ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tensor parallelism needs a process group: run inside course_lib.launch.run(...) or "
                         "call torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it was "
                         "given: build the layer only on the group's ranks")
    return rank, dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()   # never sum into a tensor autograd or the caller may still read
    dist.all_reduce(out, group=group)
    return out


class CopyToParallelRegion(torch.autograd.Function):
    """``f``: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """``g``: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` unchanged; its gradient summed over ``group`` in backward."""
    return CopyToParallelRegion.apply(x, group)


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region: the sum of ``x`` over ``group``; the gradient passes unchanged."""
    return ReduceFromParallelRegion.apply(x, group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank 0's first)."""
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()             # the collective works on dimension 0
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()   # contiguous: the layers after it share it instead of copying it


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice of the sum along ``dim``."""
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % n:
        raise ValueError(f"the sequence length {front.shape[0]} does not divide by the {n} ranks of the group")
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (sequence parallelism's ``f``)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward (sequence parallelism's ``g``)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor along the sequence; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        rank, n = group_rank_and_size(group)
        if x.shape[dim] % n:
            raise ValueError(f"the sequence length {x.shape[dim]} does not divide by the {n} ranks of the group")
        return x.chunk(n, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Every rank's sequence slice, concatenated along ``dim``; backward: reduce-scatter the gradient."""
    return GatherFromSequenceRegion.apply(x, dim, group)


def reduce_scatter_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum over ranks; backward: all-gather the gradient."""
    return ReduceScatterToSequenceRegion.apply(x, dim, group)


def scatter_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """This rank's slice along ``dim`` of a tensor every rank holds whole; backward: all-gather."""
    return ScatterToSequenceRegion.apply(x, dim, group)
