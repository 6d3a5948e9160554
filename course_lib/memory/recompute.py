"""Activation checkpointing (recomputation): keep less for backward, compute some of the forward again.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` runs ``block`` forward keeping *only its
input*; when backward reaches the block it runs the block's forward again (the same random numbers: dropout's
RNG state is saved) to rebuild what backward needs. Memory falls from a whole layer's activations to one
tensor per layer; the price is one more forward of every checkpointed layer (about a third more compute:
backward costs about twice the forward). The gradients are identical, bit for bit. Random numbers: the
checkpoint restores the *global* RNG state before recomputing; a per-rank dropout generator of one's own
(notebook 12's) must be saved and restored the same way, or the recomputed masks differ.

**Operator-level** (PyTorch: "selective activation checkpointing") recomputation keeps the outputs of some
operators and recomputes only the rest:
``create_selective_checkpoint_contexts(policy)`` asks ``policy`` about every operator the forward runs
(``MUST_SAVE`` or ``PREFER_RECOMPUTE``). Here a policy is a plain predicate on the operator's name
(``"mm"``, ``"addmm"``, ``"bmm"``, ``"gelu"``, ``"_softmax"``, ``"native_layer_norm"``...):

* ``"none"``: no checkpointing;
* ``"matmuls"``: keep every matrix product (``mm``, ``addmm``, ``bmm``: where the FLOPs are), recompute
  the cheap operators (LayerNorm, softmax, GELU, masks, copies). Not Korthikanti et al.'s *selective
  recomputation*, which is nearly its opposite: it recomputes the attention core (``q @ kᵀ``, softmax,
  dropout, ``probs @ v``: large ``s²`` tensors, few FLOPs) and keeps the Linear layers' outputs (notebook 13's
  exercise arrives there). ``torch.compile`` can choose for itself: ``torch._functorch.config.
  activation_memory_budget`` (0 to 1) has its partitioner recompute the cheapest operators until the
  activations fit that fraction;
* ``"full"``: keep nothing but each block's input (whole-layer checkpointing);
* or any ``keep(op_name) -> bool`` of your own (notebook 13's exercise).

The course's model is used as it is: :func:`with_recomputation` returns a copy whose blocks are wrapped
in :class:`Recomputed`; nothing in :mod:`course_lib.models.transformer` changes.
"""
from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from .activations import held_bytes

MATMULS = ("mm", "addmm", "bmm")


def keep_matmuls(op_name: str) -> bool:
    """The ``"matmuls"`` policy: keep the output of every matrix product, recompute everything else."""
    return op_name in MATMULS


POLICIES: dict[str, Callable[[str], bool] | None] = {
    "none": None,                      # not checkpointed at all
    "matmuls": keep_matmuls,
    "full": lambda op_name: False,     # keep nothing: whole-layer checkpointing
}


def _context_fn(keep: Callable[[str], bool]):
    def policy(ctx, op, *args, **kwargs):
        name = op.overloadpacket.__name__
        return CheckpointPolicy.MUST_SAVE if keep(name) else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


class Recomputed(nn.Module):
    """``block`` run under non-reentrant checkpointing; ``keep`` chooses the operators whose outputs are kept
    (``None`` or a predicate that keeps nothing: whole-layer checkpointing)."""

    def __init__(self, block: nn.Module, keep: Callable[[str], bool] | None = None):
        super().__init__()
        self.block = block
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep is None:
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=_context_fn(self.keep))


def resolve(policy) -> tuple[bool, Callable[[str], bool] | None]:
    """``(checkpointed?, keep)`` for a policy name or a ``keep(op_name)`` predicate."""
    if callable(policy):
        return True, policy
    if policy not in POLICIES:
        raise ValueError(f"unknown recomputation policy {policy!r}: use one of {list(POLICIES)} "
                         "or a function keep(op_name) -> bool")
    return policy != "none", (None if policy == "full" else POLICIES[policy])


def with_recomputation(model: nn.Module, policy="full") -> nn.Module:
    """A copy of the course transformer whose every block is recomputed under ``policy`` (same weights)."""
    checkpointed, keep = resolve(policy)
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise TypeError(f"with_recomputation wraps the blocks of the course transformer (model.blocks), and "
                        f"{type(model).__name__} has none: wrap your own layers in Recomputed(layer, keep) instead")
    model = copy.deepcopy(model)
    if checkpointed:
        model.blocks = nn.ModuleList(Recomputed(block, keep) for block in model.blocks)
    return model


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from ..models.transformer import lm_loss
    return lm_loss(model(tokens), targets)


def measure_policy(model: nn.Module, policy, tokens: torch.Tensor, targets: torch.Tensor, seed: int = 0) -> dict:
    """One forward and backward of ``model`` under ``policy``: the bytes held between them, matrix-product
    FLOPs of the forward and of the backward (recomputation included), and the gradients. Dropout's random
    numbers come from ``seed``, the same for every policy (the caller's RNG is left as it was)."""
    m = with_recomputation(model, policy)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _, held = held_bytes(loss_fn, m, tokens, targets)
        torch.manual_seed(seed)
        with FlopCounterMode(display=False) as flops:
            loss = loss_fn(m, tokens, targets)
        forward_flops = flops.get_total_flops()
        with FlopCounterMode(display=False) as flops:
            loss.backward()
    return {"held": held.total, "forward_flops": forward_flops, "backward_flops": flops.get_total_flops(),
            "grads": [p.grad.detach().clone() for p in m.parameters()]}


def compare_policies(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                     policies=("none", "matmuls", "full")) -> dict:
    """For each policy: bytes held, their fraction of no checkpointing's, the FLOPs recomputed as a fraction of
    the forward's and (``extra_compute``) of a whole step's (forward + backward, matrix products),
    and whether the gradients equal no checkpointing's bit for bit."""
    base = measure_policy(model, "none", tokens, targets)
    out = {}
    for p in policies:
        r = base if p == "none" else measure_policy(model, p, tokens, targets)
        name = p if isinstance(p, str) else getattr(p, "__name__", "custom")
        out[name] = {"held": r["held"], "held_fraction": r["held"] / base["held"],
                     "recomputed_flops": r["backward_flops"] - base["backward_flops"],
                     "recomputed_fraction": (r["backward_flops"] - base["backward_flops"]) / base["forward_flops"],
                     "extra_compute": (r["backward_flops"] - base["backward_flops"])
                     / (base["forward_flops"] + base["backward_flops"]),
                     "grads_identical": all(torch.equal(a, b) for a, b in zip(r["grads"], base["grads"]))}
    return out


def forward_ops(block: nn.Module, x: torch.Tensor) -> dict[str, dict]:
    """The operators ``block``'s forward runs: for each name, its calls, the bytes of the new memory its
    outputs take (views take none), and its FLOPs (matrix products only)."""
    with FlopCounterMode(display=False) as flops:
        _, held = held_bytes(block, x)
    table = {op: {"calls": n, "new_bytes": held.made_by_op.get(op, 0), "flops": 0} for op, n in held.calls.items()}
    for op, n in flops.get_flop_counts()["Global"].items():
        table[op.__name__]["flops"] = n
    return table


def step_time_worker(rank: int, world_size: int, cfg, batch: int, policies=("none", "full"), rounds: int = 5,
                     steps: int = 2, seed: int = 0) -> dict:
    """For each policy: the median (and the mean) seconds of a training step (zero_grad, forward, backward, AdamW
    step), measured alternately (round after round, so that a busy moment of the machine hits every policy alike),
    and the bytes held between forward and backward (:func:`.activations.held_bytes`). On the rank's device."""
    from ..data import make_token_dataset
    from ..hardware import rank_device, synchronize
    from ..models.transformer import transformer
    device = rank_device()
    tokens, targets = (t.to(device) for t in make_token_dataset(batch, cfg.seq_len, cfg.vocab, seed=seed).tensors)
    base = transformer(cfg, seed=seed).to(device)
    models = {p: with_recomputation(base, p) for p in policies}
    opts = {p: torch.optim.AdamW(m.parameters(), lr=1e-3) for p, m in models.items()}

    def step(p):
        opts[p].zero_grad(set_to_none=True)
        loss_fn(models[p], tokens, targets).backward()
        opts[p].step()

    held = {p: held_bytes(loss_fn, models[p], tokens, targets)[1].total for p in policies}
    for p in policies:
        step(p)                                          # warm-up: allocations, optimizer states
    times: dict = {p: [] for p in policies}
    for _ in range(rounds):
        for p in policies:
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(p)
            synchronize(device)
            times[p].append((time.perf_counter() - t0) / steps)
    return {p: {"seconds": statistics.median(times[p]), "mean": statistics.fmean(times[p]), "held": held[p]}
            for p in policies}
