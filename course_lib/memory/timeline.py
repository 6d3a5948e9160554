"""Memory over one training step, and two ways to lower its peak: offload to the host, chunk the loss.

:func:`memory_curve` follows every storage a step's operators create, forward *and* backward, and records the
bytes alive after each operator: the kind of curve the profiler's memory timeline draws from the allocator's
events (``torch.profiler.profile(profile_memory=True)``; on a GPU ``torch.cuda.memory._record_memory_history``
and its snapshot viewer). It rises through the forward (each layer adds what it saves) and falls through the
backward as saved tensors are freed, gradients taking their place. Without checkpointing it peaks close to
the turn; with whole-layer checkpointing the peak moves into the backward (what is held at the turn, plus one
rebuilt layer and its gradient temporaries).

:func:`chunked_cross_entropy`: with a large vocabulary ``V`` the logits, ``b·s·V`` fp32, outweigh a whole
layer (``V = 128k``, ``h = 8k``: 16 times the ``bsh`` input of the head). Computing the loss a chunk of
tokens at a time, each chunk checkpointed, keeps only the head's input; backward rebuilds one chunk's logits
at a time (as torchtune's chunked loss does; Liger's fused linear cross-entropy also works chunk by chunk, but
computes each chunk's gradients already in the forward instead of recomputing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint


class _Curve(TorchDispatchMode):
    """After each operator: the bytes of the storages created under this mode that are still alive."""

    def __init__(self):
        super().__init__()
        self.known: dict[int, StorageWeakRef] = {}          # data_ptr -> storages seen, counted or not
        self.counted: dict[int, tuple[StorageWeakRef, int]] = {}   # data_ptr -> (ref, bytes): created here
        self.points: list[tuple[str, str, int]] = []         # (operator, phase, live bytes)
        self.phase = "forward"

    def _new(self, st) -> bool:
        ref = self.known.get(st.data_ptr())
        if ref is not None and not ref.expired():
            return False
        self.known[st.data_ptr()] = StorageWeakRef(st)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._new(t.untyped_storage())                # existed before: known, not counted
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and self._new(t.untyped_storage()):
                st = t.untyped_storage()
                self.counted[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.counted = {k: v for k, v in self.counted.items() if not v[0].expired()}
        self.points.append((func.overloadpacket.__name__, self.phase, sum(n for _, n in self.counted.values())))
        return out


def memory_curve(loss_fn, *args) -> dict:
    """Run ``loss_fn(*args).backward()``; the bytes alive after each operator, beyond what existed before.

    Returns ``{"points": [(operator, "forward" | "backward", bytes)], "at_turn": bytes held when ``loss_fn`` has
    returned (its temporaries, such as unsaved logits, already freed: what backward will find), "peak": the
    largest point, "peak_phase": where it falls, "after": bytes left at the end (the gradients)}``.
    """
    mode = _Curve()
    with mode:
        loss = loss_fn(*args)
        turn = sum(n for ref, n in mode.counted.values() if not ref.expired())   # read after loss_fn's frame is gone
        mode.phase = "backward"
        loss.backward()
    pts = mode.points
    peak = max(pts, key=lambda p: p[2])
    return {"points": pts, "at_turn": turn, "peak": peak[2], "peak_phase": peak[1], "after": pts[-1][2]}


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(hidden @ weight.t(), targets, reduction="sum", ignore_index=ignore_index)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int = 8,
                          ignore_index: int = -100, num_targets: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``targets`` (``hidden``: ``(tokens, h)``; ``weight``:
    the LM head's ``(V, h)``), ``chunks`` token chunks at a time, each checkpointed: the ``tokens·V`` logits are
    never all alive; backward rebuilds one chunk's at a time. Equal to ``F.cross_entropy`` up to rounding.

    Like ``F.cross_entropy``, it divides by the number of targets that are not ``ignore_index``. Across
    micro-batches or ranks, pass the global count as ``num_targets`` (else each part is averaged on its own)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or not 1 <= chunks <= hidden.shape[0]:
        raise ValueError(f"need hidden (tokens, h), targets (tokens,), 1 <= chunks <= tokens; got "
                         f"{tuple(hidden.shape)}, {tuple(targets.shape)}, chunks={chunks}")
    total = sum(checkpoint(_chunk_loss, h, weight, t, ignore_index, use_reentrant=False)
                for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks)))
    count = (targets != ignore_index).sum() if num_targets is None else num_targets
    return total / count
