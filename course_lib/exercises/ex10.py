"""Notebook 10's exercise: wrap a model in FSDP2 the way a training run wants it.

The learner writes ``fn(model, mesh)`` for a :class:`~course_lib.zero.fsdp2_costs.BlockNet` (a stack of
``model.blocks`` and a ``model.head`` the root owns) and returns the model, sharded: one ``fully_shard`` unit per
block, then the root; each block freed after its forward (``reshard_after_forward=True``); bf16 compute with fp32
gradient reduction (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``).

The check runs it on 2 Gloo ranks, with the library's own wrapper switched off (``course_lib.zero.fsdp2.apply_fsdp2``
raises while the learner's function runs). It reads which modules became units, which parameters are held whole
between forward and backward, the dtype the first layer computes in and the bytes reduce-scattered, and trains two
AdamW steps against :func:`reference` on the same data. Each usual mistake is named by its own message.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import passed, run_attempt, wrong

WIDTH, DEPTH = 32, 3
HINTS = {"Invariant encountered": "this is what torch raises when fully_shard was applied to the root before its "
                                  "blocks. Call it bottom-up: each block first, then the root (the root's call "
                                  "takes only the parameters no unit has taken yet)",
         "must have the same dtype": "a layer got bf16 inputs and fp32 weights, or the other way round. Pass the "
                                     "same mp_policy=MixedPrecisionPolicy(...) to every fully_shard call, the "
                                     "root's too (the head computes in the root's unit), and keep the model in "
                                     "fp32: no model.to(torch.bfloat16), the policy does the casting"}


def reference(model, mesh):
    """One unit per block, then the root; bf16 compute, fp32 reduce-scatter."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _switched_off(*args, **kwargs):
    raise RuntimeError("course_lib.zero.fsdp2.apply_fsdp2 is switched off during the check: write the "
                       "fully_shard calls yourself")


def probe(rank: int, world_size: int, fn) -> dict:
    """Worker: wrap a BlockNet with ``fn``; what it became, and two AdamW steps against the reference wrapping."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from ..comm.record import CollectiveLog
    from ..zero import fsdp2
    from ..zero.fsdp2_costs import BlockNet
    saved, fsdp2.apply_fsdp2 = fsdp2.apply_fsdp2, _switched_off
    try:
        mesh = fsdp2.mesh()
        model = fn(BlockNet(WIDTH, DEPTH), mesh)
    finally:
        fsdp2.apply_fsdp2 = saved
    if not isinstance(model, nn.Module):
        return {"returned": type(model).__name__}
    units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not isinstance(model, FSDPModule):
        return {"returned": "Module", "units": units, "root": False}
    stored = sorted({str(p.to_local().dtype) for p in model.parameters()})
    fsdp2.force_sum_on_gloo(model)
    ref = reference(BlockNet(WIDTH, DEPTH), mesh)
    fsdp2.force_sum_on_gloo(ref)
    seen = []
    model.blocks[0].up.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    result = {"returned": "Module", "units": units, "root": True, "stored": stored}
    gaps = []
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        x = torch.randn(4, WIDTH, generator=g)
        log = CollectiveLog()
        with log:
            out = model(x)
            whole = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
            with log.during("backward"):
                out.float().pow(2).mean().backward()
        ref(x).float().pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step == 0:
            n = sum(p.numel() for p in model.parameters())
            result |= {"whole after forward": whole, "compute": seen[0] if seen else None,
                       "reduce-scatter bytes per parameter": sum(
                           r.nbytes for r in log.records if r.kind == "reduce-scatter") / n}
    for p, q in zip(model.parameters(), ref.parameters()):
        gaps.append((p.full_tensor() - q.full_tensor()).abs().max().item())
    return result | {"gap": max(gaps)}


def _diagnose(r: dict) -> str | None:
    if r["returned"] != "Module":
        return f"your function returned a {r['returned']}: return the model you wrapped"
    blocks = [f"blocks.{i}" for i in range(DEPTH)]
    units = r["units"]
    if not r["root"]:
        return ("the root was not wrapped: call fully_shard(model, ...) last, after the blocks. Without it the "
                "head's weights stay whole on every rank and their gradients are never averaged"
                + (f" (units found: {units})" if units else ""))
    if units == ["<root>"]:
        return ("only the root is a unit: fully_shard(model) alone all-gathers the whole model at once, so every "
                "rank holds all of its weights during forward. Call fully_shard on each block first, then the root")
    if "head" in units:
        return ("model.head is a unit of its own. It is not inside a block, and some recipes do wrap the output "
                "layer alone, but then the root owns no parameters and the head is freed after forward. Here the "
                "root takes the head: call fully_shard on the blocks and on the model only")
    inner = [u for u in units if u not in blocks and u != "<root>"]
    if inner:
        return (f"units inside the blocks ({inner[:3]}): one unit per Linear doubles the collectives, each a "
                "smaller message paying α. Wrap each block (model.blocks[i]) as one unit")
    if sorted(set(blocks) - set(units)):
        return f"these blocks are not units: {sorted(set(blocks) - set(units))}: wrap every block"
    held = sorted({n.split(".")[0] + "." + n.split(".")[1] for n in r["whole after forward"] if n.startswith("blocks")})
    if held:
        return (f"{held} keep their whole weights from forward to backward: that is reshard_after_forward=False. "
                "Use True for the blocks (the default): freed after forward, gathered again in backward")
    if not {"head.weight", "head.bias"} <= set(r["whole after forward"]):
        return ("the root's head was freed after forward: that is reshard_after_forward=True on the root. Leave the "
                "root at fully_shard's default (None), which keeps the root's weights for backward: they are the "
                "first it needs, so freeing them only gathers them again at once")
    if r["stored"] != ["torch.float32"]:
        return (f"the shards are stored in {r['stored']}: the shards are the master weights, keep them fp32 (no "
                "model.to(torch.bfloat16)). MixedPrecisionPolicy's param_dtype casts only the gathered copy")
    if r["compute"] != torch.bfloat16:
        return (f"the layers compute in {r['compute']}, not bfloat16: pass "
                "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...) to every fully_shard call")
    if r["reduce-scatter bytes per parameter"] < 4:
        return ("the gradients are reduce-scattered in bfloat16 (2 bytes a parameter): reduce_dtype defaults to "
                "param_dtype. Set reduce_dtype=torch.float32 so the ranks' gradients are summed in fp32")
    if r["gap"] > 1e-6:
        return f"after 2 AdamW steps the weights differ from the reference wrapping by {r['gap']:.2g}"
    return None


def check_fsdp_wrapping(fn):
    """``fn(model, mesh)`` wraps a BlockNet and returns it: checked on 2 Gloo ranks."""
    results, feedback = run_attempt(probe, 2, fn, timeout=120, error_hints=HINTS,
                                    timeout_hint="Every rank must call fully_shard on the same modules, in order.")
    if feedback is not None:
        return feedback
    message = _diagnose(results[0])
    if message:
        return wrong(message)
    return passed("one unit per block and the root; blocks freed after forward, the root's head kept for backward; "
                  "bf16 compute and fp32 reduce-scatters; two AdamW steps equal to the reference wrapping")
