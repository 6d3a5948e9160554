"""How much memory training needs: weights, gradients, optimizer states and activations.

The arithmetic, per parameter: the weight (4 bytes in fp32, 2 in bf16), its gradient (the same), and
the optimizer's state: none for SGD, one fp32 tensor for momentum, two for Adam (first and second
moments); mixed-precision training adds an fp32 master copy of the weights.  Adam in fp32 therefore
needs 16 bytes per parameter before a single activation: a 7-billion-parameter model needs 112 GB,
more than one 80 GB GPU holds.  Activations grow with batch size and depth on top of that.

Data parallelism keeps all of it on every rank. ZeRO shards it over the N ranks instead (notebook 09):
stage 1 the optimizer states (with the fp32 master weights, which only the optimizer uses), stage 2
the gradients too, stage 3 the weights too; each sharded part costs a rank 1/N of its bytes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}   # fp32 tensors per parameter
ZERO_STAGES = (0, 1, 2, 3)                                 # 0: not sharded (DDP)


def training_memory(params: int, dtype: str = "fp32", optimizer: str = "adam", activation_bytes: int = 0,
                    zero_stage: int = 0, world_size: int = 1) -> dict:
    """Bytes for each part of training a model of ``params`` parameters (mixed precision when dtype != fp32),
    on one rank of ``world_size`` that shards them with ZeRO ``zero_stage`` (0: every rank holds all of it).
    Activations are never sharded by ZeRO (each rank computes on its own batch)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_STATES)}, got {optimizer!r}")
    if params < 0 or activation_bytes < 0:
        raise ValueError("params and activation_bytes cannot be negative")
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES} (0: no sharding), got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of ranks), got {world_size!r}")

    def per_rank(nbytes: int, from_stage: int) -> int:       # sharded from this stage on: 1/N, rounded up
        return -(-nbytes // world_size) if zero_stage >= from_stage else nbytes

    b = DTYPE_BYTES[dtype]
    parts = {"weights": per_rank(params * b, 3), "gradients": per_rank(params * b, 2),
             "optimizer states": per_rank(params * 4 * OPTIMIZER_STATES[optimizer], 1),
             "fp32 master weights": per_rank(params * 4, 1) if dtype != "fp32" else 0,
             "activations": activation_bytes}
    parts["total"] = sum(parts.values())
    return parts


def fits(breakdown: dict, device_gib: float, reserve: float = 0.9) -> bool:
    """Whether the total fits in ``reserve`` of a device (the rest goes to the CUDA context, fragmentation...)."""
    return breakdown["total"] <= reserve * device_gib * 2**30


def mlp_activation_bytes(batch: int, widths: list[int], dtype_bytes: int = 4) -> int:
    """Activations an MLP (Linear + ReLU per layer) saves for backward: each Linear's input, each ReLU's output."""
    saved = widths[0] + 2 * sum(widths[1:-1]) + widths[-1]
    return batch * saved * dtype_bytes


def measured_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a model and its optimizer really hold after a step: bytes of weights, gradients and states."""
    tensor_bytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    weights = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0)   # Adam's step counter is a 0-d tensor: not per parameter
    return {"weights": weights, "gradients": grads, "optimizer states": states}


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
