"""What tensor parallelism sends: every collective of a forward and a backward, recorded with its size.

:class:`CollectiveLog` is a ``TorchDispatchMode``: while it is active it sees every operator that runs,
including the collectives that ``torch.distributed`` issues (``c10d.allreduce_``...) and those DTensor issues
(``_c10d_functional.all_reduce``...). So it counts the from-scratch layers and ``parallelize_module``'s alike.
An operator on DTensors is first handed back to DTensor (a mode runs before a tensor subclass), so that the
collectives DTensor runs *inside* it (the norm of a ``Partial`` gradient...) come back here and are counted too,
as ``torch.distributed.tensor.debug.CommDebugMode`` does.

Bytes each rank sends, for a collective over N ranks of a tensor of n bytes (the whole tensor: the all-gather's
output, the reduce-scatter's input), done as a ring as in notebook 02
(:func:`course_lib.comm.costmodel.steps_and_volume`):

* all-reduce: 2(N-1)/N · n in 2(N-1) steps;
* all-gather, reduce-scatter: each is one half of the ring all-reduce, (N-1)/N · n in N-1 steps.

The α-β model of notebook 02 then prices each one (:func:`course_lib.comm.costmodel.predict`). These are the
bytes of the ring algorithm, not what a backend sends: Gloo, for one, runs a reduce-scatter as an all-reduce
(notebook 08 shows it).

That is why sequence parallelism's all-gather + reduce-scatter costs what tensor parallelism's all-reduce did.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.costmodel import ring_steps_and_bytes  # the notebooks count with it from here too

KINDS = {"allreduce": "all-reduce", "all_reduce": "all-reduce", "allgather": "all-gather",
         "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective: its kind, the whole tensor's bytes, and whether it ran in the forward or backward pass."""

    kind: str
    nbytes: int
    phase: str


COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def kind_of(op_name: str) -> str | None:
    """``"all-reduce"``, ``"all-gather"`` or ``"reduce-scatter"`` for an operator named like ``c10d::allreduce_``;
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


class CollectiveLog(TorchDispatchMode):
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
            sizes = [t.numel() * t.element_size() for t in _tensors((args, out))]
            self.records.append(Collective(kind, max(sizes, default=0), self.phase))
        return out

    @contextmanager
    def during(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = previous

    def summary(self, world_size: int) -> dict:
        """Per phase: the collectives' kinds, and the bytes each rank sends (ring) in total."""
        out: dict = {}
        for r in self.records:
            entry = out.setdefault(r.phase, {"collectives": [], "bytes_sent": 0.0})
            entry["collectives"].append(r.kind)
            entry["bytes_sent"] += ring_steps_and_bytes(r.kind, r.nbytes, world_size)[1]
        return out


def collectives_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]], cfg=None,
                       batch: int = 2, seed: int = 0) -> dict:
    """For each ``(kind, layout, sequence_parallel)`` (see :mod:`.check`): the collectives of one forward, one
    backward and the gradients' synchronisation of the split block, as ``[(kind, bytes, phase), ...]``.

    The last phase, ``"gradient sync"``, is sequence parallelism's all-reduce of the partial gradients: the
    from-scratch layers' :func:`~.sequence.sync_sequence_parallel_grads`; DTensor's deferred reduction of its
    ``Partial`` gradients, asked for by :func:`.dtensor.local_grad` (as an optimizer's step would).
    """
    from .. import hardware
    from ..models.transformer import TransformerConfig
    from . import dtensor as D
    from .check import split, unsplit
    from .sequence import sync_sequence_parallel_grads

    cfg = cfg or TransformerConfig()
    device = hardware.rank_device()
    mesh = None
    if any(layout != "scratch" for _, layout, _ in cases):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for kind, layout, sp in cases:
        part = split(kind, unsplit(kind, cfg, seed).to(device), layout, sp, mesh)
        x = torch.randn(batch, cfg.seq_len // (world_size if sp else 1), cfg.dim, device=device, requires_grad=True)
        log = CollectiveLog()
        with log:
            y = D.local(part(x))
            with log.during("backward"):
                y.sum().backward()
            with log.during("gradient sync"):
                if layout == "scratch":
                    sync_sequence_parallel_grads(part)
                else:
                    for p in part.parameters():
                        D.local_grad(p)
        out[kind, layout, sp] = [(r.kind, r.nbytes, r.phase) for r in log.records]
    return out
