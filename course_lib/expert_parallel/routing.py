"""The router's decisions: which experts each token goes to, with what weight, and which token-slots are dropped.

A **router** is a linear layer that scores each token against each expert; a softmax turns the scores into
probabilities. **Top-k routing** sends each token to its ``k`` most probable experts: the token then occupies ``k``
**token-slots**, one per chosen expert. Each slot's output is weighted by its **gate**: here the router's
probability itself, *not* renormalised over the top k. That is the Switch Transformer's gate (top-1) applied to
each of the k slots, and it differs from the published top-k layers: Mixtral renormalises (a softmax over the top-k
scores only), GShard divides its top-2 gates g1, g2 by g1 + g2, and DeepSeek-V3 normalises its sigmoid affinities
over the selected experts.

**Capacity**: an expert takes at most ``ceil(capacity_factor · tokens · k / num_experts)`` slots, computed from
the tokens *this rank* holds. Slots over capacity are **dropped**: they contribute zero (the token's other slot,
or the residual connection around the layer, still carries it). Priority is deterministic: all first choices, in
token order, then all second choices, in token order (GShard's order: a token's best expert is served first).

The **load-balancing loss** (Switch Transformer, Fedus et al. 2021, eq. 4, extended to top-k):
``aux = num_experts · Σ_e f_e · P_e``, with ``f_e`` the fraction of this rank's ``tokens · k`` slots routed to
expert ``e`` (before any drop) and ``P_e`` the mean router probability of ``e`` over this rank's tokens. It is 1
when both are uniform and grows as routing concentrates; ``f_e`` has no gradient, ``P_e`` carries it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """The most token-slots one expert takes from a rank holding ``tokens`` tokens.

    Computed exactly: the factor as the decimal it is written as (``Fraction(str(1.1)) == 11/10``), so that
    ``capacity(100, 11, 1, 1.1)`` is 10, where the float product ``1.1 · 100 / 11`` rounds up to 11."""
    return math.ceil(Fraction(str(capacity_factor)) * tokens * top_k / num_experts)


@dataclass
class Routing:
    """The kept slots (``token``, ``expert``, ``gate``: one entry each), what was dropped and the balance."""

    token: torch.Tensor      # which of this rank's tokens fills the slot
    expert: torch.Tensor     # the (global) expert it goes to
    gate: torch.Tensor       # its weight in the output: differentiable, the router learns through it
    dropped: int             # slots over capacity
    load: torch.Tensor       # slots routed to each expert, before the drop (num_experts,)
    aux_loss: torch.Tensor   # the load-balancing loss


def route(probs: torch.Tensor, top_k: int, cap: int) -> Routing:
    """Route ``probs`` (tokens, num_experts): top-k, then drop what each expert's capacity ``cap`` cannot take."""
    tokens, num_experts = probs.shape
    top_p, top_e = probs.topk(top_k, dim=-1)                  # (tokens, k), best first
    expert = top_e.T.reshape(-1)                              # slot order: first choices, then second choices...
    gate = top_p.T.reshape(-1)
    token = torch.arange(tokens, device=probs.device).repeat(top_k)
    onehot = F.one_hot(expert, num_experts)
    place = (onehot.cumsum(0) * onehot).sum(1) - 1            # the slot's place in its expert's queue
    keep = place < cap
    load = onehot.sum(0)
    return Routing(token[keep], expert[keep], gate[keep], int((~keep).sum()), load,
                   balance_loss(probs, load, top_k))


def balance_loss(probs: torch.Tensor, load: torch.Tensor, top_k: int) -> torch.Tensor:
    """``num_experts · Σ_e f_e · P_e`` (zero, still connected to the router, for a rank without tokens)."""
    tokens, num_experts = probs.shape
    if tokens == 0:
        return probs.sum() * 0
    f = load.to(probs.dtype) / (tokens * top_k)
    return num_experts * (f * probs.mean(0)).sum()


def imbalance(load) -> float:
    """The busiest expert's load over the mean load: 1 is perfect balance; with top-k routing, total collapse (every
    token picks the same k experts) gives ``num_experts / k``, the most it can be."""
    load = torch.as_tensor(load, dtype=torch.float64)
    return float(load.max() / load.mean()) if load.sum() > 0 else 1.0
