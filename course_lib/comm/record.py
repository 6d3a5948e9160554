"""Collectives recorded as they run, with their size: :class:`CollectiveLog` (notebooks 10 to 12 and 14).

:class:`CollectiveLog` is a ``TorchDispatchMode``: while it is active it sees every operator that goes through
PyTorch's dispatcher, including the collectives that ``torch.distributed`` issues (``c10d.allreduce_``...) and those
DTensor issues (``_c10d_functional.all_reduce``...). So it counts from-scratch code and PyTorch's own
(``parallelize_module``, FSDP2) alike. An operator on DTensors is first handed back to DTensor (a mode runs before a
tensor subclass), so that the collectives DTensor runs *inside* it (the norm of a ``Partial`` gradient...) come back
here and are counted too, as ``torch.distributed.tensor.debug.CommDebugMode`` does. What it cannot see: a collective
issued from C++ (DDP's built-in all-reduce: register ``allreduce_hook`` to count it, as
:mod:`course_lib.precision.wire` does), and it leaves out coalesced operations.

:meth:`CollectiveLog.summary` prices each one as a ring (:func:`.costmodel.ring_steps_and_bytes`): the bytes of
the ring algorithm, not what a backend sends (Gloo, for one, runs a reduce-scatter as an all-reduce).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .costmodel import ring_steps_and_bytes

KINDS = {"allreduce": "all-reduce", "all_reduce": "all-reduce", "allgather": "all-gather",
         "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",   # checked first: it holds "scatter"
         "broadcast": "broadcast", "scatter": "scatter", "alltoall": "all-to-all", "all_to_all": "all-to-all"}


@dataclass(frozen=True)
class Collective:
    """One collective: its kind, the whole tensor's bytes, and whether it ran in the forward or backward pass."""

    kind: str
    nbytes: int
    phase: str


COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def kind_of(op_name: str) -> str | None:
    """``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"broadcast"``, ``"scatter"`` or ``"all-to-all"``
    for an operator named like ``c10d::allreduce_`` (``distribute_tensor`` scatters or broadcasts rank 0's copy);
    ``None`` for anything else. Only the communication libraries' operators count: FSDP2's local
    ``fsdp::all_gather_copy_in`` (a copy into the send buffer) says "all_gather" but sends nothing."""
    namespace, _, rest = op_name.partition("::")
    if namespace not in COMM_NAMESPACES:
        return None
    name = rest.split(".")[0].lower()
    if "coalesced" in name:
        return None
    return next((kind for key, kind in KINDS.items() if key in name), None)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def nbytes_of(args, out) -> int:
    """The bytes of a collective's whole buffer: the largest argument (or output), a list counted as the sum of
    its tensors. So the list forms count like the one-tensor forms: ``dist.all_gather(parts, t)`` is the bytes of
    all of ``parts``, ``dist.reduce_scatter(t, chunks)`` the bytes of all the chunks."""
    return max((sum(t.numel() * t.element_size() for t in _tensors(a)) for a in (*args, out)), default=0)


class Phased:
    """What the course's logs share: ``with log.during("backward"): ...`` labels what runs inside with a phase
    (``self.phase``), and the previous label comes back after it."""

    phase = "forward"

    @contextmanager
    def during(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = previous


class CollectiveLog(Phased, TorchDispatchMode):
    """Records each collective run while active; ``with log.during("backward"): loss.backward()`` labels them."""

    def __init__(self):
        super().__init__()
        self.records: list[Collective] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented   # DTensor runs it, and its collectives on local tensors come back here
        out = func(*args, **(kwargs or {}))
        kind = kind_of(func.name())
        if kind is not None:
            self.records.append(Collective(kind, nbytes_of(args, out), self.phase))
        return out

    def summary(self, world_size: int) -> dict:
        """Per phase: the collectives' kinds, and the bytes each rank sends (ring) in total."""
        out: dict = {}
        for r in self.records:
            entry = out.setdefault(r.phase, {"collectives": [], "bytes_sent": 0.0})
            entry["collectives"].append(r.kind)
            entry["bytes_sent"] += ring_steps_and_bytes(r.kind, r.nbytes, world_size)[1]
        return out
