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


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number ``dtype`` holds: the smallest normal times ``eps`` (one mantissa step)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def format_table() -> dict[str, dict]:
    """For each format: exponent and mantissa bits, largest, smallest normal and subnormal, and eps."""
    out = {}
    for name, dtype in FORMATS.items():
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
