"""Every way to lay a model out on a cluster: DP × TP × PP × CP, ZeRO stage, recomputation, micro-batches.

A **layout** gives each GPU four coordinates. ``tp`` GPUs split every matrix (tensor parallelism, notebook 11,
with sequence parallelism), ``cp`` GPUs split every sequence (context parallelism: ring attention, notebook 15),
``pp`` GPUs hold consecutive groups of layers (pipeline parallelism, notebook 07), and ``dp`` copies of all that
run on different sequences (data parallelism, sharded by ZeRO stage 0–3, notebook 09). ``dp·tp·pp·cp`` is the
number of GPUs.

**Where each group sits.** Ranks are numbered TP fastest, then CP, then DP, then PP (Megatron-LM's order): a TP
group is ``tp`` neighbouring GPUs, a CP group strides by ``tp``, and so on. A group runs on NVLink when all its
GPUs sit in one node, that is when the product of its degree and the degrees numbered faster fits in a node
(:func:`inside_node`); otherwise its slowest hop is the network.

**The rules of the enumeration** (:func:`enumerate_layouts`):

* ``tp`` divides the GPUs of a node. TP's collectives run twice per layer in the forward and twice in the
  backward, on the critical path; across nodes they would run at the network's 50 GB/s instead of NVLink's 450
  (an H100 node), so the space leaves it out. (The Playbook's table has one layout that does, TP 16 for 80 B on
  64 nodes: :mod:`.published` reports it as outside this space.)
* ``tp`` divides the query heads, and the key/value heads divide by ``tp`` or ``tp`` by them (fewer key/value
  heads than ranks: each is repeated); ``pp`` divides the layers; ``cp`` divides the sequence.
* ZeRO stage 1–3 only where gradients are reduced over more than one GPU (``dp·cp > 1``: CP ranks hold the same
  weights and reduce their gradients with the data-parallel ranks, so ZeRO shards over ``dp·cp``).
* A global batch of ``global_batch`` sequences: each DP replica runs ``global_batch / dp`` of them, as
  ``m = global_batch / (dp · micro_batch)`` micro-batches of ``micro_batch`` sequences (pipeline micro-batches,
  or gradient accumulation when ``pp = 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .shapes import Cluster, Model

ZERO = (0, 1, 2, 3)
RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Layout:
    """One point of the space; ``m`` micro-batches of ``micro_batch`` sequences per DP replica and step."""

    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    recompute: str
    micro_batch: int
    m: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        """``"TP 8 × PP 2 × DP 4, ZeRO-1, mb 1 × 64"``: the degrees above 1 (DP always), the sharding, the
        recomputation, and micro-batch size × count."""
        dims = [f"{k} {v}" for k, v in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp)) if v > 1]
        sharding = "no ZeRO" if self.zero == 0 else f"ZeRO-{self.zero}"
        parts = [" × ".join(dims + [f"DP {self.dp}"]), sharding]
        parts += ["full recompute"] if self.recompute == "full" else []
        return ", ".join(parts + [f"mb {self.micro_batch} × {self.m}"])


def inside_node(layout: Layout, group: str, gpus_per_node: int) -> bool:
    """Whether every GPU of one ``group`` (``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``) sits in one node, ranks
    numbered TP fastest, then CP, DP, PP (module docstring)."""
    order = ("tp", "cp", "dp", "pp")
    if group not in order:
        raise ValueError(f"group must be one of {order}, got {group!r}")
    span = 1
    for g in order[: order.index(group) + 1]:
        span *= getattr(layout, g)
    return span <= gpus_per_node


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: Model, cluster: Cluster, global_batch: int | None = None,
                      micro_batches: tuple[int, ...] = (1, 2, 4), global_batch_tokens: int | None = None,
                      zero: tuple[int, ...] = ZERO, recompute: tuple[str, ...] = RECOMPUTE) -> list[Layout]:
    """Every layout of the rules in the module docstring, for a global batch of ``global_batch`` sequences (or
    ``global_batch_tokens`` tokens: ``global_batch_tokens / model.seq`` sequences) and micro-batches of each size
    in ``micro_batches`` that divides a replica's share."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise ValueError("give one of global_batch (sequences) or global_batch_tokens")
    if global_batch is None:
        if global_batch_tokens % model.seq:
            raise ValueError(f"{global_batch_tokens} tokens are not whole sequences of {model.seq}")
        global_batch = global_batch_tokens // model.seq
    if global_batch < 1 or min(micro_batches) < 1:
        raise ValueError(f"need a positive global batch and micro-batch sizes, got {global_batch}, {micro_batches}")
    out = []
    n = cluster.gpus
    for tp in divisors(cluster.gpus_per_node):
        if n % tp or model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for pp in divisors(n // tp):
            if model.layers % pp:
                continue
            for cp in divisors(n // (tp * pp)):
                dp = n // (tp * pp * cp)
                if model.seq % cp or global_batch % dp:
                    continue
                for mb in micro_batches:
                    if (global_batch // dp) % mb:
                        continue
                    for z in (zero if dp * cp > 1 else (0,)):
                        for r in recompute:
                            out.append(Layout(dp, tp, pp, cp, z, r, mb, global_batch // (dp * mb)))
    return out
