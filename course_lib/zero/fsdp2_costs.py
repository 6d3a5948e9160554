"""What FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps and sends, counted on CPU ranks: the order of its
backward collectives (prefetching), the root module's ``reshard_after_forward``, the bytes a parameter costs under
mixed precision, gradient accumulation without a reduce-scatter per micro-batch, and HSDP (building on ``meta`` is
:mod:`.fsdp2_meta`). Every ``fully_shard`` gets ``mesh=`` (:func:`.fsdp2.mesh`, on the rank's device): without it
FSDP2 builds its mesh on ``cuda`` wherever a GPU is visible, even under Gloo.

Collectives are recorded by :class:`~course_lib.comm.record.CollectiveLog` (the communication library's operators
only). Whole (unsharded) gradients between micro-batches are read from FSDP2's per-parameter state
(``FSDPParam``), the one place they live: :func:`whole_gradient_bytes` says ``None`` where a torch version names
them differently.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.record import CollectiveLog
from ..hardware import rank_device
from .fsdp2 import apply_fsdp2, force_sum_on_gloo, fsdp2_full_state_dict, fsdp_units, mesh, unsharded_bytes


class Block(nn.Module):
    """Two ``width`` x ``width`` Linear layers with a ReLU between them and a residual connection."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class BlockNet(nn.Module):
    """``depth`` blocks, then a ``head`` that the root owns itself: the shape of a transformer's stack."""

    def __init__(self, width: int = 32, depth: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def in_flight(records, phase: str = "backward") -> list[int]:
    """After each collective of ``phase``: how many units are gathered and not yet reduce-scattered (a unit's
    whole weights are freed right before its gradient's reduce-scatter)."""
    alive, out = 0, []
    for r in records:
        if r.phase == phase:
            alive += {"all-gather": 1, "reduce-scatter": -1}.get(r.kind, 0)
            out.append(alive)
    return out


def order_worker(rank: int, world_size: int, model_fn) -> dict:
    """One forward and backward of ``apply_fsdp2(model_fn())``: its collectives in order, per phase."""
    model = apply_fsdp2(model_fn().to(rank_device()))
    log = CollectiveLog()
    x = torch.randn(4, next(model.parameters()).shape[-1], device=rank_device())
    with log:
        out = model(x)
        with log.during("backward"):
            out.pow(2).mean().backward()
    return {phase: [r.kind for r in log.records if r.phase == phase] for phase in ("forward", "backward")} | {
        "in flight": in_flight(log.records)}


def root_reshard_worker(rank: int, world_size: int, width: int = 32) -> dict:
    """``fully_shard`` with its defaults on each block and on the root: which parameters are held whole between
    forward and backward, and the all-gathers of backward."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model, device_mesh = BlockNet(width), mesh()         # the mesh on this rank's device: CPU under Gloo
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    force_sum_on_gloo(model)
    log = CollectiveLog()
    with log:
        out = model(torch.randn(4, width))
        whole = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        with log.during("backward"):
            out.pow(2).mean().backward()
    return {"whole after forward": whole, "backward all-gathers": sum(
        r.kind == "all-gather" and r.phase == "backward" for r in log.records)}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bytes_per_parameter_worker(rank: int, world_size: int, width: int, param_dtype=None, reduce_dtype=None) -> dict:
    """One AdamW step of a :class:`BlockNet` under FSDP2 with a ``MixedPrecisionPolicy``: the bytes a parameter
    costs, summed over the ranks (shards, their gradients, AdamW's two moments), the dtypes of each, and the bytes
    per parameter each rank sends in the step (ring: (N-1)/N of each gather's and reduce-scatter's tensor)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = BlockNet(width)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    device_mesh = mesh()
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, mp_policy=policy, reshard_after_forward=True)  # the head: 2 gathers too
    force_sum_on_gloo(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = CollectiveLog()
    with log:
        out = model(torch.randn(4, width))
        with log.during("backward"):
            out.float().pow(2).mean().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    shards = [p.to_local() for p in model.parameters()]
    moments = [v.to_local() for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    per = lambda nbytes: nbytes * world_size / n                               # noqa: E731
    sent = lambda kind: sum(r.nbytes for r in log.records if r.kind == kind) * (world_size - 1) / world_size / n  # noqa: E731
    grads = [p.grad.to_local() for p in model.parameters()]
    return {"parameters": per(_nbytes(shards)), "gradients": per(_nbytes(grads)),
            "optimizer states": per(_nbytes(moments)), "dtypes": (shards[0].dtype, model.head.weight.grad.dtype),
            "all-gather": sent("all-gather"), "reduce-scatter": sent("reduce-scatter")}


def whole_gradient_bytes(model: nn.Module) -> int | None:
    """Bytes of unsharded gradients FSDP2 holds right now (kept between micro-batches when gradient sync is off);
    ``None`` if this torch version keeps them under other names."""
    total, found = 0, False
    for unit in fsdp_units(model):
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or []:
            found = found or hasattr(fp, "unsharded_accumulated_grad") or hasattr(fp, "_unsharded_param")
            grad = getattr(fp, "unsharded_accumulated_grad", None)
            if grad is None:
                unsharded = getattr(fp, "_unsharded_param", None)
                grad = None if unsharded is None else unsharded.grad
            total += 0 if grad is None else grad.numel() * grad.element_size()
    return total if found else None


def accumulation_worker(rank: int, world_size: int, width: int, mode: str, micro_batches: int = 2) -> dict:
    """``micro_batches`` forward and backward passes before one step, under FSDP2 (fp32).

    ``mode``: ``"sync"`` reduce-scatters after every micro-batch (the default); ``"no sync"`` turns it off
    (``set_requires_gradient_sync(False)``) for all but the last; ``"no sync, keep weights"`` also keeps the whole
    weights between micro-batches (``set_reshard_after_backward(False)``). Returns the collectives, the whole bytes
    held between micro-batches and the summed gradient (whole, every rank)."""
    model = apply_fsdp2(BlockNet(width))
    log = CollectiveLog()
    g = torch.Generator().manual_seed(rank)
    between = {}
    for i in range(micro_batches):
        last = i == micro_batches - 1
        if mode != "sync":
            model.set_requires_gradient_sync(last)
        if mode == "no sync, keep weights":
            model.set_reshard_after_backward(last)
        with log:
            out = model(torch.randn(4, width, generator=g))
            with log.during("backward"):
                out.pow(2).mean().backward()
        if not last:
            between = {"whole gradients": whole_gradient_bytes(model), "whole weights": unsharded_bytes(model)}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    kinds = [r.kind for r in log.records]
    return {"all-gathers": kinds.count("all-gather"), "reduce-scatters": kinds.count("reduce-scatter"),
            **between, "grads": grads, "model bytes": _nbytes(p.full_tensor() for p in model.parameters())}


def hsdp_worker(rank: int, world_size: int, width: int = 32, steps: int = 2) -> dict:
    """HSDP on a 2-D mesh ``(replicate, shard)`` of ``world_size`` ranks (2 x 2 on 4): each block sharded inside
    a row of the mesh, replicated across rows. Trains ``steps`` SGD steps on this rank's share of each global batch;
    returns the full weights, the collectives of the last backward, and the ranks of the group each kind ran in."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh2d = init_device_mesh(rank_device().type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = BlockNet(width)
    for block in model.blocks:
        fully_shard(block, mesh=mesh2d)
    fully_shard(model, mesh=mesh2d)
    force_sum_on_gloo(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = CollectiveLog()
    groups = _group_ranks_mode()
    for step in range(steps):
        x = torch.randn(4 * world_size, width, generator=torch.Generator().manual_seed(step)).chunk(world_size)[rank]
        log.records.clear()
        groups.records.clear()
        with log:
            out = model(x)
            with log.during("backward"), groups:
                out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    w = model.blocks[0].up.weight
    kinds = [r.kind for r in log.records if r.phase == "backward"]
    return {"weights": {k: v.cpu() for k, v in fsdp2_full_state_dict(model).items()},
            "placements": str(w.placements), "local shape": tuple(w.to_local().shape),
            "reduce-scatters": kinds.count("reduce-scatter"), "all-reduces": kinds.count("all-reduce"),
            "reduce-scatter bytes": sum(r.nbytes for r in log.records if r.kind == "reduce-scatter"),
            "all-reduce bytes": sum(r.nbytes for r in log.records if r.kind == "all-reduce"),
            "groups": {k: sorted({tuple(g) for kind, g in groups.records if kind == k})
                       for k in ("reduce-scatter", "all-reduce")}}


def hsdp_reference(world_size: int, width: int = 32, steps: int = 2) -> dict:
    """One process, the same model and data as :func:`hsdp_worker`, on the whole batch."""
    model = BlockNet(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(4 * world_size, width, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _group_ranks_mode():
    """A dispatch mode recording, for each reduce-scatter and all-reduce, the ranks of the process group it ran in."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GroupRanks(TorchDispatchMode):
        records: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = {"reduce_scatter": "reduce-scatter", "allreduce": "all-reduce"}
            k = next((v for key, v in kind.items() if key in func.name()), None)
            pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            if k and pg is not None:
                self.records.append((k, dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg))))
            return func(*args, **(kwargs or {}))
    mode = GroupRanks()
    mode.records = []
    return mode


def _gather_sizes_mode():
    """A dispatch mode recording, for each all-gather, how many ranks it gathers from (its output's elements over
    its input's) and the phase it ran in."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GatherSizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase, self.records = "forward", []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allgather" in func.name():
                out, inp = (a for a in args if isinstance(a, torch.Tensor))
                self.records.append((self.phase, out.numel() // max(inp.numel(), 1)))
            return func(*args, **(kwargs or {}))
    return GatherSizes()


def reshard_to_worker(rank: int, world_size: int, reshard_after_forward, width: int = 16) -> list[tuple[str, int]]:
    """``fully_shard(..., reshard_after_forward=<flag>)`` on every unit of a :class:`BlockNet`: each all-gather of one
    forward and backward, as (phase, ranks it gathers from). With an int ``k`` the weights are resharded after
    forward over ``k`` ranks only (one node, say), so backward gathers from ``k`` ranks, not the world."""
    from torch.distributed.fsdp import fully_shard
    model = BlockNet(width)
    device_mesh = mesh()
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard_after_forward)
    force_sum_on_gloo(model)
    mode = _gather_sizes_mode()
    with mode:
        out = model(torch.randn(4, width))
        mode.phase = "backward"
        out.pow(2).mean().backward()
    return mode.records
