"""DDP training, production-shaped: a typical DDP script from the web, its bugs fixed.  Run it under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m course_lib.recipes.train_ddp --epochs 4

What it does that the web script did not:
* the device comes from ``LOCAL_RANK`` (the rank on this node), not the global rank, and ``set_device``
  is called before ``init_process_group``;
* it checks its launch (a launcher's environment, NCCL only with a GPU per rank, restarts that can work: see
  ``check_restarts``) and says what to do;
* the loss it logs is the mean over all ranks; a progress bar shows on rank 0 only;
* bf16 autocast on GPUs; a checkpoint (model, optimizer, epochs run) written atomically by rank 0
  every ``--save-every`` epochs, and resumed from automatically when the job is restarted;
* it destroys the process group at the end, also when training fails.

Notebook 08's fault injection (``--crash-at-epoch``, ``--crash-rank``) lives in
:mod:`course_lib.recipes.fault_injection`: run as a module, this file goes through it, and the listing a learner
reads (``setup``, ``Trainer``, ``main``) is what a job's own script holds.

The last line rank 0 prints is a JSON summary (losses, throughput, a fingerprint of the final weights).

Why ``main`` frees the trainer and collects before ``cleanup``: Gloo's worker threads outlive
``destroy_process_group`` once DDP has used the group (torch 2.13), and one still freeing the last all-reduce's
tensors while Python shuts down cannot take the GIL: the process aborts ("terminate called without an active
exception", 2 runs in ~100 under load). Freeing and collecting while Python is fully alive gives them the time to
finish.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course_lib import checkpoint, hardware
from course_lib.data import make_dataset
from course_lib.launch.commands import print_json
from course_lib.models import make_mlp

SNAPSHOT_KEYS = ("model", "optimizer", "epochs_run", "losses")
LAUNCH_HINT = "python -m torch.distributed.run --standalone --nproc-per-node=2 -m course_lib.recipes.train_ddp"


@dataclass
class Context:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; a bad value stops every rank at once with argparse's usage message."""
    p = argparse.ArgumentParser(description="DDP training recipe (run under torchrun)")
    count, real = _positive(int), _positive(float)
    p.add_argument("--epochs", type=count, default=4)
    p.add_argument("--batch-size", type=count, default=32, help="per rank")
    p.add_argument("--lr", type=real, default=0.05,
                   help="for one process with --batch-size; multiplied by the number of ranks (the linear scaling "
                        "rule: the global batch is that many times larger)")
    p.add_argument("--samples", type=count, default=2000)
    p.add_argument("--hidden", type=count, default=128)
    p.add_argument("--depth", type=count, default=3)
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto",
                   help="auto: bf16 on GPUs with bf16 tensor cores (compute capability 8.0+) only")
    p.add_argument("--checkpoint", default=None, help="snapshot path; resumed from when it exists")
    p.add_argument("--save-every", type=count, default=1, help="epochs between snapshots")
    p.add_argument("--out", default=None, help="where rank 0 writes the final weights")
    p.add_argument("--timeout", type=real, default=300, help="seconds before a stuck collective fails")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path, flag in ((args.checkpoint, "--checkpoint"), (args.out, "--out")):
        if path is not None and os.path.isdir(path):
            p.error(f"{flag} {path} is a directory: give a file name, e.g. {os.path.join(path, 'snapshot.pt')}")
    return args


def launch_env(environ=os.environ) -> dict[str, int]:
    """The ranks the launcher gave this process; a clear error when there is no launcher."""
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k not in environ]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not set. This script must be started by a launcher that "
                         f"sets RANK, LOCAL_RANK and WORLD_SIZE, for example:\n  {LAUNCH_HINT}")
    env = {k: int(environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["LOCAL_WORLD_SIZE"] = int(environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    return env


def choose_backend(requested: str | None, local_world_size: int) -> str:
    """The course's one backend policy (:func:`course_lib.hardware.check_backend`): NCCL when every rank on
    this node can have its own GPU, else Gloo; what cannot work stops the job at once, saying why."""
    try:
        return hardware.check_backend(requested, local_world_size)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def check_restarts(environ=os.environ) -> None:
    """Refuse, at once, a launch whose restarts cannot work.

    With a rendezvous (``--standalone``, or ``--rdzv-backend=c10d`` across nodes) the workers' ``env://`` store
    lives in torchrun's agent on node 0, and by default (since torch 2.5; checked in 2.11 and 2.13) that agent
    keeps **one** store for every restart round. Restarted workers then find the dead round's keys in it: the dead
    workers' addresses ("Connection refused"), or arrival counts that never add up (a wait until the timeout);
    on one node, 2 of 3 restarted jobs hung that way. Keys made per attempt from ``TORCHELASTIC_RESTART_COUNT``
    fix one node only: each node's agent counts its own restarts (the node whose worker died counts one; the
    others see a membership change, which does not count), so across nodes the ranks look for each other under
    different keys. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment makes every round start a
    fresh store, hosted by that round's rank 0; ``course_lib.launch.commands.torchrun`` and ``slurm_ddp.sbatch`` set it.
    """
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        example = LAUNCH_HINT.replace("--standalone", "--standalone --max-restarts=3")
        raise SystemExit(
            "error: torchrun --max-restarts needs a fresh rendezvous store for each restart, but this torchrun keeps "
            "one for the whole job: restarted workers would read the dead workers' addresses from it. Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, with a c10d rendezvous (--standalone, "
            f"or --rdzv-backend=c10d across nodes), e.g.\n  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 {example}")


def setup(args) -> Context:
    env = launch_env()
    check_restarts()                                       # --max-restarts that would hang: refused (notebook 05)
    backend = choose_backend(args.backend, env["LOCAL_WORLD_SIZE"])
    if backend == "nccl":
        device = torch.device("cuda", env["LOCAL_RANK"])   # LOCAL rank: rank 8 on node 2 is cuda:0
        torch.cuda.set_device(device)                      # before init_process_group
    else:
        device = torch.device("cpu")
    # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    return Context(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], backend, device)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """One step: forward (in bf16 under autocast when ``amp``; the weights stay fp32), loss in fp32,
    backward (DDP all-reduces the gradients during it), update. Returns the loss, not synchronised."""
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


class Trainer:
    def __init__(self, args, ctx: Context):
        self.args, self.ctx = args, ctx
        torch.manual_seed(args.seed)
        dataset = make_dataset(args.samples, seed=args.seed)
        model = make_mlp(hidden=args.hidden, depth=args.depth, seed=args.seed).to(ctx.device)
        self.model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
        self.lr = args.lr * ctx.world_size               # the global batch is world_size x --batch-size
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        self.sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=args.seed)
        self.loader = DataLoader(dataset, batch_size=args.batch_size, sampler=self.sampler,
                                 pin_memory=ctx.device.type == "cuda")
        self.amp = args.amp == "bf16" or (args.amp == "auto" and hardware.fast_bf16(ctx.device))
        self.epochs_run, self.losses = 0, []
        if args.checkpoint and os.path.exists(args.checkpoint):
            self._load_snapshot()

    def _save_snapshot(self) -> None:
        if self.ctx.rank == 0:                             # one writer, atomically
            snapshot = dict(zip(SNAPSHOT_KEYS, (self.model.module.state_dict(), self.optimizer.state_dict(),
                                                self.epochs_run, self.losses)))
            checkpoint.save_atomic(snapshot, self.args.checkpoint)
        dist.barrier()

    def _load_snapshot(self) -> None:
        path = self.args.checkpoint
        try:
            snap = checkpoint.load(path, map_location=self.ctx.device)
            missing = [k for k in SNAPSHOT_KEYS if not isinstance(snap, dict) or k not in snap]
            if missing:
                raise KeyError(", ".join(map(repr, missing)))
            self.model.module.load_state_dict(snap["model"])
            self.optimizer.load_state_dict(snap["optimizer"])
            for group in self.optimizer.param_groups:      # this job's world size sets the rate, not the snapshot's
                group["lr"] = self.lr
            self.epochs_run, self.losses = int(snap["epochs_run"]), list(snap["losses"])
        except Exception as e:                             # not ours, damaged, or another model's shape
            raise SystemExit(f"error: cannot resume from {path}: {checkpoint.why_unusable(e)}. It must be a "
                             f"snapshot this recipe wrote with the same --hidden ({self.args.hidden}) and "
                             f"--depth ({self.args.depth}):"
                             f" rerun with the options it was written with, or move it away to start afresh.") from e
        self.log(f"resumed from {self.args.checkpoint} after {self.epochs_run} epoch(s)")

    def log(self, message: str) -> None:
        if self.ctx.rank == 0:
            print(message, flush=True)

    def _run_epoch(self, epoch: int) -> float:
        from tqdm import tqdm
        self.sampler.set_epoch(epoch)                      # a new shuffle each epoch, the same on all ranks
        loss_sum, samples = torch.zeros((), device=self.ctx.device), 0
        bar = tqdm(self.loader, desc=f"epoch {epoch}", disable=self.ctx.rank != 0 or not sys.stderr.isatty())
        for x, y in bar:
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            loss = train_step(self.model, self.optimizer, x, y, self.amp)
            loss_sum += loss.detach() * len(y)             # stays on the device: no copy, no sync per step
            samples += len(y)
        totals = torch.stack([loss_sum, torch.tensor(float(samples), device=self.ctx.device)])
        dist.all_reduce(totals)                            # the mean loss over ALL ranks' samples
        return (totals[0] / totals[1]).item()

    def train(self) -> dict:
        start, samples = time.perf_counter(), 0
        for epoch in range(self.epochs_run, self.args.epochs):
            t0 = time.perf_counter()
            loss = self._run_epoch(epoch)
            seen = len(self.sampler) * self.ctx.world_size
            samples += seen
            self.losses.append(loss)
            self.epochs_run = epoch + 1
            self.log(f"epoch {epoch + 1}/{self.args.epochs}: loss {loss:.4f} (mean over {self.ctx.world_size} ranks), "
                     f"{seen / (time.perf_counter() - t0):.0f} samples/s")
            due = self.epochs_run % self.args.save_every == 0 or self.epochs_run == self.args.epochs
            if self.args.checkpoint and due:
                self._save_snapshot()
        state = self.model.module.state_dict()
        if self.args.out and self.ctx.rank == 0:
            checkpoint.save_atomic(state, self.args.out)
        elapsed = time.perf_counter() - start
        return {"event": "done", "world_size": self.ctx.world_size, "backend": self.ctx.backend,
                "device": self.ctx.device.type, "bf16": self.amp, "lr": self.lr, "epochs": self.epochs_run,
                "losses": self.losses,
                "samples_per_s": samples / elapsed if elapsed > 0 else None,
                "cpus": hardware.cpu_count(),                  # the cores it may use: what SLURM bound it to
                "weights": checkpoint.fingerprint(state)}


def main(argv=None, prepare=None) -> dict:
    """Parse, set up, train, clean up. ``prepare(trainer)``, when given, runs before training."""
    args = parse_args(argv)
    ctx = setup(args)
    trainer = None
    try:
        trainer = Trainer(args, ctx)
        if prepare is not None:
            prepare(trainer)
        summary = trainer.train()
        if ctx.rank == 0:
            print_json(summary)
        return summary
    finally:                                               # also when training raised:
        del trainer                                        # a Gloo workaround (torch 2.13; the module's
        gc.collect()                                       # docstring says why), harmless elsewhere
        cleanup()


if __name__ == "__main__":
    from course_lib.recipes import fault_injection  # notebook 08's --crash-at-epoch; a no-op without it
    fault_injection.main()
