"""Resuming FSDP2 training for real with DCP: not only the weights and the optimizer, but the learning-rate
scheduler, every rank's random-number generator and the position in the data.

:class:`TrainingState` is a DCP ``Stateful`` (an object with ``state_dict()`` and ``load_state_dict()``): DCP calls
the first when it saves and the second when it loads, so one ``dcp.save({"app": state})`` holds all of it. Each
rank's generator state is saved under its own key: DCP keeps one copy of a plain tensor saved under the same key by
every rank (it takes it to be replicated), and the ranks' generators differ.

The weights and the optimizer load on any world size; the per-rank generator states (``"rank 0"``, ``"rank 1"``...)
and each rank's place in the data do not: loaded on more ranks, DCP finds no ``"rank 2"`` and raises. Only the
CPU generator is saved; on GPUs a resumed run needs ``torch.cuda.get_rng_state()`` too. ``dcp.async_save`` stages
(copies) the state, writes it in the background and returns a future; :func:`resume_worker` waits on it at once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .fsdp2 import apply_fsdp2, fsdp2_full_state_dict
from .fsdp2_costs import BlockNet

WIDTH, STEPS = 16, 4


class TrainingState:
    """Everything a resumed run needs, as one DCP ``Stateful``. ``parts`` picks what is saved (all by default)."""

    def __init__(self, model, optimizer, scheduler, parts=("model", "scheduler", "rng", "data")):
        self.model, self.optimizer, self.scheduler, self.parts = model, optimizer, scheduler, parts
        self.step = 0                                      # the position in the data: batches consumed

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        if "scheduler" in self.parts:
            state["scheduler"] = self.scheduler.state_dict()
        if "rng" in self.parts:
            state["rng"] = {f"rank {dist.get_rank()}": torch.get_rng_state()}
        if "data" in self.parts:
            state["step"] = self.step
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            torch.set_rng_state(state["rng"][f"rank {dist.get_rank()}"])
        self.step = state.get("step", self.step)


def _setup(seed: int, parts):
    model = apply_fsdp2(BlockNet(WIDTH, 2, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)   # halves before step 4
    return TrainingState(model, opt, scheduler, parts)


def _train_until(state: TrainingState, stop: int) -> None:
    data = [torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    while state.step < stop:
        x = data[state.step].chunk(dist.get_world_size())[dist.get_rank()]
        x = x + 0.1 * torch.randn(x.shape)                 # noise from this rank's global generator
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1


def resume_worker(rank: int, world_size: int, path: str, parts=("model", "scheduler", "rng", "data"),
                  asynchronous: bool = False) -> dict:
    """Three runs of :data:`STEPS` steps: uninterrupted; the first half then a save of ``parts``; a fresh process
    state (other weights, other generator) that loads the save and finishes. Returns the uninterrupted and the
    resumed full weights, and whether the save was asynchronous (``dcp.async_save``, where this torch has it)."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(100 + rank)
    straight = _setup(0, parts)
    _train_until(straight, STEPS)
    torch.manual_seed(100 + rank)
    first = _setup(0, parts)
    _train_until(first, STEPS // 2)
    used_async = asynchronous and hasattr(dcp, "async_save")
    if used_async:
        dcp.async_save({"app": first}, checkpoint_id=path).result()   # written in the background; wait here
    else:
        dcp.save({"app": first}, checkpoint_id=path)
    dist.barrier()
    torch.manual_seed(999)                                  # a new process: another generator state
    resumed = _setup(123, parts)                            # and other weights
    dcp.load({"app": resumed}, checkpoint_id=path)
    _train_until(resumed, STEPS)
    return {"straight": fsdp2_full_state_dict(straight.model), "resumed": fsdp2_full_state_dict(resumed.model),
            "lr": resumed.scheduler.get_last_lr()[0], "async": used_async}
