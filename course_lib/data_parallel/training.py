"""Training loops for notebooks 03 and 04: one process, and N ranks kept in step four different ways.

:func:`train_worker` is the data-parallel loop every rank runs: a ``DistributedSampler`` gives each rank
its shard; ``set_epoch`` reshuffles it every epoch; after ``backward()`` the gradients are synchronised
by the chosen strategy; the logged loss is the average over all ranks, not rank 0's alone.

:func:`train_reference` is the proof: one process that trains on the *global* batch, the union of the
ranks' batches at each step.  Data parallelism is correct when the two end with the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from ..data import make_dataset
from ..models import WithExtras, make_mlp
from .mini_ddp import MiniDDP, average_gradients

STRATEGIES = ("none", "by_hand", "mini_ddp", "torch_ddp")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the same on every rank)."""

    n: int = 1000                  # data set size: not a multiple of the world size on purpose
    batch_size: int = 16           # per rank; the global batch is world_size times larger
    epochs: int = 2
    lr: float = 0.1
    warmup_steps: int = 0          # linear learning-rate warm-up from lr/warmup_steps to lr
    hidden: int = 64
    depth: int = 2
    model: str = "mlp"             # "mlp", or "extras": BatchNorm buffers and an unused parameter
    strategy: str = "by_hand"      # how gradients are synchronised, one of STRATEGIES
    bucket_cap_mb: float = 25.0
    drop_last: bool = False
    seed: int = 0

    def with_(self, **changes) -> TrainConfig:
        return replace(self, **changes)


def build_model(cfg: TrainConfig):
    if cfg.model == "extras":
        return WithExtras(hidden=cfg.hidden, seed=cfg.seed)
    if cfg.model == "mlp":
        return make_mlp(hidden=cfg.hidden, depth=cfg.depth, seed=cfg.seed)
    raise ValueError(f"unknown model {cfg.model!r}: use 'mlp' or 'extras'")


def _optimizer(params, cfg: TrainConfig):
    opt = torch.optim.SGD(params, lr=cfg.lr)
    warm = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
    return opt, sched


def wrap(model, cfg: TrainConfig):
    """``model`` wrapped for ``cfg.strategy``: MiniDDP, torch DDP, or itself (``none``, ``by_hand``)."""
    if cfg.strategy == "mini_ddp":
        return MiniDDP(model, bucket_cap_mb=cfg.bucket_cap_mb)
    if cfg.strategy == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, bucket_cap_mb=cfg.bucket_cap_mb, find_unused_parameters=cfg.model == "extras")
    if cfg.strategy in ("none", "by_hand"):
        return model
    raise ValueError(f"unknown strategy {cfg.strategy!r}: use one of {STRATEGIES}")


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Run on every rank: returns the final weights and the loss averaged over ranks at each step."""
    dataset = make_dataset(cfg.n, seed=cfg.seed)
    model = build_model(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=cfg.drop_last)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler)
    wrapped = wrap(model, cfg)
    opt, sched = _optimizer(wrapped.parameters(), cfg)
    losses = []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(wrapped(x), y)
            loss.backward()
            if cfg.strategy == "by_hand":
                average_gradients(model)
            elif cfg.strategy == "mini_ddp":
                wrapped.finish_gradient_synchronization()
            opt.step()
            sched.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)                # log the mean over ranks, not rank 0's loss
            losses.append(logged.item() / world_size)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "losses": losses}


def sampler_shards(n: int, world_size: int, shuffle: bool = False, epoch: int = 0, seed: int = 0,
                   drop_last: bool = False) -> list[list[int]]:
    """The indices each rank's ``DistributedSampler`` yields in ``epoch`` (the real sampler, not a copy)."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def global_batches(cfg: TrainConfig, world_size: int, epoch: int) -> list[torch.Tensor]:
    """The indices of each step's global batch: rank 0's batch, then rank 1's, ... (as the ranks see them)."""
    per_rank = [torch.tensor(shard).split(cfg.batch_size)
                for shard in sampler_shards(cfg.n, world_size, True, epoch, cfg.seed, cfg.drop_last)]
    return [torch.cat([batches[t] for batches in per_rank]) for t in range(len(per_rank[0]))]


def train_reference(cfg: TrainConfig, world_size: int) -> dict:
    """One process, one model, the global batch at every step: what N ranks must reproduce."""
    x_all, y_all = make_dataset(cfg.n, seed=cfg.seed).tensors
    model = build_model(cfg)
    opt, sched = _optimizer(model.parameters(), cfg)
    losses = []
    for epoch in range(cfg.epochs):
        for idx in global_batches(cfg, world_size, epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return {"state": model.state_dict(), "losses": losses}


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' floating-point tensors."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())

