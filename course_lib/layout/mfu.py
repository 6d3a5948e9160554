"""MFU measured: a training step's model FLOPs over its time, against the peak of the machine at hand.

**MFU** (model FLOPs utilisation, PaLM's name) = the FLOPs the model needs for a step / (step time × peak
FLOP/s). On a GPU the peak is the data sheet's, looked up by the exact device name in :data:`DATASHEET_BF16`
(989 TFLOP/s bf16 dense for an H100 SXM, 756 for the PCIe card, 835 for the NVL: a substring test such as
``"H100" in name`` would give all three the SXM's figure); a GPU not in the table is measured instead, and
:func:`gpu_peak` labels which it is. A CPU has
no data sheet figure the course can rely on, so :func:`measure_matmul_peak` measures one: the best of a few
large fp32 matrix products, the fastest thing the machine does. Against it, a small model's step shows how much
of the machine's speed the rest of training (small matrices, element-wise operators, the Python around them)
leaves unused.

:func:`measure_mfu` counts the model FLOPs of one step with ``torch.utils.flop_counter.FlopCounterMode`` (the
matrix products of the forward and the backward, which is what ``6·N`` per token approximates) and times the
best of a few steps. Both are the best of a few runs: on a busy machine (CI, the other notebooks' ranks) the
fastest run is the one least disturbed. The two are measured in alternation, so that a burst of load slows both.
"""
from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import hardware

DATASHEET_BF16 = {      # torch.cuda.get_device_name() -> NVIDIA's dense bf16 tensor-core peak, FLOP/s (no sparsity)
    "NVIDIA H100 80GB HBM3": 989e12,     # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,               # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
}


def gpu_peak(name: str, measure) -> tuple[float, str]:
    """``(peak FLOP/s, label)`` for a GPU called ``name``: the data sheet's dense bf16 figure when ``name`` is
    exactly a key of :data:`DATASHEET_BF16`, else ``measure()`` (a measured bf16 matmul peak), labelled so."""
    if name in DATASHEET_BF16:
        return DATASHEET_BF16[name], f"{name}, data sheet bf16 dense"
    return measure(), f"{name}, measured bf16 matmul (not in the data-sheet table)"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_peak(n: int = 1024, repeats: int = 5, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the best of ``repeats`` ``n × n`` matrix products (``2·n³`` FLOPs each) on ``device``."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def once():
        a @ b
        sync()
    once()                                          # warm-up: allocation, threads
    return 2 * n**3 / _best(once, repeats)


def step_flops(model: torch.nn.Module, batch, loss_fn=None) -> int:
    """The FLOPs FlopCounterMode counts for one forward and backward of ``model`` on ``batch``."""
    with FlopCounterMode(display=False) as counter:
        _step(model, batch, loss_fn)
    return counter.get_total_flops()


def _step(model, batch, loss_fn):
    out = model(batch)
    loss = loss_fn(out) if loss_fn is not None else out.float().square().mean()
    loss.backward()
    device = batch.device if isinstance(batch, torch.Tensor) else next(model.parameters()).device
    hardware.synchronize(device)            # a GPU queues the work: the clock must wait for it


def measure_mfu(model: torch.nn.Module, batch, loss_fn=None, repeats: int = 3, peak: float | None = None) -> dict:
    """``{"mfu", "flops", "seconds", "peak"}`` of one training step (forward, ``loss_fn`` of the output or its mean
    square, backward) of ``model`` on ``batch``: model FLOPs / best step time / ``peak`` (default: the best
    :func:`measure_matmul_peak` taken between the steps)."""
    flops = step_flops(model, batch, loss_fn)
    seconds, best_peak = float("inf"), 0.0
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        seconds = min(seconds, _best(lambda: _step(model, batch, loss_fn), 1))
        if peak is None:
            best_peak = max(best_peak, measure_matmul_peak(repeats=2, device=next(model.parameters()).device))
    peak = best_peak if peak is None else peak
    return {"mfu": flops / seconds / peak, "flops": flops, "seconds": seconds, "peak": peak}


def measure_on(model: torch.nn.Module, batch, device: torch.device, gpu_name: str | None = None) -> dict:
    """Notebook 17's MFU cell: :func:`measure_mfu` of ``model`` on ``batch`` with a ``"label"`` for the peak.

    On a GPU (``gpu_name``: ``torch.cuda.get_device_name``) the model runs in bf16 against :func:`gpu_peak`'s
    figure (the data sheet's for a GPU of :data:`DATASHEET_BF16`, else a measured bf16 matmul peak); with
    ``gpu_name=None``, in its own dtype against this machine's measured fp32 matmul peak. ``gpu_name`` is an
    argument so that the tests run the GPU branch's logic on a CPU under a faked name."""
    if gpu_name is None:
        return {**measure_mfu(model, batch), "label": "this CPU's measured fp32 matmul peak"}
    peak, label = gpu_peak(gpu_name, lambda: measure_matmul_peak(4096, device=device, dtype=torch.bfloat16))
    return {**measure_mfu(model.to(torch.bfloat16), batch, peak=peak), "label": label}
