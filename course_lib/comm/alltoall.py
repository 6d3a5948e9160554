"""The all-to-all, differentiable, and a log of the all-to-alls that ran: it carries tokens to their experts
(notebook 16) and trades a sequence split for a head split (Ulysses, notebook 15).

In an **all-to-all** every rank sends a different piece of its tensor to every rank (itself included) and receives
one piece from each. ``dist.all_to_all_single(out, x, out_splits, in_splits)`` cuts ``x`` along dim 0: the first
``in_splits[0]`` rows go to rank 0, the next ``in_splits[1]`` to rank 1, and so on; ``out`` receives
``out_splits[s]`` rows from each rank ``s``, in rank order. The splits may differ from rank to rank, but what rank
``s`` sends to rank ``d`` must be what ``d`` expects from ``s``: the ranks exchange their counts first.

:class:`AllToAll` makes it differentiable. Its backward is the same exchange run in reverse: the gradient of the
rows rank ``d`` received from ``s`` goes back to ``s``, so the backward is an all-to-all with the two split lists
swapped. (``torch.distributed.nn.functional.all_to_all_single`` did this too; it is deprecated in torch 2.13.)

:class:`AllToAllLog` records each ``all_to_all_single`` a rank runs (its splits and bytes), as
:class:`course_lib.comm.record.CollectiveLog` does for the other collectives; with ``check=True`` it first compares
every rank's splits and raises a :class:`ValueError` that says which pair disagrees, where Gloo would abort.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .record import Phased


class AllToAll(torch.autograd.Function):
    """Forward: send ``in_splits[d]`` rows to each rank ``d``, receive ``out_splits[s]`` from each ``s``.
    Backward: the reverse all-to-all of the gradient (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x, out_splits, in_splits, group=None):
    """Differentiable ``all_to_all_single``: ``in_splits[d]`` rows of ``x`` go to rank ``d``; returns the rows
    received, ``out_splits[s]`` from each rank ``s`` in rank order."""
    return AllToAll.apply(x, out_splits, in_splits, group)


@dataclass(frozen=True)
class Call:
    """One ``all_to_all_single`` on this rank: the rows it sent to each rank and received from each (as given, or
    the even split when no sizes were given), the bytes of a row, and whether split sizes were passed at all."""

    dtype: torch.dtype
    in_splits: tuple
    out_splits: tuple
    row_bytes: int
    phase: str
    splits_given: bool

    def bytes_to_others(self, rank: int) -> int:
        """Bytes this rank sent to the other ranks (what it keeps for itself crosses no link)."""
        return sum(n for d, n in enumerate(self.in_splits) if d != rank) * self.row_bytes


class AllToAllLog(Phased):
    """``with AllToAllLog() as log:`` records every ``dist.all_to_all_single`` issued while active.

    ``check=True`` compares the splits of all ranks before each call (one ``all_gather_object``) and raises a
    ``ValueError`` naming the mismatch: what a rank sends a rank must be what that rank expects.
    """

    def __init__(self, check: bool = False):
        self.calls: list[Call] = []
        self.phase = "forward"
        self.check = check

    def __enter__(self):
        self._original = dist.all_to_all_single

        def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            world = dist.get_world_size(group)
            ins = tuple(int(n) for n in input_split_sizes or ())
            outs = tuple(int(n) for n in output_split_sizes or ())
            if self.check:
                _check_splits(output, input, ins, outs, group)
            rows_in, rows_out = (t.shape[0] if t.dim() else 1 for t in (input, output))
            row = input[0].numel() * input.element_size() if input.dim() and rows_in else 0
            self.calls.append(Call(input.dtype, ins or (rows_in // world,) * world,
                                   outs or (rows_out // world,) * world, row, self.phase, bool(ins or outs)))
            return self._original(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)

        dist.all_to_all_single = recorded
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original


def _check_splits(output, input, ins, outs, group):
    """Raise ``ValueError`` on every rank, with the same message, if the ranks' splits do not fit together."""
    world = dist.get_world_size(group)
    mine = (ins, outs, input.shape[0] if input.dim() else 1, output.shape[0] if output.dim() else 1)
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    if any(not i for i, _, _, _ in every) and len({rows for _, _, rows, _ in every}) > 1:
        raise ValueError("all_to_all_single was called without split sizes, so it cuts each rank's tensor into "
                         f"{world} equal parts, but the ranks hold {[rows for _, _, rows, _ in every]} rows: "
                         "exchange the counts first and pass output_split_sizes and input_split_sizes")
    for r, (r_ins, r_outs, rows_in, rows_out) in enumerate(every):
        for name, splits, rows, what in (("input", r_ins, rows_in, "sends"), ("output", r_outs, rows_out, "receives")):
            if splits and sum(splits) != rows:
                raise ValueError(f"rank {r}'s {name}_split_sizes {list(splits)} add up to {sum(splits)} rows, but its "
                                 f"{name} tensor has {rows}: the {name} splits are the rows this rank {what}. Were the "
                                 "two split lists swapped? all_to_all_single(out, x, output_split_sizes, "
                                 "input_split_sizes) and ep.all_to_all(x, out_splits, in_splits) take the rows "
                                 "received first, the rows sent second")
    for s, (s_ins, _, s_rows, _) in enumerate(every):
        for d, (_, d_outs, _, d_rows) in enumerate(every):
            sent = s_ins[d] if s_ins else s_rows // world
            expected = d_outs[s] if d_outs else d_rows // world
            if sent != expected:
                raise ValueError(f"the split sizes do not match: rank {s} sends {sent} rows to rank {d}, which expects "
                                 f"{expected} from it. A rank cannot know what it will receive: exchange the counts "
                                 "with an all-to-all first, and pass what you received as output_split_sizes")
