"""Context parallelism: attention over a sequence split across ranks (notebook 15).

* :mod:`.blocks`: attention over one block of keys with its log-sum-exp, the merge of two partial results,
  the contiguous and zig-zag layouts, and a counter of the work done and the bytes sent.
* :mod:`.ring`: ring attention (the keys and values go round the ring, forward and backward).
* :mod:`.allgather`: every rank all-gathers the keys and values (Llama 3's way).
* :mod:`.ulysses`: two all-to-alls trade the sequence split for a head split (DeepSpeed-Ulysses).
* :mod:`.traffic`: the bytes each variant sends and holds, and each rank's causal work, as formulas.
"""
from .allgather import allgather_attention
from .blocks import block_attention, count, merge, shard, unshard, zigzag_shard, zigzag_unshard
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["allgather_attention", "block_attention", "count", "merge", "ring_attention", "shard",
           "ulysses_attention", "unshard", "zigzag_shard", "zigzag_unshard"]
