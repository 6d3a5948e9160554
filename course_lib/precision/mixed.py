"""Three ways to train in mixed precision, and the bytes each really holds per parameter.

* ``"fp32"``: everything in fp32. 4 (weight) + 4 (gradient) + 8 (Adam's two moments) = 16 bytes/parameter.
* ``"autocast"``: ``torch.autocast(dtype=torch.bfloat16)``. The parameters, gradients and optimizer stay
  fp32 (16 bytes/parameter, as fp32!); inside the forward each matrix product casts its inputs to bf16, so the
  activations shrink and the products run in bf16. The weights' bf16 copies are cached for the forward and
  kept by autograd until backward: 2 more bytes per Linear weight, between forward and backward only.
* ``"master"``: the model itself in bf16 (weights and gradients 2 + 2 bytes), and the optimizer steps an
  fp32 *master* copy (4 bytes) with fp32 Adam states (8): 16 bytes/parameter again, the
  ``training_memory(P, "bf16", "adam")`` of notebook 06. After each step the master is rounded into the
  bf16 weights.
* ``"bf16"`` (to show why the master copy exists): the bf16 model stepped directly. An update smaller than
  half a bf16 step of the weight (``|w| x 2^-8``) rounds away: :func:`lost_updates` counts them.

Large trainers accumulate the gradients of their micro-batches in fp32 buffers: 2 + 4 + 4 + 8 = 18 bytes per
parameter (:func:`fp32_accumulation` measures it, and how far a bf16 ``.grad`` sum drifts instead).

Mixed precision saves activation memory and time, not the per-parameter state: that takes sharding
(ZeRO, notebook 09) or a smaller optimizer.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn as nn

from ..memory.activations import held_bytes
from ..memory.arithmetic import measured_state_bytes

MODES = ("fp32", "autocast", "master", "bf16")


class MasterWeights:
    """An optimizer for a bf16 model that keeps fp32 master weights: ``step`` copies the bf16 gradients into
    the masters, steps them with ``make_opt`` (fp32 states), and rounds the result back into the model."""

    def __init__(self, params, make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3)):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = make_opt(self.masters)
        self.param_groups = self.inner.param_groups       # so LR schedulers and rank_bytes see the masters

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)                                   # round to bf16
            m.grad = None                                # the fp32 gradient copy lives only during the step


def build(mode: str, model: nn.Module, lr: float = 1e-3):
    """``(model, optimizer, autocast context factory)`` for ``mode`` (one of :data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}: use one of {MODES}")
    make = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)   # noqa: E731
    if mode in ("fp32", "autocast"):
        opt = make(model.parameters())
    else:
        model = model.to(torch.bfloat16)
        opt = MasterWeights(model.parameters(), make) if mode == "master" else make(model.parameters())
    device = next(model.parameters()).device.type

    def context():
        if mode == "autocast":
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()
    return model, opt, context


def bytes_per_parameter(mode: str, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    """After one training step in ``mode``: bytes per parameter of weights, gradients, optimizer states,
    master weights, and (held from forward to backward) autocast's weight copies; and the activations' bytes."""
    from ..models.transformer import lm_loss
    n = sum(p.numel() for p in model.parameters())
    model, opt, context = build(mode, model)

    def forward():
        with context():
            return lm_loss(model(tokens), targets)
    loss, held = held_bytes(forward, params=list(model.parameters()))
    loss.backward()
    opt.step()
    measured = measured_state_bytes(model, opt)
    masters = sum(m.numel() * m.element_size() for m in getattr(opt, "masters", []))
    per = {"weights": measured["weights"] / n, "gradients": measured["gradients"] / n,
           "optimizer states": measured["optimizer states"] / n, "fp32 master weights": masters / n}
    per["total"] = sum(per.values())
    per["autocast weight copies (forward to backward)"] = held.parameter_copies / n
    return {"per_parameter": per, "activation_bytes": held.activations, "params": n}


def lost_updates(model: nn.Module, opt: torch.optim.Optimizer, before: list[torch.Tensor]) -> float:
    """Fraction of the elements whose bf16 weight did not move in the last step although the optimizer's update
    for them was not zero (it rounded away). ``before``: the weights before the step."""
    lost = total = 0
    for p, b in zip(model.parameters(), before):
        m = opt.state.get(p, {}).get("exp_avg")
        if m is None:
            continue
        moving = m != 0
        lost += int((moving & (p.detach() == b)).sum())
        total += int(moving.sum())
    return lost / max(total, 1)


def train_worker(rank: int, world_size: int, cfg, modes=MODES, steps: int = 30, batch: int = 16, lr: float = 1e-3,
                 seed: int = 0) -> dict:
    """Train the small transformer ``steps`` steps in each mode (same data, same start): losses, median step
    seconds (modes alternate step by step, on the rank's device) and, for ``"bf16"``, the fraction of updates
    lost to rounding at each step."""
    from ..data import make_token_dataset
    from ..hardware import rank_device, synchronize
    from ..models.transformer import lm_loss, transformer
    device = rank_device()
    inputs, targets = (t.to(device) for t in make_token_dataset(512, cfg.seq_len, cfg.vocab, seed=seed).tensors)
    runs = {m: build(m, transformer(cfg, seed=seed).to(device), lr) for m in modes}
    out = {m: {"losses": [], "seconds": [], "lost": []} for m in modes}
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(inputs), (batch,), generator=g).to(device)
        for m, (model, opt, context) in runs.items():
            before = [p.detach().clone() for p in model.parameters()] if m == "bf16" else None
            synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            with context():
                loss = lm_loss(model(inputs[idx]), targets[idx])
            loss.float().backward()
            opt.step()
            synchronize(device)
            out[m]["seconds"].append(time.perf_counter() - t0)
            out[m]["losses"].append(loss.item())
            if before is not None:
                out[m]["lost"].append(lost_updates(model, opt, before))
    for m in modes:
        out[m]["median_seconds"] = statistics.median(out[m]["seconds"][1:] or out[m]["seconds"])
    return out


def fp32_accumulation(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, k: int = 8,
                      lr: float = 1e-3) -> dict:
    """A bf16 model trained one step over ``k`` micro-batches, its gradients accumulated in fp32 buffers (one per
    parameter, kept across the micro-batches, as large trainers do) and stepped through fp32 master weights with
    Adam. Returns the bytes per parameter each kind of tensor holds at the step (measured from the tensors), and how
    far a plain bf16 ``.grad`` accumulation drifts from the fp32 one (relative error of the summed gradients)."""
    from ..models.transformer import lm_loss
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = MasterWeights(params, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))
    fp32_grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    bf16_sum = [torch.zeros_like(p) for p in params]
    for xb, yb in zip(tokens.chunk(k), targets.chunk(k)):
        (lm_loss(model(xb), yb).float() / k).backward()
        for acc, low, p in zip(fp32_grads, bf16_sum, params):
            acc += p.grad.float()                      # the fp32 buffer: exact enough
            low += p.grad                              # what bf16 .grad accumulation would hold
            p.grad = None
    with torch.no_grad():
        for m, g in zip(opt.masters, fp32_grads):
            m.grad = g                                 # the fp32 buffer steps the fp32 master directly
        opt.inner.step()
        for p, m in zip(params, opt.masters):
            p.copy_(m)
            m.grad = None

    def size(ts):
        return sum(t.numel() * t.element_size() for t in ts)
    n = sum(p.numel() for p in params)
    per = {"bf16 weights": size(params) / n, "fp32 gradients": size(fp32_grads) / n,
           "fp32 master weights": size(opt.masters) / n,
           "optimizer states": size([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
                                     and v.numel() > 1]) / n}
    per["total"] = sum(per.values())
    exact = torch.cat([g.flatten() for g in fp32_grads])
    low = torch.cat([g.float().flatten() for g in bf16_sum])
    return {"per_parameter": per, "bf16_accumulation_error": ((low - exact).norm() / exact.norm()).item()}
