"""Sharded data parallelism from scratch: ZeRO stages 1, 2 and 3 (notebook 09).

Data parallelism keeps N identical copies of everything training holds: parameters, gradients and
optimizer states (16 bytes per parameter with Adam). ZeRO ("Zero Redundancy Optimizer") gives each
rank 1/N of them instead, and moves the rest over the network when it is needed:

* :mod:`.flat`: how a parameter is cut into N slices; one layer's all-gather and reduce-scatter.
* :mod:`.optimizer`: stage 1 (optimizer states sharded) as :class:`ShardedOptimizer`, a drop-in for an
  element-wise optimizer; stage 2 (gradients too, reduce-scattered from backward hooks).
* :mod:`.clip`: what sharding breaks: a global-norm clip (fixed by one all-reduce), a factored optimizer.
* :mod:`.meta_init`: a model built on the meta device, sharded, and made one slice per rank.
* :mod:`.stage3`: stage 3, :func:`fully_shard` (parameters too, gathered one layer at a time by
  forward and backward hooks), the way PyTorch's FSDP2 does it.
* :mod:`.api`: :func:`shard` (any stage in one call), :func:`full_state_dict`, :func:`rank_bytes`.
* :mod:`.measure`: the workers notebooks 09 and 10 and ``benchmarks/zero_vs_fsdp.py`` run (training, memory,
  traffic, step time); :mod:`.fsdp2`: the same with PyTorch's FSDP2, and sharded checkpoints (DCP), notebook 10;
  :mod:`.fsdp2_offload`: FSDP2 with ``CPUOffloadPolicy`` (shards, gradients, optimizer on the host).
"""
from .api import STAGES, full_state_dict, rank_bytes, shard
from .optimizer import ShardedOptimizer
from .stage3 import finish_gradient_synchronization, fully_shard

__all__ = ["ShardedOptimizer", "fully_shard", "shard", "full_state_dict", "rank_bytes",
           "finish_gradient_synchronization", "STAGES"]
