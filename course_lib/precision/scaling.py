"""fp16 and loss scaling: gradients that underflow to zero, and ``torch.amp.GradScaler`` bringing them back.

Under ``torch.autocast(dtype=torch.float16)`` the backward pass carries the activations' gradients in fp16.
Those below fp16's smallest subnormal (2^-24 = 6e-8) become exactly zero, and so does every weight gradient
computed from them: the model stops learning from them, silently. Loss scaling multiplies the loss by
``S`` (say 2^16) before ``backward``, so every gradient is ``S`` times larger and clears the floor; the
optimizer step divides the (fp32) weight gradients by ``S`` again. Too large an ``S`` overflows fp16 (inf),
so ``GradScaler`` adapts it: a step whose gradients hold an inf or NaN is **skipped** (the weights do not
move) and ``S`` is halved; after ``growth_interval`` clean steps ``S`` is doubled. bf16 needs none of this:
its range is fp32's (:mod:`.formats`).

On the CPU fp16 autocast and ``GradScaler("cpu")`` are real (torch 2.3 and later) but fp16 matrix products
are slow on CPUs without fp16 instructions (avx512_fp16, AMX-FP16): the models here are small on purpose.
"""
from __future__ import annotations

import torch

from ..models.transformer import lm_loss, transformer


def gradients(cfg, tokens: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None,
              loss_factor: float = 1.0, scale: float | None = None, seed: int = 0) -> torch.Tensor:
    """All weight gradients of the model (fp32 parameters), flattened, for ``loss_factor x loss``, computed
    under autocast to ``dtype`` (``None``: plain fp32). With ``scale``, a ``GradScaler`` starting at that scale
    multiplies the loss before backward and unscales the gradients after (``scaler.unscale_``)."""
    model = transformer(cfg, seed=seed).to(tokens.device)
    with torch.autocast(tokens.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = lm_loss(model(tokens), targets) * loss_factor
    if scale is None:
        loss.backward()
    else:
        scaler = torch.amp.GradScaler(tokens.device.type, init_scale=scale)
        scaler.scale(loss).backward()
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))   # divides every .grad by the scale
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def underflow_report(cfg, tokens: torch.Tensor, targets: torch.Tensor, loss_factor: float = 1e-3,
                     scale: float = 2.0**16) -> dict:
    """How many weight-gradient elements that are non-zero in fp32 come out exactly zero under fp16 autocast,
    with and without loss scaling, and under bf16; and each one's relative error against fp32."""
    exact = gradients(cfg, tokens, targets, None, loss_factor)
    runs = {"fp16": gradients(cfg, tokens, targets, torch.float16, loss_factor),
            "fp16, loss scaled": gradients(cfg, tokens, targets, torch.float16, loss_factor, scale),
            "bf16": gradients(cfg, tokens, targets, torch.bfloat16, loss_factor)}
    nonzero = exact != 0
    out = {"elements": int(nonzero.sum()), "exact": exact}
    for name, g in runs.items():
        out[name] = {"zeroed": int((nonzero & (g == 0)).sum()),
                     "relative_error": ((g - exact).norm() / exact.norm()).item(), "grads": g}
    return out


def scaler_run(cfg, steps: int = 24, batch: int = 8, init_scale: float = 2.0**20, growth_interval: int = 4,
               lr: float = 3e-3, seed: int = 0) -> dict:
    """Train under fp16 autocast with ``GradScaler``: per step the scale used, whether the step was skipped
    (the weights unchanged, found by comparing them), and the loss; ``"weights_finite"``: whether every final
    weight is finite. On the CPU (``GradScaler("cpu")``)."""
    from ..data import make_token_dataset
    inputs, targets = make_token_dataset(steps * batch, cfg.seq_len, cfg.vocab, seed=seed).tensors
    model = transformer(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = {"scale": [], "skipped": [], "loss": []}
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model(inputs[i * batch:(i + 1) * batch]), targets[i * batch:(i + 1) * batch])
        before = [p.detach().clone() for p in model.parameters()]
        out["scale"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)          # unscales the fp32 gradients; skips opt.step() if any is inf or NaN
        scaler.update()           # halves the scale after a skipped step; doubles it after growth_interval clean ones
        out["skipped"].append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        out["loss"].append(loss.item())
    out["final_scale"] = scaler.get_scale()
    out["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def sharded_skip_worker(rank: int, world_size: int) -> dict:
    """One loss-scaled step on every rank where only rank 0's gradient holds an inf, under ``GradScaler`` and under
    FSDP's ``ShardedGradScaler`` (which all-reduces its found-inf flag before deciding). Returns per scaler whether
    this rank skipped its step (weights unchanged) and its scale after ``update()``."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from ..hardware import rank_device
    device = rank_device()
    out = {}
    for name, make in (("GradScaler", torch.amp.GradScaler), ("ShardedGradScaler", ShardedGradScaler)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make(device.type, init_scale=2.0**8)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(torch.ones(2, 4, device=device)).sum()).backward()
        if rank == 0:
            model.weight.grad[0, 0] = float("inf")          # this rank's shard overflowed; the others' did not
        scaler.step(opt)
        scaler.update()
        out[name] = {"skipped": all(torch.equal(b, p) for b, p in zip(before, model.parameters())),
                     "scale after": scaler.get_scale()}
    return out
