"""What one rank of a 64-GPU layout would hold, measured in one process: the fake process group and meta tensors.

PyTorch's **fake process group** (``torch.testing._internal.distributed.fake_pg``: a ``FakeStore`` and
``init_process_group("fake", rank=r, world_size=N)``) makes one process believe it is rank ``r`` of ``N``: every
collective returns at once without sending anything. With the model built on the **meta device** (shapes,
no storage), ``fully_shard`` (FSDP2) and DTensor's ``parallelize_module`` cut the real 70 B parameters exactly as
they would on the cluster, and each parameter's ``to_local()`` is this rank's piece. AdamW's ``step`` even
creates its meta states. So the bytes of the states a rank would hold are *measured*, not derived:
:func:`rank_state_bytes` sums them, and the planner's :func:`.memory.stage_memory` predicts the same numbers.

What the fake group cannot do here (torch 2.13, CPU): run a forward pass of the meta model. FSDP2 refuses
("FSDP parameters should be materialized from meta device before training"), and materialising a rank's
shard of 70 B on this machine would take gigabytes. Activations are therefore checked at small scale, in one
real process (:func:`.reference.block_saved_bytes`: one block, whole or on rank 0 of 2 with sequence
parallelism, real CPU tensors under the fake group), and the states at 64 ranks.

FSDP2 keeps the sharded parameters in fp32 (they are the master weights; ``MixedPrecisionPolicy`` gathers
bf16 copies for compute) and their gradients in fp32: 4 + 4 + 8 (Adam) = 16 bytes a parameter, the total the
planner counts as bf16 weights and gradients (2 + 2), fp32 master weights (4) and Adam (8). The parts differ,
the sum per rank does not: compare totals.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import build, tp_plan
from .shapes import Model
from .space import Layout


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def rank_state_bytes(model: Model, layout: Layout, rank: int = 0, device: str = "meta", step: bool = True,
                     stage: int = 0) -> dict:
    """Bytes of parameters, gradients and AdamW states on ``rank`` of the ``dp·cp × tp`` GPUs of pipeline
    ``stage`` (its ``layers/pp`` layers; the embedding on stage 0, the final norm and LM head on the last),
    built on ``device`` (``"meta"``: no memory), TP by DTensor, ZeRO-3 by FSDP2 over ``dp·cp``. The fake group
    holds one stage's GPUs (no pipeline collective is needed to build a stage): call it once per stage. Needs no
    process group: it starts the fake one and ends it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process: the fake one needs its own")
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in 0..{layout.pp - 1}, got {stage}")
    if layout.zero not in (0, 3):
        raise ValueError("the fake-rank check builds no ZeRO (0) or FSDP2 (ZeRO-3) layouts")
    shard, world = layout.dp * layout.cp, layout.dp * layout.cp * layout.tp
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (shard, layout.tp), mesh_dim_names=("shard", "tp"))
        net = build(model, device=device, layers=model.layers // layout.pp, embedding=stage == 0,
                    head=stage == layout.pp - 1)
        if layout.tp > 1:
            parallelize_module(net, mesh["tp"], tp_plan(net))
        if layout.zero == 3 and shard > 1:
            for block in net.blocks:
                fully_shard(block, mesh=mesh["shard"])
            fully_shard(net, mesh=mesh["shard"])
        params = list(net.parameters())
        out = {"parameters": sum(_local_bytes(p) for p in params)}
        for p in params:
            p.grad = torch.zeros_like(p)
        out["gradients"] = sum(_local_bytes(p.grad) for p in params)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        if step:
            opt.step()
        out["optimizer states"] = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                                      if torch.is_tensor(v) and v.dim() > 0)      # not the 0-d step counter
        out["total"] = sum(out.values())
        return out
    finally:
        dist.destroy_process_group()


def predicted_state_bytes(model: Model, layout: Layout, stage: int = 0) -> int:
    """The planner's bytes of weights, gradients, optimizer states and master weights on a GPU of ``stage``
    (without :mod:`.memory`'s fp32 gradient accumulator, which FSDP2 without a pipeline does not keep apart:
    its fp32 gradient shard is the one counted)."""
    from .memory import stage_memory
    mem = stage_memory(model, layout, stage)
    return sum(mem[k] for k in ("weights", "gradients", "optimizer states", "fp32 master weights"))


def compare(model: Model, layout: Layout, rank: int = 0, stage: int = 0) -> dict:
    """``{"measured", "predicted", "ratio"}``: a fake rank's state bytes against the planner's, on ``stage``."""
    measured = rank_state_bytes(model, layout, rank, stage=stage)["total"]
    predicted = predicted_state_bytes(model, layout, stage)
    return {"measured": measured, "predicted": predicted, "ratio": measured / predicted}
