"""Numeric precision in training: formats, mixed precision, loss scaling, and precision on the wire (notebook 14).

* :mod:`.formats`: what fp32, bf16, fp16 and fp8 (e4m3, e5m2) hold (range, precision), their bit layouts, what a
  cast to them loses, and fp8's scaled casts.
* :mod:`.mixed`: fp32; autocast to bf16 (fp32 parameters); a bf16 model with fp32 master weights
  (:class:`MasterWeights`); the bytes each holds per parameter; updates lost without a master copy.
* :mod:`.scaling`: fp16 gradients that underflow to zero, and ``torch.amp.GradScaler`` recovering them; the
  scale over the steps, overflow steps skipped.
* :mod:`.wire`: DDP's ``bf16_compress_hook`` and FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``, with the
  bytes their collectives move counted; a bf16 ring's error growing with the ranks (:func:`.wire.ring_sum_error`).
"""
from .formats import FORMATS, cast_losses, format_table, smallest_subnormal
from .mixed import MODES, MasterWeights, build, bytes_per_parameter, lost_updates

__all__ = ["FORMATS", "format_table", "cast_losses", "smallest_subnormal", "MODES", "MasterWeights", "build",
           "bytes_per_parameter", "lost_updates"]
