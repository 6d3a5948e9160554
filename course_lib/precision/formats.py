"""Floating-point formats: what fp32, bf16 and fp16 can hold, and what a cast loses.

A float is ``sign x 2^exponent x 1.mantissa``. The exponent's bits set the *range*, the mantissa's the
*precision* (the relative gap between neighbours, ``eps``):

======  ========  ========  =========  ===================  ==================
format  exponent  mantissa  largest    smallest normal      eps (1.0 to next)
======  ========  ========  =========  ===================  ==================
fp32    8 bits    23 bits   3.4e38     1.2e-38              1.2e-7
bf16    8 bits    7 bits    3.4e38     1.2e-38              7.8e-3
fp16    5 bits    10 bits   65504      6.1e-5               9.8e-4
======  ========  ========  =========  ===================  ==================

bf16 keeps fp32's exponent, so its range is fp32's: a gradient of 1e-9 is a bf16 number (a coarse one).
fp16 trades range for precision: below 6.1e-5 it has only *subnormal* numbers, down to 2^-24 = 6.0e-8, and
anything smaller rounds to **zero**; above 65504 it is **inf**. That is why fp16 training needs loss
scaling (:mod:`.scaling`) and bf16 training does not.
"""
from __future__ import annotations

import torch

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp8 (torch 2.1 and later): e4m3 (4 exponent bits, 3 mantissa bits; "fn": finite, no inf, max 448) for weights and
# activations, e5m2 (fp16's exponent, 2 mantissa bits, max 57344) for gradients
FP8 = {name: getattr(torch, attr) for name, attr in (("fp8 e4m3", "float8_e4m3fn"), ("fp8 e5m2", "float8_e5m2"))
       if hasattr(torch, attr)}
LAYOUTS = {"fp32": (8, 23), "bf16": (8, 7), "fp16": (5, 10), "fp8 e4m3": (4, 3), "fp8 e5m2": (5, 2)}


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number ``dtype`` holds: the smallest normal times ``eps`` (one mantissa step)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def format_table() -> dict[str, dict]:
    """For each format: exponent and mantissa bits, largest, smallest normal and subnormal, and eps."""
    out = {}
    for name, dtype in {**FORMATS, **FP8}.items():
        info = torch.finfo(dtype)
        mantissa = round(-torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
        out[name] = {"exponent bits": info.bits - 1 - mantissa, "mantissa bits": mantissa, "largest": info.max,
                     "smallest normal": info.smallest_normal, "smallest subnormal": smallest_subnormal(dtype),
                     "eps": info.eps}
    return out


def cast_losses(values: torch.Tensor, dtype: torch.dtype) -> dict:
    """What casting ``values`` (fp32 or fp64) to ``dtype`` does to them: how many non-zero values become 0
    (underflow), how many finite ones become inf (overflow), and the largest relative error of the rest."""
    cast = values.to(dtype)
    back = cast.to(values.dtype)
    nonzero, finite = values != 0, torch.isfinite(values)
    underflow = nonzero & (cast == 0)
    overflow = finite & torch.isinf(cast)
    kept = nonzero & ~underflow & ~overflow
    rel = ((back[kept] - values[kept]).abs() / values[kept].abs()).max().item() if kept.any() else 0.0
    return {"underflow": int(underflow.sum()), "overflow": int(overflow.sum()), "max_relative_error": rel}


def scaled_fp8_cast(x: torch.Tensor, dtype: torch.dtype) -> dict:
    """A scaled cast to fp8, as FP8 training does it per tensor: multiply by ``max / amax`` so that the largest
    magnitude lands on the format's largest number, cast, and divide by the scale again on the way back. Returns the
    relative error (norm) and the share of non-zero values that became 0, with and without the scale."""
    amax = x.abs().max()
    scale = torch.finfo(dtype).max / amax
    out = {}
    for name, s in (("unscaled", torch.ones(())), ("scaled", scale)):
        back = (x * s).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / s
        out[name] = {"relative_error": ((back - x).norm() / x.norm()).item(),
                     "zeroed": ((back == 0) & (x != 0)).float().mean().item()}
    out["scale"] = scale.item()
    return out


def draw_layouts(ax=None):
    """The bit layouts of fp32, bf16, fp16 and the two fp8 formats: sign, exponent, mantissa, one box a bit."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 2.6))[1]
    colours = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}
    for row, (name, (e, m)) in enumerate(LAYOUTS.items()):
        y = len(LAYOUTS) - 1 - row
        for i, part in enumerate(["sign"] + ["exponent"] * e + ["mantissa"] * m):
            ax.add_patch(plt.Rectangle((i, y + 0.1), 0.9, 0.8, color=colours[part]))
        ax.text(-0.5, y + 0.5, f"{name} ({1 + e + m} bits)", ha="right", va="center")
        ax.text(1 + e + m + 0.3, y + 0.5, f"1 + {e} + {m}", va="center", fontsize=8)
    for part, c in colours.items():
        ax.add_patch(plt.Rectangle((0, 0), 0, 0, color=c, label=part))
    ax.set(xlim=(-9, 36), ylim=(0, len(LAYOUTS)), title="sign · exponent (range) · mantissa (precision)")
    ax.axis("off")
    ax.legend(loc="lower right", ncol=3, fontsize=8)
    return ax
