"""FSDP2 with ``offload_policy=CPUOffloadPolicy()``: the shards live in host memory, the GPU holds only the
layers in flight (notebook 10, optional section).

With the policy, each unit's **sharded** parameters, their gradients and the optimizer's states stay on the
CPU, and ``optimizer.step()`` runs on the CPU. The GPU gets a unit's shard only to all-gather it: the whole
(unsharded) parameters of the units in flight (the one computing and the one prefetched), and one unit's whole
gradient in backward before its reduce-scatter. The price: host-device copies every step (each shard up before
each all-gather, each gradient shard down after its reduce-scatter) and a CPU optimizer step.

:func:`offload_bytes` counts the bytes per GPU both ways; :func:`offload_worker` trains with and without the
policy and reports where each tensor lives. ``pin_memory=True`` (the default) needs an accelerator: on a
CPU-only machine pass ``pin_memory=False`` (then the "device" is the CPU itself, and nothing moves).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from ..hardware import rank_device, synchronize
from .fsdp2 import _train, apply_fsdp2, fsdp_units


def cpu_offload_policy(pin_memory: bool = True):
    """``torch.distributed.fsdp.CPUOffloadPolicy`` (its older home on torch releases that lack the new one)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:                                    # older releases kept it in the composable package
        from torch.distributed._composable.fsdp import CPUOffloadPolicy
    return CPUOffloadPolicy(pin_memory=pin_memory)


def offload_bytes(params: int, world_size: int, units: int, param_bytes: int = 4, grad_bytes: int = 4,
                  state_bytes: int = 8, in_flight: int = 2) -> dict[str, float]:
    """Bytes per rank for FSDP2 with and without CPU offload (activations left out).

    ``params`` split evenly into ``units`` FSDP units; fp32 parameters and gradients and Adam's two fp32
    moments by default. Sharded: ``params / world_size`` of each. In flight: ``in_flight`` units' whole
    parameters (the one computing and the one prefetched) plus one unit's whole gradient (backward, before its
    reduce-scatter). ``"host-device bytes per step"``: each shard copied up twice (forward and backward
    all-gathers) and its gradient shard copied down once.
    """
    shard, unit = params / world_size, params / units
    sharded = shard * (param_bytes + grad_bytes + state_bytes)
    in_flight_bytes = in_flight * unit * param_bytes + unit * grad_bytes
    return {"GPU, no offload": sharded + in_flight_bytes, "GPU, CPU offload": in_flight_bytes,
            "host, CPU offload": sharded, "host-device bytes per step": shard * (2 * param_bytes + grad_bytes)}


def _where(model: nn.Module, opt) -> dict[str, set[str]]:
    params = list(model.parameters())
    units = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_units(model)]   # torch's FSDPParam objects
    offloaded = {fp.offload_to_cpu for g in units if g is not None for fp in g.fsdp_params}
    return {"offloaded by the policy": offloaded, "sharded parameters": {p.to_local().device.type for p in params},
            "gradients": {p.grad.to_local().device.type for p in params if p.grad is not None},
            "optimizer states": {v.device.type for s in opt.state.values() for k, v in s.items() if k != "step"}}


def offload_worker(rank: int, world_size: int, model_fn, width: int, steps: int = 3) -> dict:
    """Train ``model_fn()`` with FSDP2 on this rank's device, without and with ``CPUOffloadPolicy``.

    Returns, for each, where the tensors live, how far training moved the weights (``"moved"``), the step
    time and the GPU's allocated bytes between steps (0 on a CPU); and ``"difference"``: the largest gap
    between the two runs' shards on this rank (offload must not change the arithmetic; compared shard by
    shard, since gathering CPU shards would need a CPU-capable backend under NCCL). Pinned host memory where
    there is a GPU.
    """
    device = rank_device()
    out = {}
    for name, policy in (("no offload", None), ("CPU offload", cpu_offload_policy(device.type != "cpu"))):
        model = apply_fsdp2(model_fn(), offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        start_shards = [p.to_local().detach().cpu().clone() for p in model.parameters()]
        _train(model, opt, width, 1)                        # warm-up step: states exist, kernels are loaded
        synchronize(device)
        start = time.perf_counter()
        _train(model, opt, width, steps - 1)
        synchronize(device)
        seconds = (time.perf_counter() - start) / max(steps - 1, 1)
        gpu_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        out[name] = {**_where(model, opt), "step seconds": seconds, "GPU bytes between steps": gpu_bytes,
                     "shards": [p.to_local().detach().cpu() for p in model.parameters()]}   # not collective
        out[name]["moved"] = max((a - b).abs().max().item() for a, b in zip(out[name]["shards"], start_shards))
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pairs = zip(out["no offload"].pop("shards"), out["CPU offload"].pop("shards"))
    out["difference"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    return out
