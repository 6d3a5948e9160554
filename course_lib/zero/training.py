"""Training with every strategy of notebooks 09 and 10, and the one-process reference they must all equal.

:func:`train_worker` runs on every rank: each rank takes its own ``batch`` examples of each step's
global batch, trains with ``strategy`` and returns the full state dict. :func:`train_reference` is one
process on the global batch (``world_size * batch`` examples a step). A strategy is correct when the
two end with the same weights.

Strategies: ``"ddp"`` (torch DDP, its gradients views of its buckets), ``1``, ``2``, ``3`` (:func:`..shard`),
``"sharded_optimizer"`` (DDP + :class:`..ShardedOptimizer`), ``"fully_shard"`` (:func:`..fully_shard` + a
plain optimizer, with ``compute_dtype``), ``"fsdp2"`` (PyTorch's ``fully_shard``, :mod:`.fsdp2`), and
``"fsdp2_summed"``: FSDP2 made to sum the gradients instead of averaging them (the Gloo bug of
pytorch/pytorch#162338, on purpose), which a comparison with one process must catch.

On GPUs, compare with :func:`train_reference` run on the same device (``device=``): both sides then use
the same float32 arithmetic, and only the order of the sums differs, as on the CPU.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data import make_dataset
from ..hardware import rank_device
from ..models import make_mlp
from ..models.tiny_lm import TinyLM, token_batch
from ..models.transformer import lm_loss
from .api import full_state_dict, shard
from .optimizer import ShardedOptimizer
from .stage3 import cast_floating, fully_shard

OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}
MODELS = ("mlp", "tiny_lm", "twice")


class Twice(nn.Module):
    """One layer used twice in a forward pass: its hooks fire twice, its gradient is the sum of two uses."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layer, self.head = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.relu(self.layer(torch.relu(self.layer(x)))))


def build(model: str = "mlp", seed: int = 0) -> nn.Module:
    """``"mlp"``: 16 -> 30 -> 30 -> 5 (sizes no world size from 2 to 4 divides evenly, but 2 and 3 do 30);
    ``"tiny_lm"``: :class:`..models.TinyLM` (tied weights, a frozen parameter, a buffer); ``"twice"``:
    :class:`Twice` (a layer used twice)."""
    if model == "mlp":
        return make_mlp(dim=16, hidden=30, classes=5, depth=2, seed=seed)
    if model == "twice":
        return Twice(seed=seed)
    if model == "tiny_lm":
        return TinyLM(seed=seed)
    raise ValueError(f"unknown model {model!r}: use one of {MODELS}")


def batches(model: str, n: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``n`` examples each (inputs, targets)."""
    if model == "tiny_lm":
        return [token_batch(n, seed=seed + s) for s in range(steps)]
    x, y = make_dataset(n * steps, dim=16, classes=5, seed=seed).tensors
    return list(zip(x.split(n), y.split(n)))


def loss_fn(model: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss in fp32, whatever type the model computed in."""
    return lm_loss(output.float(), target) if model == "tiny_lm" else F.cross_entropy(output.float(), target)


def make_optimizer(name: str, params, sharded: bool = False):
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {list(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return ShardedOptimizer(params, cls, **kwargs) if sharded else cls(params, **kwargs)


def wrap(strategy, model: nn.Module, optimizer: str, compute_dtype=None):
    """``(model to call, optimizer)`` for ``strategy`` in a running process group."""
    cls, kwargs = OPTIMIZERS[optimizer]
    if strategy in (1, 2, 3):
        return shard(model, strategy, cls, **kwargs)
    if strategy == "ddp":                 # gradients as views of DDP's buckets: no second gradient-sized buffer
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, gradient_as_bucket_view=True), make_optimizer(optimizer, model.parameters())
    if strategy == "sharded_optimizer":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), make_optimizer(optimizer, model.parameters(), sharded=True)
    if strategy == "fully_shard":
        model = fully_shard(model, compute_dtype=compute_dtype)
        return model, make_optimizer(optimizer, model.parameters())
    if strategy in ("fsdp2", "fsdp2_summed"):
        from .fsdp2 import apply_fsdp2, sum_instead_of_average
        model = apply_fsdp2(model)
        if strategy == "fsdp2_summed":
            sum_instead_of_average(model)
        return model, make_optimizer(optimizer, model.parameters())
    raise ValueError(f"unknown strategy {strategy!r}")


def state_of(strategy, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a wrapped model, on the CPU."""
    if strategy in ("ddp", "sharded_optimizer"):
        model = model.module
    if strategy in ("fsdp2", "fsdp2_summed"):
        from .fsdp2 import fsdp2_full_state_dict
        state = fsdp2_full_state_dict(model)
    else:
        state = full_state_dict(model)
    return {k: v.cpu() for k, v in state.items()}


def train_worker(rank: int, world_size: int, strategy, model: str = "mlp", optimizer: str = "adamw",
                 steps: int = 3, batch: int = 4, compute_dtype=None, micro_batches: int = 1, dtype=None) -> dict:
    """Train ``steps`` steps on this rank's share of each global batch; return the full state dict.
    ``micro_batches`` > 1 accumulates the gradients of that many backward passes before each step. ``dtype``
    (e.g. ``torch.bfloat16``): the model is stored in it, and floating inputs are cast to it."""
    device = rank_device()
    wrapped, opt = wrap(strategy, build(model).to(device, dtype), optimizer, compute_dtype)
    for x, y in batches(model, world_size * batch, steps):
        mine = slice(rank * batch, (rank + 1) * batch)
        opt.zero_grad()
        for xm, ym in zip(x[mine].chunk(micro_batches), y[mine].chunk(micro_batches)):
            xm = xm.to(device, dtype) if dtype is not None and xm.is_floating_point() else xm.to(device)
            (loss_fn(model, wrapped(xm), ym.to(device)) / micro_batches).backward()
        opt.step()
    return state_of(strategy, wrapped)


def train_reference(world_size: int, model: str = "mlp", optimizer: str = "adamw", steps: int = 3,
                    batch: int = 4, compute_dtype=None, device=None) -> dict:
    """One process on the global batch, on ``device`` (the CPU by default); the state dict on the CPU. With
    ``compute_dtype``, it casts the way ``fully_shard`` does: a copy of the parameters in that type computes
    (inputs of every layer cast), fp32 steps."""
    device = torch.device(device or "cpu")
    master = build(model).to(device)
    opt = make_optimizer(optimizer, master.parameters())
    shadow = master
    if compute_dtype is not None:
        shadow = copy.deepcopy(master)                       # keeps tied weights tied
        for p in shadow.parameters():
            p.data = p.data.to(compute_dtype)
        for m in shadow.modules():
            if any(p is not None for p in m._parameters.values()):
                m.register_forward_pre_hook(lambda _, args: cast_floating(args, compute_dtype))
    for x, y in batches(model, world_size * batch, steps):
        opt.zero_grad()
        if shadow is not master:
            with torch.no_grad():
                for pm, ps in zip(master.parameters(), shadow.parameters()):
                    ps.copy_(pm)
            shadow.zero_grad()
        x, y = x.to(device), y.to(device)
        loss_fn(model, shadow(x), y).backward()
        if shadow is not master:
            for pm, ps in zip(master.parameters(), shadow.parameters()):
                pm.grad = None if ps.grad is None else ps.grad.float()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in master.state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
