"""MFU measured: a training step's model FLOPs over its time, against the peak of the machine at hand.

**MFU** (model FLOPs utilisation, PaLM's name) = the FLOPs the model needs for a step / (step time × peak
FLOP/s). On a GPU the peak is the data sheet's (989 TFLOP/s bf16 dense for an H100 SXM: label it so). A CPU has
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
            best_peak = max(best_peak, measure_matmul_peak(repeats=2))
    peak = best_peak if peak is None else peak
    return {"mfu": flops / seconds / peak, "flops": flops, "seconds": seconds, "peak": peak}
