"""Shards of parameters, and the two collectives that move them: all-gather and reduce-scatter.

Every stage of ZeRO cuts each parameter the same way. Flatten it (``numel`` elements), pad it to a
multiple of the world size N, and give rank r the r-th of N equal slices of ``S = ceil(numel / N)``
elements (the last ranks' slices are shorter, or empty, where the padding falls)::

    numel = 10, N = 4, S = 3:   rank 0: [0, 3)   rank 1: [3, 6)   rank 2: [6, 9)   rank 3: [9, 10)

A :class:`FlatGroup` is the parameters of one layer (or one bucket), communicated together: one
all-gather and one reduce-scatter for all of them, not one per tensor (few large messages beat many
small ones, notebook 02). Its buffer has N rows, one per rank; row r is rank r's slices of every
parameter, side by side, each padded to its ``S``. All-gather fills every row from its rank; a
reduce-scatter leaves rank r the sum of everyone's row r.

**Which reduce-scatter.** With NCCL, ``reduce_scatter_single`` (``reduce_scatter_tensor`` before
torch 2.13) is a real reduce-scatter: each rank sends (N-1)/N of the buffer. Gloo accepts it too, but
implements it as an all-reduce of the whole buffer followed by a slice (torch's profiler shows
``gloo:all_reduce`` inside it, notebook 09). So on Gloo we say what really happens: all-reduce, then
keep row r. The result is the same; the traffic is an all-reduce's.

:func:`count_traffic` records every collective issued here, so that a notebook can count the bytes a
training step sends, the way notebook 02 counts them for a ring.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.costmodel import ring_steps_and_bytes

_TRAFFIC: list[list[tuple[str, int]]] = []   # the open count_traffic() logs, innermost last
# torch 2.13 calls these all_gather_single and reduce_scatter_single (the old names warn); 2.11 has only the old.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def require_process_group(what: str) -> None:
    """Raise a clear error when there are no ranks to shard over."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} shards over the ranks of a process group, and none is initialised here. "
                           "Call it inside a rank (a worker run by course_lib.launch.run, or a script under "
                           "torchrun after dist.init_process_group()).")


def real_reduce_scatter() -> bool:
    """Whether the backend has a true reduce-scatter (NCCL) rather than an all-reduce in disguise (Gloo)."""
    from ..hardware import backend_kind
    return backend_kind() == "nccl"


PHASES = ("all-gather {} for the forward", "all-gather {} for the backward", "reduce-scatter the gradients of {}",
          "end the backward pass")


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its qualified name`` (``"blocks.0.weight"``); a tied weight gets its first name."""
    return {id(p): name for name, p in model.named_parameters()}


def agree_on_next_collective(layers: list[list[str]], index: int, phase: int, device: torch.device) -> None:
    """Check that every rank is about to run the same layer collective; raise the same ValueError on all if not.

    A ZeRO collective is one layer's all-gather or reduce-scatter. A parameter used on one rank but not on
    another (a forward that skips a layer on some ranks) makes one rank issue a collective the others do
    not: they would pair different layers' buffers, and hang or crash. So each collective is preceded by a
    tiny all-gather of ``(layer, phase)`` from every rank (8 bytes each, not counted by :func:`count_traffic`).
    Every rank sees the same answer, so every rank raises at once, naming the parameters and the ranks.
    ``layers``: each layer's parameter names; ``index == len(layers)`` with ``phase`` 3 is the end of backward.
    """
    if dist.get_world_size() == 1:
        return
    tag = torch.tensor([index * len(PHASES) + phase], dtype=torch.int64, device=device)
    tags = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    all_gather_single(tags, tag)
    tags = tags.tolist()
    if len(set(tags)) == 1:
        return

    def what(t: int) -> str:
        i, ph = divmod(t, len(PHASES))
        return PHASES[3] if i >= len(layers) else PHASES[ph].format(", ".join(layers[i]))
    plans = "; ".join(f"rank {r} is about to {what(t)}" for r, t in enumerate(tags))
    raise ValueError(f"the ranks disagree on the next collective: {plans}. A parameter used on some ranks but "
                     "not on others (a forward that skips a layer on some ranks) makes their collectives mismatch. "
                     "Every rank must run every layer in every step, in the same order: call the layer on every rank "
                     "(multiply its output by 0 where it should not count).")


@contextmanager
def count_traffic():
    """Record the collectives issued in the block: a list of ``(operation, bytes of the whole buffer)``.

    ``operation`` is ``"all-gather"``, ``"reduce-scatter"``, or ``"all-reduce"`` (Gloo's stand-in for a
    reduce-scatter). :func:`ring_bytes_sent` turns a record into the bytes each rank sends.
    """
    log: list[tuple[str, int]] = []
    _TRAFFIC.append(log)
    try:
        yield log
    finally:
        _TRAFFIC.remove(log)


def _record(operation: str, buffer: torch.Tensor) -> None:
    for log in _TRAFFIC:
        log.append((operation, buffer.numel() * buffer.element_size()))


def ring_bytes_sent(operation: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends for one collective over an ``nbytes`` buffer, done as a ring (notebook 02's count:
    :func:`course_lib.comm.costmodel.ring_steps_and_bytes`)."""
    return ring_steps_and_bytes(operation, nbytes, world_size)[1]


def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The flat range ``[lo, hi)`` of a ``numel``-element parameter that ``rank`` holds."""
    size = math.ceil(numel / world_size)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def owned_parameters(model: nn.Module) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """The model's layers: each module with parameters of its own, and those parameters.

    A parameter registered in two modules (tied weights) belongs to the first, so it is counted once;
    the second module uses it but owns nothing for it.
    """
    seen: set[int] = set()
    layers = []
    for module in model.modules():
        own = [(name, p) for name, p in module._parameters.items() if p is not None and id(p) not in seen]
        seen.update(id(p) for _, p in own)
        if own:
            layers.append((module, own))
    return layers


class FlatGroup:
    """The layout of parameters communicated together, and the two collectives over them."""

    def __init__(self, shapes: list[torch.Size], rank: int | None = None, world_size: int | None = None):
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.widths = [math.ceil(n / self.world_size) for n in self.numels]     # S of each parameter
        self.offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]   # where it sits in a row
        self.row = sum(self.widths)                                               # one rank's slot

    def bounds(self, i: int) -> tuple[int, int]:
        """The flat range of parameter ``i`` this rank holds."""
        return shard_bounds(self.numels[i], self.rank, self.world_size)

    def _columns(self, table: torch.Tensor, i: int) -> torch.Tensor:
        return table[:, self.offsets[i]:self.offsets[i] + self.widths[i]]       # (N, S): rank r's slice in row r

    def all_gather(self, shards: list[torch.Tensor], outputs: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Every rank's ``shards`` (this rank's slices, in order) -> the whole parameters, into ``outputs``.

        ``outputs`` are flat tensors of ``numel`` elements (a parameter's storage); ``dtype`` is the type on
        the wire (a mixed-precision run gathers in its compute type).
        """
        send = torch.zeros(self.row, dtype=dtype, device=shards[0].device)
        for i, s in enumerate(shards):
            send[self.offsets[i]:self.offsets[i] + s.numel()] = s
        table = torch.empty(self.world_size, self.row, dtype=dtype, device=send.device)
        all_gather_single(table.view(-1), send)
        _record("all-gather", table)
        for i, out in enumerate(outputs):
            columns, n, width = self._columns(table, i), self.numels[i], self.widths[i]
            full_rows, rest = divmod(n, width) if width else (0, 0)
            out[:full_rows * width].view(full_rows, width).copy_(columns[:full_rows])
            if rest:
                out[full_rows * width:].copy_(columns[full_rows, :rest])

    def reduce_scatter_mean(self, grads: list[torch.Tensor | None], dtype: torch.dtype) -> list[torch.Tensor]:
        """The average over ranks of every rank's ``grads`` (whole gradients, ``None`` counting as zeros),
        this rank's slice of each, as new fp32 tensors. The sum travels in ``dtype``; the division by
        the world size is done after, in fp32."""
        n_ranks = self.world_size
        device = next((g.device for g in grads if g is not None), None) or torch.device("cpu")
        table = torch.zeros(n_ranks, self.row, dtype=dtype, device=device)
        for i, g in enumerate(grads):
            if g is None:
                continue
            flat, columns, width = g.reshape(-1), self._columns(table, i), self.widths[i]
            full_rows, rest = divmod(flat.numel(), width) if width else (0, 0)
            columns[:full_rows].copy_(flat[:full_rows * width].view(full_rows, width))
            if rest:
                columns[full_rows, :rest].copy_(flat[full_rows * width:])
        mine = torch.empty(self.row, dtype=dtype, device=device)
        if real_reduce_scatter():
            reduce_scatter_single(mine, table.view(-1))               # each rank sends (N-1)/N of the table
            _record("reduce-scatter", table)
        else:
            dist.all_reduce(table)                                    # Gloo: what its reduce-scatter does anyway
            mine.copy_(table[self.rank])
            _record("all-reduce", table)
        out = []
        for i in range(len(grads)):
            lo, hi = self.bounds(i)
            out.append(mine[self.offsets[i]:self.offsets[i] + hi - lo].float() / n_ranks)
        return out
