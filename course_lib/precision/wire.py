"""Precision on the wire: gradients all-reduced in bf16 (DDP's ``bf16_compress_hook``) and FSDP2's
``MixedPrecisionPolicy(reduce_dtype=...)``, with the bytes each collective moves counted, not assumed.

**DDP.** A communication hook replaces DDP's all-reduce of each gradient bucket. ``bf16_compress_hook``
casts the fp32 bucket to bf16 and divides it by the world size, all-reduces that (half the bytes), and
casts the result back into the fp32 bucket. The price is not one rounding: the sum itself is done in bf16,
and a ring rounds the running sum at every hop, so the error grows with the ranks (:func:`ring_sum_error`:
about 0.23% at 2 ranks, 0.8% at 64, several % at 512). No bound like 2^-8 holds for a sum. FSDP2 with
``param_dtype=torch.bfloat16`` and ``reduce_dtype`` unset reduces in bf16 too; at scale, reduce in fp32.

PyTorch refuses ``bf16_compress_hook`` *by its name* unless torch was built with CUDA or ROCm and NCCL/RCCL
2.10+, or with XPU and XCCL (``DistributedDataParallel._check_comm_hook``, mirrored by :func:`refuses_bf16_hook`);
Gloo all-reduces bf16 tensors on the CPU without trouble. So where it is refused :func:`bf16_compress` calls
PyTorch's very hook under another name; with NCCL the hook is registered as it is.

**FSDP2.** ``fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=...))``: the sharded fp32 parameters are all-gathered as bf16 for the forward and backward, and
the gradients reduce-scattered in ``reduce_dtype``; the optimizer still steps fp32 shards.

The collectives are counted by :class:`course_lib.comm.record.CollectiveLog` (a dispatch mode that sees every ``c10d``
operator): DDP's default all-reduce is issued from C++ and is invisible to it, so the
fp32 baseline registers PyTorch's ``allreduce_hook``, which does what the default does, from Python.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..comm.record import CollectiveLog
from ..hardware import backend_kind


def bf16_compress(process_group, bucket):
    """PyTorch's ``default_hooks.bf16_compress_hook``, called under a name DDP does not refuse on CPU builds."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def hooks() -> dict:
    """The hooks to compare: ``"fp32"`` (what DDP does by default) and ``"bf16"`` (PyTorch's hook itself when
    NCCL is the backend, else :func:`bf16_compress`)."""
    bf16 = default_hooks.bf16_compress_hook if backend_kind() == "nccl" else bf16_compress   # 'cuda:nccl,cpu:gloo' too
    return {"fp32": default_hooks.allreduce_hook, "bf16": bf16}


def refuses_bf16_hook() -> bool:
    """Whether DDP will refuse ``bf16_compress_hook`` by name on this build (torch's own test, 2.11 to 2.13)."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = (dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)()
            and hasattr(torch, "xpu") and torch.xpu.is_available())
    return not ((cuda and nccl) or xccl)


def refusal_on_this_build() -> str | None:
    """The error DDP raises when ``bf16_compress_hook`` is registered here (``None`` where it is accepted)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(nn.Linear(2, 2).to(_device()))
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as e:
        return str(e)
    return None


def _device() -> torch.device:
    from ..hardware import rank_device
    return rank_device()


def _batch(cfg, batch: int, step: int, rank: int, world_size: int):
    """The rank's slice of step ``step``'s global batch of ``batch`` sequences."""
    from ..data import make_token_dataset
    x, y = make_token_dataset(batch * (step + 1), cfg.seq_len, cfg.vocab, seed=step).tensors
    mine = slice(step * batch + rank * batch // world_size, step * batch + (rank + 1) * batch // world_size)
    return x[mine].to(_device()), y[mine].to(_device())


def exact_average(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``model`` on this rank's batch, all-reduced in fp32 and divided by the world size."""
    from ..models.transformer import lm_loss
    grads = torch.autograd.grad(lm_loss(model(x), y), list(model.parameters()))
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return list(grads)


def _relative_error(got, exact) -> float:
    got, exact = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in exact])
    return ((got - exact).norm() / exact.norm()).item()


def ddp_compress_worker(rank: int, world_size: int, cfg, steps: int = 10, batch: int = 16, lr: float = 3e-3) -> dict:
    """DDP training of the small transformer with each hook of :func:`hooks`, from the same start on the same
    data: the collectives of one backward (kind, bytes), the averaged gradients' relative error against the
    exact fp32 average after the first backward, and the losses; ``"refusal"``: what registering PyTorch's
    ``bf16_compress_hook`` itself says on this build (:func:`refusal_on_this_build`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..models.transformer import lm_loss, transformer
    out = {"refusal": refusal_on_this_build()}
    for name, hook in hooks().items():
        model = DDP(transformer(cfg).to(_device()))
        plain = transformer(cfg).to(_device())               # the same weights, not wrapped
        model.register_comm_hook(None, hook)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        losses, log = [], CollectiveLog()
        for step in range(steps):
            x, y = _batch(cfg, batch, step, rank, world_size)
            opt.zero_grad()
            loss = lm_loss(model(x), y)
            if step == 0:
                with log:
                    loss.backward()
                error = _relative_error([p.grad for p in model.module.parameters()], exact_average(plain, x, y))
            else:
                loss.backward()
            opt.step()
            loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / world_size)
        out[name] = {"collectives": [(r.kind, r.nbytes) for r in log.records], "gradient_error": error,
                     "losses": losses, "params": sum(p.numel() for p in model.parameters())}
    return out


def fsdp_reduce_dtype_worker(rank: int, world_size: int, cfg, reduce_dtypes=(torch.float32, torch.bfloat16),
                             batch: int = 8) -> dict:
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)`` on every block and the root:
    per reduce dtype (``None``: unset, so the reduction runs in ``param_dtype``), the collectives of one forward and
    backward (kind, bytes, phase), the gradients' dtype, and their relative error against the first reduce dtype's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..models.transformer import lm_loss, transformer
    out, reference = {}, None
    x, y = _batch(cfg, batch, 0, rank, world_size)
    for rd in reduce_dtypes:
        model = transformer(cfg).to(_device())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=rd)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        log = CollectiveLog()
        with log:
            loss = lm_loss(model(x), y)
            with log.during("backward"):
                loss.backward()
        grads = [p.grad.to_local().float() for p in model.parameters()]
        reference = grads if reference is None else reference
        out[str(rd).replace("torch.", "")] = {
            "collectives": [(r.kind, r.nbytes, r.phase) for r in log.records],
            "grad_dtype": str(next(model.parameters()).grad.dtype).replace("torch.", ""),
            "error_vs_first": _relative_error(grads, reference)}
    return out


def ring_sum_error(world_size: int, dtype: torch.dtype = torch.bfloat16, n: int = 20_000, noise: float = 1.0,
                   seed: int = 0) -> float:
    """The relative error (norm) of the average gradient that ``bf16_compress_hook``'s arithmetic gives on
    ``world_size`` ranks, simulated in one process: each rank's gradient is a shared signal plus its own noise
    (``noise`` times as large), cast to ``dtype`` and divided by the world size (the hook), then summed as a ring
    sums a chunk: one hop after another, the running sum rounded to ``dtype`` at every hop. The exact average is
    computed in fp64. ``dtype=torch.float32``: the same ring with an fp32 reduction."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(n, generator=g)
    exact = torch.zeros(n, dtype=torch.float64)
    running = None
    for _ in range(world_size):
        grad = shared + noise * torch.randn(n, generator=g)
        exact += grad.double() / world_size
        part = grad.to(dtype).div_(world_size)                 # the hook: cast, then divide
        running = part if running is None else running + part  # one hop: the sum rounded to dtype
    return ((running.double() - exact).norm() / exact.norm()).item()
