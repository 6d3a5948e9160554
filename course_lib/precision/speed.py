"""How fast this machine multiplies matrices in fp32, bf16 and fp16, and why (its CPU's instructions).

A CPU runs bf16 matrix products fast only with instructions made for them: AVX512_BF16 (dot products of bf16
pairs) or AMX (Intel's tile units: ``amx_bf16``). fp16 likewise needs AVX512_FP16 or ``amx_fp16``. Without
them PyTorch converts to fp32 and back, and the 16-bit product is *slower* than fp32. GPUs have tensor cores
for both. :func:`cpu_features` reads what this CPU has (Linux's ``/proc/cpuinfo``); :func:`matmul_worker`
measures, alternating the precisions round after round so that a busy moment of the machine hits them alike.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_features() -> dict:
    """PyTorch's CPU capability (``"AVX512"``, ``"AVX2"``...) and which 16-bit instructions the CPU has (Linux's
    ``/proc/cpuinfo``; elsewhere ``"native bf16"`` and ``"native fp16"`` are ``None``: unknown)."""
    info = Path("/proc/cpuinfo")
    flags = set()
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "flags known": bool(flags)}
    out.update({f: f in flags for f in FLAGS})
    # no flags read (ARM, macOS, Windows): unknown, not "absent"
    out["native bf16"] = (out["avx512_bf16"] or out["amx_bf16"]) if flags else None
    out["native fp16"] = (out["avx512_fp16"] or out["amx_fp16"]) if flags else None
    return out


def describe(native: bool | None) -> str:
    """``"native"``, ``"emulated"`` or, where the CPU's flags could not be read, ``"unknown"``."""
    return "unknown" if native is None else "native" if native else "emulated"


def matmul_worker(rank: int, world_size: int, size: int = 512, rounds: int = 30, sample_s: float = 0.002,
                  dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> dict:
    """GFLOP/s of a ``size`` x ``size`` matrix product in each dtype on the rank's device: the best of ``rounds``
    short samples (about ``sample_s`` seconds each), the dtypes alternating; a dtype whose single product takes
    over 50 ms (fp16 on most CPUs) gets 3 samples. The best, because what we want is what the hardware can do:
    another program taking the core only ever makes a sample slower, and a short sample is often left alone."""
    from ..hardware import rank_device, synchronize
    device = rank_device()
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    pairs = {dt: (a.to(dt), b.to(dt)) for dt in dtypes}

    def timed(x, y, reps: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            x @ y
        synchronize(device)
        return (time.perf_counter() - t0) / reps

    once = {dt: timed(x, y, 1) for dt, (x, y) in pairs.items()}                     # also a warm-up
    reps = {dt: max(1, round(sample_s / t)) for dt, t in once.items()}
    samples = {dt: rounds if t < 0.05 else min(rounds, 3) for dt, t in once.items()}
    times: dict = {dt: [] for dt in dtypes}
    for i in range(rounds):
        for dt, (x, y) in pairs.items():
            if i < samples[dt]:
                times[dt].append(timed(x, y, reps[dt]))
    return {str(dt).replace("torch.", ""): 2 * size**3 / min(t) / 1e9 for dt, t in times.items()}
