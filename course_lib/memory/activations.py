"""Activation memory: what a transformer block keeps for its backward pass, derived term by term.

**What is counted.** Every tensor autograd saves for the backward pass passes through
``torch.autograd.graph.saved_tensors_hooks``; :func:`course_lib.memory.saved.saved_bytes` counts the bytes of
their *storages*, once per storage (a view, a transposed weight, one input saved by three layers all share
one), and leaves out the parameters (memory the model holds anyway). That is exactly the memory that stays
allocated between forward and backward because of the graph.

**The derived formula** (:func:`block_activation_bytes`), for the course's pre-LayerNorm block
(:class:`course_lib.models.transformer.Block`) with batch ``b``, sequence ``s``, width ``h``, ``a`` heads,
MLP width ``f`` and ``d`` bytes per element. Reading the forward pass line by line:

=============================  ======================  =====================================================
saved tensor                   bytes                   saved by
=============================  ======================  =====================================================
block input x                  ``bsh·d``               LayerNorm 1 (needs its input)
LayerNorm 1 mean and 1/std     ``2bs·stats``           LayerNorm 1
LayerNorm 1 output             ``bsh·d``               ``q``, ``k``, ``v`` (one storage, three users)
q and kᵀ                       ``2bsh·d``              ``q @ kᵀ`` (``matmul`` copies the head-split views)
causal mask                    ``s²`` (bool)           ``masked_fill``
softmax output                 ``bas²·d``              softmax, and ``probs @ v`` (one storage)
v                              ``bsh·d``               ``probs @ v``
heads joined (out's input)     ``bsh·d``               ``out``
x after attention              ``bsh·d``               LayerNorm 2
LayerNorm 2 mean and 1/std     ``2bs·stats``           LayerNorm 2
LayerNorm 2 output             ``bsh·d``               ``up``
up's output                    ``bsf·d``               GELU (needs its input)
GELU's output                  ``bsf·d``               ``down``
=============================  ======================  =====================================================

With dropout, each dropout adds its mask, and the attention dropout's output replaces the softmax output as
``probs @ v``'s saved input (``bas²·(mask + d)`` more). The residual additions save nothing.

**Against the published formula** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"): ``sbh(34 + 5as/h)`` bytes per layer, for 16-bit activations, 1-byte dropout masks and
``f = 4h``. Our table in that setting (``d = 2``, dropout on, CUDA's 1-byte masks) gives exactly
``34sbh + 5as²b`` plus two terms the paper leaves out as small: the LayerNorm statistics (``4bs`` numbers)
and the causal mask (``s²`` bytes, one per model call, not per batch). :func:`compare_with_megatron`
computes the difference. Where the course's block differs in practice:

* **dropout 0** (the course's default): no masks, and ``probs @ v`` reuses the softmax output, so the
  block saves ``32sbh + 2as²b`` in 16-bit;
* **on the CPU** dropout's mask is a full-precision tensor (ATen's fused ``native_dropout``, with a 1-byte
  mask, runs on GPUs), and LayerNorm keeps its statistics in the input's precision (CUDA: fp32);
* separate ``q``, ``k``, ``v`` projections save the same as a fused ``qkv`` (one shared input), *except*
  under autocast, which casts that input once per projection (three 16-bit copies: notebook 13 measures it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ATTENTION = ("eager", "fused")


def conventions(device: str | torch.device = "cpu", dtype_bytes: int = 4) -> dict:
    """Bytes per element of LayerNorm's statistics and of a dropout mask, which depend on the device.

    CPU: both in the activations' precision (dropout saves a scaled float mask: ATen's unfused path).
    CUDA: statistics in fp32 (the accumulation type) and a 1-byte bool mask (the fused ``native_dropout``).
    """
    if torch.device(device).type == "cuda":
        return {"stats_bytes": 4, "mask_bytes": 1}
    return {"stats_bytes": dtype_bytes, "mask_bytes": dtype_bytes}


def block_activation_bytes(batch: int, seq: int, dim: int, heads: int, hidden: int | None = None,
                           dtype_bytes: int = 4, dropout: bool = False, device: str | torch.device = "cpu",
                           stats_bytes: int | None = None, mask_bytes: int | None = None, tp: int = 1,
                           attention: str = "eager") -> dict:
    """Bytes one block saves for backward, term by term (the module docstring's table), and ``"total"``.

    ``attention``: ``"eager"`` (the course's block: scores, softmax and ``probs @ v`` as separate operators,
    the ``s²`` terms; Korthikanti's case) or ``"fused"`` (``F.scaled_dot_product_attention``, FlashAttention):
    no scores, no mask; the kernel saves its output (``bsh·d``; laid out so that joining the heads is a view:
    ``out`` saves that same storage) and a ``(b, a, s)`` fp32 logsumexp, and
    on a GPU (the flash and memory-efficient kernels) regenerates an attention dropout from its random state
    (no mask kept). :mod:`.fused` measures it. On the CPU, SDPA with dropout falls back to its math path, which
    stores the ``s²`` probabilities like eager attention: that case raises ``ValueError`` (measure it instead).

    ``tp``: the block split over ``tp`` ranks by tensor parallelism (Megatron's layout, notebook 11): each
    rank keeps ``1/tp`` of what lives inside the attention heads and the MLP's hidden units (q, k, v, the
    scores, the joined heads, GELU's input and output, the attention dropout), and all of the rest (the
    LayerNorms' inputs, outputs and statistics, the mask, the residual dropouts): Megatron's
    ``sbh(10 + 24/t + 5as/(ht))`` in its setting.
    """
    f = hidden if hidden is not None else 4 * dim
    if min(batch, seq, dim, heads, tp) < 1 or dim % heads:
        raise ValueError(f"need positive sizes and dim divisible by heads, got b={batch} s={seq} h={dim} a={heads}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "fused" and dropout and torch.device(device).type == "cpu":
        raise ValueError("on the CPU, scaled_dot_product_attention with dropout runs its math path, which stores the "
                         "s² probabilities like eager attention: the fused formula prices the GPU kernels only "
                         "(pass device='cuda', or measure with saved_tensors)")
    if heads % tp or f % tp:
        raise ValueError(f"tensor parallelism over tp={tp} ranks needs heads ({heads}) and the MLP width ({f}) "
                         "divisible by tp")
    b, s, h, a, d = batch, seq, dim, heads, dtype_bytes
    conv = conventions(device, d)
    st = conv["stats_bytes"] if stats_bytes is None else stats_bytes
    m = conv["mask_bytes"] if mask_bytes is None else mask_bytes
    bsh = b * s * h
    eager = attention == "eager"
    parts = {
        "LayerNorm inputs (x twice)": 2 * bsh * d,
        "LayerNorm mean and 1/std": 2 * 2 * b * s * st,
        "LayerNorm outputs (Linear inputs)": 2 * bsh * d,
        "q, k, v for the attention matmuls": 3 * bsh * d // tp,
        "causal mask": s * s if eager else 0,
        "softmax output": b * a * s * s * d // tp if eager else 0,
        "fused attention: output and logsumexp": 0 if eager else (bsh * d + b * a * s * 4) // tp,
        "heads joined (out's input)": bsh * d // tp if eager else 0,   # fused: a view of the kernel's output
        "MLP: GELU input and output": 2 * b * s * f * d // tp,
        "dropout masks and outputs": ((b * a * s * s * (m + d) // tp if eager else 0) + 2 * bsh * m) if dropout else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def model_activation_bytes(cfg, batch: int, seq: int | None = None, dtype_bytes: int = 4,
                           device: str | torch.device = "cpu", layers: int | None = None, tp: int = 1,
                           attention: str = "eager") -> dict:
    """Bytes the whole course transformer (``cfg``: a ``TransformerConfig``) saves for a forward and its loss.

    Blocks (``layers`` of them, default ``cfg.layers``) plus what is outside them: the embedding's token and
    position indices (int64), the final LayerNorm's input and statistics, the LM head's input, and the
    cross-entropy's log-probabilities, targets (int64) and its weight total (a 4-byte scalar). With ``tp``
    the blocks are split as in :func:`block_activation_bytes`; the rest is whole on every rank (notebook 11's
    layout keeps the embeddings and the LM head whole).
    """
    s = seq or cfg.seq_len
    n = cfg.layers if layers is None else layers
    d, b, h = dtype_bytes, batch, cfg.dim
    conv = conventions(device, d)
    block = block_activation_bytes(b, s, h, cfg.heads, cfg.hidden, d, cfg.dropout > 0, device, tp=tp,
                                   attention=attention)["total"]
    outside = {
        "token and position indices": 8 * b * s + 8 * s,
        "embedding dropout mask": b * s * h * conv["mask_bytes"] if cfg.dropout > 0 else 0,
        "final LayerNorm input and statistics": b * s * h * d + 2 * b * s * conv["stats_bytes"],
        "LM head input": b * s * h * d,
        "loss: log-probabilities, targets, weight": b * s * cfg.vocab * d + 8 * b * s + 4,
    }
    parts = {"blocks": n * block, **outside}
    parts["total"] = sum(parts.values())
    return parts


def megatron_layer_bytes(seq: int, batch: int, dim: int, heads: int) -> int:
    """The published per-layer activation bytes ``sbh(34 + 5as/h)`` (16-bit, dropout, no recomputation)."""
    return seq * batch * dim * 34 + 5 * heads * seq * seq * batch


def compare_with_megatron(seq: int, batch: int, dim: int, heads: int) -> dict:
    """The course's table in Megatron's setting (16-bit, dropout on, 1-byte masks, ``f = 4h``) beside the
    paper's formula: they differ by exactly the LayerNorm statistics and the causal mask."""
    ours = block_activation_bytes(batch, seq, dim, heads, 4 * dim, dtype_bytes=2, dropout=True,
                                  stats_bytes=4, mask_bytes=1)
    paper = megatron_layer_bytes(seq, batch, dim, heads)
    left_out = ours["LayerNorm mean and 1/std"] + ours["causal mask"]
    return {"course": ours["total"], "megatron": paper, "difference": ours["total"] - paper,
            "LayerNorm statistics + causal mask": left_out}


# ---- memory that a forward pass leaves allocated, whatever keeps it alive -------------------------------

@dataclass
class Held:
    """What :func:`held_bytes` found alive after the forward: bytes by kind, and the distinct storages."""

    total: int = 0
    parameter_copies: int = 0          # casts of parameters (autocast's 16-bit weight copies)
    storages: dict = field(default_factory=dict)   # data_ptr -> (bytes, the operator that made it)
    made_by_op: Counter = field(default_factory=Counter)   # operator -> bytes it created (alive or not)
    calls: Counter = field(default_factory=Counter)        # operator -> calls

    @property
    def activations(self) -> int:
        return self.total - self.parameter_copies


class _NewStorages(TorchDispatchMode):
    """Sees every operator; remembers each storage an operator *created* (not one that existed before)."""

    def __init__(self, params=()):
        super().__init__()
        self.known: dict[int, StorageWeakRef] = {}     # data_ptr -> every storage seen so far (weakly)
        self.made: dict[int, tuple] = {}               # data_ptr -> (weak ref, bytes, op, copy of a parameter?)
        self.calls: Counter = Counter()                # operator name -> calls
        self.made_by_op: Counter = Counter()           # operator name -> bytes of the storages it created
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def _is_new(self, storage) -> bool:
        ref = self.known.get(storage.data_ptr())
        if ref is not None and not ref.expired():
            return False                   # a storage we know, still alive (this tensor is a view of it)
        self.known[storage.data_ptr()] = StorageWeakRef(storage)   # new, or its address reused after a free
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in inputs:
            self._is_new(t.untyped_storage())          # first seen as an input: it existed before
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        from_param = name == "_to_copy" and any(t.untyped_storage().data_ptr() in self.params for t in inputs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and self._is_new(t.untyped_storage()):
                st = t.untyped_storage()
                self.made[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), name, from_param)
                self.made_by_op[name] += st.nbytes()
        return out


def held_bytes(fn, *args, params=()) -> tuple[object, Held]:
    """Run ``fn(*args)``; return its result and the memory it allocated that is *still alive* afterwards.

    This is what ``torch.cuda.memory_allocated()`` grows by across a forward pass (without the allocator's
    rounding), measured on any device: every storage an operator creates is remembered, and those still
    alive at the end are counted, once each. Unlike the saved-tensor hooks it sees memory kept alive by
    anything (activation checkpointing's caches, autocast's weight copies, the result itself), and nothing
    that existed before (the inputs, the parameters). Pass ``params`` to have casts of them counted apart
    as ``parameter_copies``.
    """
    mode = _NewStorages(params)
    with mode:
        out = fn(*args)
    held = Held(calls=mode.calls, made_by_op=mode.made_by_op)
    for ptr, (ref, nbytes, op, from_param) in mode.made.items():
        if not ref.expired():
            held.storages[ptr] = (nbytes, op)
            held.total += nbytes
            held.parameter_copies += nbytes if from_param else 0
    return out, held


def split_block_worker(rank: int, world_size: int, cfgs: list, batch: int = 2, seed: int = 0) -> list[dict]:
    """For each config of ``cfgs`` (a :class:`~course_lib.models.TransformerConfig`), the activations one block
    split across the ranks (:class:`course_lib.tensor_parallel.ParallelBlock`, notebook 11) keeps for backward on
    this rank, measured by :func:`.saved.saved_tensors`: ``{False: tensor parallel, True: with sequence
    parallelism}``, one dict per config."""
    from .. import hardware
    from ..models.transformer import Block
    from ..tensor_parallel import ParallelBlock
    from .saved import saved_tensors

    device = hardware.rank_device()
    out = []
    for cfg in cfgs:
        kept = {}
        for sequence_parallel in (False, True):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                block = ParallelBlock(Block(cfg), sequence_parallel=sequence_parallel).to(device)
            x = torch.randn(batch, cfg.seq_len, cfg.dim, device=device)
            if sequence_parallel:
                x = x.chunk(world_size, 1)[rank].contiguous()
            x.requires_grad_()
            kept[sequence_parallel] = saved_tensors(block, x, exclude=list(block.parameters()))[1]
        out.append(kept)
    return out
