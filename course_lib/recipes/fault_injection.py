"""Fault injection for the DDP recipe (notebook 08): ``--crash-at-epoch E`` makes one rank SIGKILL itself half-way
through epoch E, on the first attempt only, so a job that torchrun restarts can finish.

Not part of a training script a learner writes: ``python -m course_lib.recipes.train_ddp`` runs :func:`main`, which
takes these two flags off the command line, hands the rest to :func:`course_lib.recipes.train_ddp.main`, and arms the
trainer through its ``prepare`` hook. Without ``--crash-at-epoch`` nothing changes.
"""
from __future__ import annotations

import argparse
import os
import signal


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(the fault flags, the recipe's own arguments); a crash after the last epoch is refused at once."""
    from . import train_ddp
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--crash-at-epoch", type=train_ddp._positive(int), default=None,
                   help="fault injection: SIGKILL one rank half-way through this epoch, counted from 1 "
                        "(on the first attempt only, so a restarted job can finish)")
    p.add_argument("--crash-rank", type=int, default=1)
    faults, rest = p.parse_known_args(argv)
    args = train_ddp.parse_args(rest)
    if faults.crash_at_epoch is not None and faults.crash_at_epoch > args.epochs:
        p.error(f"--crash-at-epoch {faults.crash_at_epoch} is after the last epoch (--epochs {args.epochs})")
    return faults, rest


class CrashingLoader:
    """The trainer's loader, unchanged, except that rank ``crash_rank`` kills itself half-way through the epoch."""

    def __init__(self, loader, sampler, rank: int, faults: argparse.Namespace):
        self.loader, self.sampler, self.rank, self.faults = loader, sampler, rank, faults

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        epoch = self.sampler.epoch                         # set by set_epoch before the loop
        for step, batch in enumerate(self.loader):
            if (first_attempt and self.faults.crash_at_epoch == epoch + 1 and self.rank == self.faults.crash_rank
                    and step == len(self.loader) // 2):
                print(f"rank {self.rank}: killing myself half-way through epoch {epoch + 1} (fault injection)",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch


def arm(trainer, faults: argparse.Namespace) -> None:
    """Wrap ``trainer.loader`` when a crash is asked for; refuse a ``--crash-rank`` that is not a rank of the job."""
    if faults.crash_at_epoch is None:
        return
    world_size = trainer.ctx.world_size
    if not 0 <= faults.crash_rank < world_size:
        raise SystemExit(f"error: --crash-rank {faults.crash_rank} is not a rank of this job (0..{world_size - 1})")
    trainer.loader = CrashingLoader(trainer.loader, trainer.sampler, trainer.ctx.rank, faults)


def main(argv=None) -> dict:
    from . import train_ddp
    faults, rest = parse_args(argv)
    return train_ddp.main(rest, prepare=lambda trainer: arm(trainer, faults))
