"""Column- and row-parallel linear layers, built from a full ``nn.Linear`` that every rank holds alike.

``nn.Linear`` computes ``y = x @ W.T + b`` with ``W`` of shape (out_features, in_features). On N ranks:

* **column-parallel** (:func:`column_parallel`): rank r keeps rows ``r*out/N .. (r+1)*out/N`` of ``W`` (and
  of ``b``): a slice of the *output* features. It takes the full input and returns its slice of the output;
  no communication forward, one all-reduce of the input's gradient backward (the operator ``f``).
* **row-parallel** (:func:`row_parallel`): rank r keeps columns ``r*in/N .. (r+1)*in/N`` of ``W``: a slice of
  the *input* features. It takes its slice of the input, computes a partial sum of the full output, and
  the all-reduce ``g`` adds the partial sums; the bias, whole on every rank, is added once, after it.

Column then row (an MLP's ``up`` then ``down``) needs nothing between them: the column layer's output slice
is exactly the row layer's input slice. One all-reduce forward, one backward, for the pair.

``entry`` / ``exit`` choose the operator at the edge: ``"copy"`` (``f``) / ``"reduce"`` (``g``) for tensor
parallelism, ``"gather"`` / ``"reduce_scatter"`` along the sequence for sequence parallelism, ``"none"`` for
a layer whose input already went through ``f`` (attention's ``q``, ``k`` and ``v`` share one).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .operators import f, g, gather_sequence, group_rank_and_size, reduce_scatter_sequence

ENTRIES = ("copy", "gather", "none")
EXITS = ("reduce", "reduce_scatter")


def shard_range(size: int, rank: int, world_size: int, what: str = "size") -> slice:
    """Rank ``rank``'s contiguous slice of ``size`` items split evenly over ``world_size`` ranks.

    Raises ``ValueError`` naming ``what``, the size and the ranks when ``size`` does not divide evenly.
    """
    if size % world_size:
        raise ValueError(f"{what} {size} does not divide by the {world_size} ranks of the group: "
                         f"make {what} a multiple of {world_size}, or use a group whose size divides it")
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def _check_linear(linear) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected an nn.Linear (the full layer, the same on every rank), got {type(linear).__name__}")


def _parameter(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """This rank's slice of a Linear's output features. Full input in, this rank's output slice out."""

    def __init__(self, linear: nn.Linear, group=None, entry: str = "copy"):
        super().__init__()
        _check_linear(linear)
        if entry not in ENTRIES:
            raise ValueError(f"entry must be one of {ENTRIES}, got {entry!r}")
        self.group, self.entry = group, entry
        self.rank, self.world_size = group_rank_and_size(group)
        rows = shard_range(linear.out_features, self.rank, self.world_size, "out_features")
        self.in_features, self.out_features = linear.in_features, rows.stop - rows.start
        self.full_out_features = linear.out_features
        self.weight = _parameter(linear.weight[rows], linear.weight)
        self.bias = None if linear.bias is None else _parameter(linear.bias[rows], linear.bias)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The slice of the full layer's ``name`` (``"weight"`` or ``"bias"``, or its gradient) this rank holds."""
        rows = shard_range(self.full_out_features, self.rank, self.world_size)
        return full[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"column_parallel expects the full input, {self.in_features} features on its last "
                             f"dimension; got shape {tuple(x.shape)}")
        if self.entry == "copy":
            x = f(x, self.group)
        elif self.entry == "gather":
            x = gather_sequence(x, 1, self.group)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (of {self.full_out_features}), "
                f"rank={self.rank}/{self.world_size}, entry={self.entry}, bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """This rank's slice of a Linear's input features. Input slice in, full output (summed over ranks) out."""

    def __init__(self, linear: nn.Linear, group=None, exit: str = "reduce"):
        super().__init__()
        _check_linear(linear)
        if exit not in EXITS:
            raise ValueError(f"exit must be one of {EXITS}, got {exit!r}")
        self.group, self.exit = group, exit
        self.rank, self.world_size = group_rank_and_size(group)
        cols = shard_range(linear.in_features, self.rank, self.world_size, "in_features")
        self.in_features, self.out_features = cols.stop - cols.start, linear.out_features
        self.full_in_features = linear.in_features
        self.weight = _parameter(linear.weight[:, cols], linear.weight)
        self.bias = None if linear.bias is None else _parameter(linear.bias, linear.bias)  # whole, added once
        if self.bias is not None and exit == "reduce_scatter":
            self.bias.sequence_parallel = True   # added to a sequence slice: its gradient is a partial sum

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The slice of the full layer's ``name`` (``"weight"`` or ``"bias"``, or its gradient) this rank holds."""
        return full[:, shard_range(self.full_in_features, self.rank, self.world_size)] if name == "weight" else full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"row_parallel expects this rank's slice of the input, {self.in_features} of the "
                             f"{self.full_in_features} features on its last dimension; got shape {tuple(x.shape)}")
        partial = F.linear(x, self.weight)                 # this rank's share of every output
        y = g(partial, self.group) if self.exit == "reduce" else reduce_scatter_sequence(partial, 1, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.full_in_features}), out_features={self.out_features}, "
                f"rank={self.rank}/{self.world_size}, exit={self.exit}, bias={self.bias is not None}")


def column_parallel(linear: nn.Linear, group=None) -> ColumnParallelLinear:
    """From a full ``nn.Linear`` (the same on every rank of ``group``), this rank's slice of its output features.

    The module takes the full input and returns this rank's slice of the output. ``group``: the ranks that
    share the layer (the default process group when ``None``). A number of output features that does not
    divide by the group's size is a ``ValueError``.
    """
    return ColumnParallelLinear(linear, group)


def row_parallel(linear: nn.Linear, group=None) -> RowParallelLinear:
    """From a full ``nn.Linear`` (the same on every rank of ``group``), this rank's slice of its input features.

    The module takes this rank's slice of the input and returns the full output, summed over the ranks (the
    same on every rank). A number of input features that does not divide by the group's size is a ``ValueError``.
    """
    return RowParallelLinear(linear, group)
