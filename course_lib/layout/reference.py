"""The planner's model as real PyTorch modules, to measure what the formulas predict.

:func:`build` makes a :class:`Model`'s decoder (module names ``q k v o``, ``gate up down``, ``norm1 norm2``, as
the tensor-parallel plan below expects), on any device: on ``"meta"`` a 70 B model costs no memory, only shapes
(what :mod:`.fake` shards over 64 fake ranks). Rotary positions are left out: they hold no parameters, and a
fused kernel applies them in place. ``attention="fused"`` calls ``F.scaled_dot_product_attention`` (on the CPU,
its flash kernel saves the output and a logsumexp), ``"eager"`` writes softmax(q·kᵀ/√d)·v out and saves the s²
probabilities.

:func:`block_saved_bytes` measures what one block saves for its backward, whole or on one of ``tp`` ranks with
sequence parallelism (:func:`sp_block_plan`, the fake process group): what :func:`.memory.layer_activation_bytes`
predicts.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .shapes import Model


class Block(nn.Module):
    """x + attention(norm1(x)); then + SwiGLU(norm2(x)): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, m: Model):
        super().__init__()
        h, kv = m.hidden, m.kv_dim
        self.heads, self.kv_heads, self.head_dim, self.attention = m.heads, m.kv_heads, m.head_dim, m.attention
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.q, self.k, self.v = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up = nn.Linear(h, m.ffn, bias=False), nn.Linear(h, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, h, bias=False)
        self.gather1, self.gather2 = nn.Identity(), nn.Identity()   # where sequence parallelism all-gathers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        y = self.gather1(self.norm1(x))
        s = y.shape[1]                                            # the whole sequence (SP: x holds a slice)
        d = self.head_dim
        q = self.q(y).view(b, s, -1, d).transpose(1, 2)          # heads read from the width: works when TP-split
        k = self.k(y).view(b, s, -1, d).transpose(1, 2)
        v = self.v(y).view(b, s, -1, d).transpose(1, 2)
        if self.attention == "fused":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.gather2(self.norm2(x))
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Decoder(nn.Module):
    """Embedding → blocks → final RMSNorm → LM head (untied)."""

    def __init__(self, m: Model, layers: int | None = None, embedding: bool = True, head: bool = True):
        super().__init__()
        self.embed = nn.Embedding(m.vocab, m.hidden) if embedding else None
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.layers if layers is None else layers))
        self.norm = nn.RMSNorm(m.hidden) if head else None
        self.head = nn.Linear(m.hidden, m.vocab, bias=False) if head else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build(m: Model, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
          **stage) -> Decoder:
    """The decoder of ``m`` (``stage``: :class:`Decoder`'s ``layers``, ``embedding``, ``head``, for one pipeline
    stage), built from ``seed`` without touching the caller's random generator."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return Decoder(m, **stage).to(dtype)


def tp_plan(model: Decoder) -> dict:
    """Megatron's split as a DTensor plan: q, k, v, gate, up column-parallel; o, down row-parallel; the embedding
    and the LM head split over the vocabulary; the norms whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "down")})
    if model.embed is not None:
        plan["embed"] = RowwiseParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    return plan


def sp_block_plan(prefix: str = "") -> dict:
    """One block with sequence parallelism, as :mod:`course_lib.composed.stages` runs it: the norms on sequence
    slices (``SequenceParallel``), each norm's output all-gathered once (``PrepareModuleInput`` on ``gather1``,
    ``gather2``) for the column-parallel q, k, v and gate, up, and o, down reduce-scattered back to slices."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    gather = lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),  # noqa: E731
                                        use_local_output=True)
    plan = {f"{prefix}norm1": SequenceParallel(), f"{prefix}norm2": SequenceParallel(),
            f"{prefix}gather1": gather(), f"{prefix}gather2": gather()}
    plan.update({f"{prefix}{n}": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")})
    plan.update({f"{prefix}{n}": RowwiseParallel(output_layouts=Shard(1)) for n in ("o", "down")})
    return plan


def block_saved_bytes(m: Model, micro_batch: int = 1, tp: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Measured: the bytes one block of ``m`` saves for its backward on one of ``tp`` ranks (sequence
    parallelism, :func:`sp_block_plan`), for ``micro_batch`` sequences, on the CPU. Autograd's saved tensors
    are counted by storage with ``saved_tensors_hooks`` (a DTensor by its local piece), the block's weights and
    its input left out. With ``tp > 1`` the block runs under the fake process group (rank 0 of ``tp``): its
    collectives move nothing, so the values are meaningless, but every shape, and so every byte, is the real
    rank's. Returns ``{"total", "tensors": [(shape, dtype, bytes), ...]}``."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t                           # noqa: E731
    started = False
    if tp > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore
        if dist.is_initialized():
            raise RuntimeError("a process group is already running in this process: the fake one needs its own")
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
        started = True
    try:
        block = build(m, dtype=dtype).blocks[0]
        if tp > 1:
            parallelize_module(block, init_device_mesh("cpu", (tp,)), sp_block_plan())
        x = torch.randn(micro_batch, m.seq // tp, m.hidden, dtype=dtype, requires_grad=True)
        skip = {local(p).untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
        seen: dict = {}

        def pack(t):
            piece = local(t)
            ptr = piece.untyped_storage().data_ptr()
            if ptr not in skip and ptr not in seen:
                seen[ptr] = (tuple(piece.shape), str(piece.dtype), piece.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        return {"total": sum(v[2] for v in seen.values()), "tensors": list(seen.values())}
    finally:
        if started:
            dist.destroy_process_group()
