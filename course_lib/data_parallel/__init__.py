"""Data parallelism: every rank holds the whole model, sees its own shard of the data, and the ranks
average their gradients (notebooks 03 to 05).

* :mod:`.mini_ddp`: :func:`average_gradients` (four lines) and :class:`MiniDDP` (buckets, hooks, overlap).
* :mod:`.training`: the data-parallel training loop every rank runs, the one-process reference on the
  global batch, and what each rank's ``DistributedSampler`` yields.
* :mod:`.ddp_features`: torch DDP's ``no_sync`` accumulation and rank-0 checkpoints, as workers.
* :mod:`.measure`: throughput, bucket timelines and communication share, on the CPU or the rank's GPU.
"""
from .mini_ddp import MiniDDP, average_gradients

__all__ = ["MiniDDP", "average_gradients"]
