"""Every message of a step, by the mesh dimension it runs in: :class:`GroupLog`.

:class:`course_lib.comm.record.CollectiveLog` counts collectives but does not say *which group* ran them, and it
leaves out point-to-point messages. On a 3-D mesh both matter: the same all-gather means FSDP2 in the dp group
and sequence parallelism in the tp group, and pipelining talks only by ``send``/``recv``. :class:`GroupLog` is the
same kind of ``TorchDispatchMode``, which also reads the process group each operator was given:

* ``torch.distributed``'s own operators (``c10d::_allgather_base_``, ``c10d::send``, ``c10d::recv_``...) take the
  group as an object (``ProcessGroup.unbox`` turns it back into one, and its ``group_name`` says which);
* DTensor's functional collectives (``_c10d_functional::all_gather_into_tensor``...) take the group's name.

Each record is ``(dimension, kind, phase, bytes)``. The phase is ``"backward"`` while autograd's engine runs a
backward pass (the schedule runs one per micro-batch), ``"forward"`` inside ``with log.during("forward")`` (the
worker marks its stage's forward so), and ``"between"`` otherwise: in the schedule itself, outside any pass (the
pipeline's sends and receives, FSDP2's reduce-scatters at the end of the step).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.record import COMM_NAMESPACES, Phased, kind_of

POINT_TO_POINT = {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}


@dataclass(frozen=True)
class Message:
    """One collective or point-to-point message: the mesh dimension, its kind, its phase, its tensors' bytes."""

    dim: str
    kind: str
    phase: str
    nbytes: int


def message_kind(op_name: str) -> str | None:
    """``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"`` (:func:`course_lib.comm.record.kind_of`), ``"send"``
    or ``"recv"``; ``None`` for an operator that sends nothing."""
    namespace, _, rest = op_name.partition("::")
    if namespace in COMM_NAMESPACES and rest.split(".")[0] in POINT_TO_POINT:
        return POINT_TO_POINT[rest.split(".")[0]]
    return kind_of(op_name)


def _group_name(args, names) -> str | None:
    """The name of the process group among ``args``: an object (c10d) or one of ``names`` (functional)."""
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).group_name
            except (RuntimeError, TypeError):
                continue
        if isinstance(a, str) and a in names:     # not the reduce op ("sum"), which is a string too
            return a
    return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(kind: str, args, out) -> int:
    """A send's or receive's tensors; for a collective, its largest tensor (the whole one, as CollectiveLog)."""
    if kind in ("send", "recv"):
        return sum(t.numel() * t.element_size() for t in _tensors(args[0]))
    return max((t.numel() * t.element_size() for t in _tensors((args, out))), default=0)


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)   # -1 outside a backward pass
    return current is not None and current() != -1


class GroupLog(Phased, TorchDispatchMode):
    """Records every message while active, labelled with the mesh dimension of its group.

    ``dims``: ``{dimension: process group}``, e.g. ``{d: mesh[d].get_group() for d in ("pp", "dp", "tp")}``; a
    message in any other group is labelled ``"other"``.
    """

    def __init__(self, dims: dict):
        super().__init__()
        self.names = {group.group_name: dim for dim, group in dims.items()}
        self.records: list[Message] = []
        self.phase = "between"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented   # DTensor runs it; the collectives it issues on local tensors come back here
        out = func(*args, **(kwargs or {}))
        kind = message_kind(func.name())
        if kind is not None:
            dim = self.names.get(_group_name([*args, *(kwargs or {}).values()], self.names), "other")
            phase = "backward" if _in_backward() else self.phase
            self.records.append(Message(dim, kind, phase, _nbytes(kind, args, out)))
        return out

    def counts(self, by_phase: bool = False) -> dict:
        """``{dimension: {kind: n}}`` (with ``by_phase``: ``{dimension: {phase: {kind: n}}}``), sorted by name."""
        out: dict = {}
        for r in self.records:
            where = out.setdefault(r.dim, {})
            if by_phase:
                where = where.setdefault(r.phase, {})
            where[r.kind] = where.get(r.kind, 0) + 1
        return _sorted(out)

    def bytes(self) -> dict:
        """``{dimension: {kind: bytes}}``: the tensors' bytes (a collective's larger side: the whole tensor)."""
        total: Counter = Counter()
        for r in self.records:
            total[r.dim, r.kind] += r.nbytes
        out: dict = {}
        for (dim, kind), n in total.items():
            out.setdefault(dim, {})[kind] = n
        return _sorted(out)


def _sorted(d):
    return {k: _sorted(v) for k, v in sorted(d.items())} if isinstance(d, dict) else d
