"""Things going wrong on purpose: hangs turned into errors, killed writers, and the classic pitfalls.

Every function here is a worker for ``launch.run`` (or a small harness around a subprocess), so the
notebook can break things and the tests can check that each break ends as a clear error, in time, with
no process left behind.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import checkpoint
from .launch import LaunchError, run


def announce() -> None:
    """Each demo starts by printing its pid, so a caller can check afterwards that the process is gone."""
    print(f"pid {os.getpid()}", flush=True)


def pids_in(outputs: list[str]) -> list[int]:
    return [int(m) for text in outputs for m in re.findall(r"^pid (\d+)$", text, re.M)]


def all_gone(pids: list[int], within: float = 10.0) -> bool:
    """True when none of ``pids`` is running any more (waiting up to ``within`` seconds)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def expect_failure(fn, world_size: int, error: type[LaunchError] = LaunchError, within: float | None = None,
                   quiet: bool = False, **run_kwargs) -> LaunchError:
    """Run a broken worker on Gloo ranks and return the error it ended with, after checking the promises:
    it raised ``error``, within ``within`` seconds, and no rank that announced itself is still running.

    Raises ``AssertionError`` (saying which promise broke) otherwise; prints the error's first line unless
    ``quiet``."""
    start = time.monotonic()
    try:
        run(fn, world_size, backend="gloo", show_output=False, **run_kwargs)
    except error as e:
        elapsed = time.monotonic() - start
        if not quiet:
            print(f"{type(e).__name__} after {elapsed:.1f} s:\n  " + str(e).splitlines()[0][:300])
        assert within is None or elapsed < within, f"took {elapsed:.1f} s, promised under {within} s"
        assert all_gone(pids_in(e.outputs)), "a rank was left behind"
        return e
    raise AssertionError(f"the broken worker {getattr(fn, '__name__', fn)} did not fail")


# ---- hangs --------------------------------------------------------------------------------------------

def only_rank_0_reduces(rank, world_size, pg_timeout: float = 3.0):
    """The classic bug: ``if rank == 0: dist.all_reduce(t)``. A process-group timeout turns it into an error.

    ``init_process_group(timeout=...)`` sets it for the default group, but also bounds the rendezvous
    (a slow-starting rank would trip it); a group of our own, from ``new_group``, carries just this one."""
    announce()
    group = dist.new_group(timeout=timedelta(seconds=pg_timeout))
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=group)     # waits for partners that never come...
    else:
        time.sleep(60)                     # ...because they are busy elsewhere (or at another collective)


def one_rank_never_arrives(rank, world_size, barrier_timeout: float = 2.0):
    """A rank that never reaches the barrier: ``monitored_barrier`` names it (Gloo only)."""
    announce()
    if rank == world_size - 1:
        time.sleep(60)                     # stuck in data loading, say
    dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout), wait_all_ranks=True)


def mismatched_shapes(rank, world_size):
    """Ranks all-reduce tensors of different shapes. With TORCH_DISTRIBUTED_DEBUG=DETAIL, torch says so."""
    announce()
    dist.all_reduce(torch.ones(2 + rank))


def silent_hang(rank, world_size):
    """Rank 0 waits in an all-reduce; rank 1 sleeps. Only the launcher's own timeout ends this one."""
    announce()
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


# ---- checkpoints under SIGKILL ----------------------------------------------------------------------------

WRITER = r"""
import sys, torch
from course_lib import checkpoint
path, mode, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
weights = torch.zeros(mib * 2**18)                       # mib MiB of float32
step = 0
while True:
    step += 1
    snapshot = {"step": step, "weights": weights + step}
    print(f"saving {step}", flush=True)                   # the write starts now
    if mode == "atomic":
        checkpoint.save_atomic(snapshot, path)
    else:
        torch.save(snapshot, path)                       # in place: truncates the file, then writes
"""


def kill_during_saves(path: str, atomic: bool, kills: int = 5, mib: int = 64, seed: int = 0) -> list[dict]:
    """Start a process that saves checkpoints back to back, SIGKILL it during a save, try to load the file.

    Each kill comes a random 0-5 ms after the writer announced its second (or a later) save, so there is
    always an earlier complete checkpoint to lose. Returns, per kill, whether the file loaded and its step.
    """
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    results = []
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, "atomic" if atomic else "inplace", str(mib)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            target = 2 + rng.randrange(3)
            for line in proc.stdout:
                if line.strip() == f"saving {target}":
                    break
            else:
                raise RuntimeError(f"the checkpoint writer stopped by itself: {proc.stderr.read()[-500:]}")
            time.sleep(rng.uniform(0, 0.005))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        try:
            step = checkpoint.load(path)["step"]
            results.append({"loadable": True, "step": step, "killed_while_saving": target})
        except Exception as e:
            results.append({"loadable": False, "error": f"{type(e).__name__}: {str(e)[:80]}",
                            "killed_while_saving": target})
    return results


class RunsCodeWhenLoaded:
    """A pickle that executes a call when loaded (here a harmless print): what weights_only=True refuses."""

    def __reduce__(self):
        return (print, ("this ran while the checkpoint was being loaded",))


# ---- pitfalls ------------------------------------------------------------------------------------------------

def seeds_worker(rank, world_size):
    """A model built from a seed of each rank's own, then wrapped in DDP; augmentation noise drawn from one seed and
    from seed + rank. Returns a fingerprint (the first layer's weight sum) of the model before and after DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .models import make_mlp
    model = make_mlp(seed=100 + rank)                     # a different initialisation on every rank
    before = model[0].weight.sum().item()
    after = DDP(model).module[0].weight.sum().item()      # DDP's constructor broadcasts rank 0's parameters
    torch.manual_seed(0)
    noise_same_seed = torch.rand(3)
    torch.manual_seed(0 + rank)
    noise_seed_plus_rank = torch.rand(3)
    return {"init_before_ddp": before, "init_after_ddp": after, "noise_same_seed": noise_same_seed.tolist(),
            "noise_seed_plus_rank": noise_seed_plus_rank.tolist()}


class _WorkerSeed(torch.utils.data.Dataset):
    """Each item: the seed of the DataLoader worker process that loaded it."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.utils.data.get_worker_info().seed


def dataloader_worker_seeds(generator=None, workers: int = 2) -> list[int]:
    """The seeds a ``DataLoader``'s worker processes got, one per worker (notebook 08's exercise 4). Without a
    ``generator`` they are drawn from torch's global generator: ranks seeded alike give their workers the same
    seeds."""
    loader = torch.utils.data.DataLoader(_WorkerSeed(), batch_size=1, num_workers=workers, generator=generator)
    return [int(seed) for (seed,) in loader]


def loss_logging_worker(rank, world_size):
    """Each rank's loss on its own shard, and the mean over ranks (what should be logged)."""
    import torch.nn.functional as F

    from .data import make_dataset
    from .models import make_mlp
    x, y = make_dataset(64 * world_size, seed=9).tensors
    local = F.cross_entropy(make_mlp(seed=0)(x[rank::world_size]), y[rank::world_size]).detach()
    mean = local.clone()
    dist.all_reduce(mean)
    return {"local": local.item(), "mean": mean.item() / world_size}


def port_in_use_worker(rank, world_size, busy_port: int):
    """Rendezvous on a hard-coded port that another program already holds."""
    announce()
    os.environ["MASTER_PORT"] = str(busy_port)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=10))


def matmul_worker(rank, world_size, n: int = 384, reps: int = 60) -> dict:
    """``reps`` n-by-n matrix products with this rank's thread count: the wall-clock seconds, and the CPU seconds
    all of this rank's threads spent (``time.process_time``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(5):
        a @ b
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        a @ b
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}
