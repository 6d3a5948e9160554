"""What this machine has, and where each rank should run.

Every notebook asks the same three questions, and this module answers them in one place:

* **What is here?**  CPU cores, GPUs (count, names, memory) and the communication backends
  torch was built with (``gloo`` everywhere, ``nccl`` on NVIDIA GPUs, ``mpi`` rarely).
* **Which backend?**  NCCL talks GPU-to-GPU and is the right choice when *every rank has a GPU of
  its own*.  It refuses two ranks on one GPU ("Duplicate GPU detected"), so when there are more ranks
  than GPUs, or no GPU at all, we use Gloo, which runs any number of ranks on CPU tensors (and on
  CUDA tensors too, for the collectives it supports).
* **Which device?**  A rank's device is chosen by its *local* rank (its index on this machine), never
  by its global rank: on the second node of a two-node job global rank 8 is still ``cuda:0``.

Model-parallel notebooks ask for ``cuda:0`` and ``cuda:1``; :func:`map_device` maps such requests onto
the devices that exist (``cuda:1`` becomes ``cuda:0`` on a one-GPU machine and ``cpu`` on a laptop)
and says so, so the same code runs everywhere and the learner knows what really happened.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU."""

    index: int
    name: str
    memory_gib: float
    capability: str

    def __str__(self) -> str:
        return f"cuda:{self.index} {self.name} ({self.memory_gib:.0f} GiB, sm_{self.capability})"


def cpu_count() -> int:
    """CPU cores this process may use (respects taskset/cgroup affinity, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 on a machine without them). Does not initialise CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus() -> list[GpuInfo]:
    """Name, memory and compute capability of each visible GPU."""
    out = []
    for i in range(gpu_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(GpuInfo(i, p.name, p.total_memory / 2**30, f"{p.major}{p.minor}"))
    return out


def backends() -> dict[str, bool]:
    """Which communication backends this build of torch has: ``{'gloo': True, 'nccl': ..., 'mpi': ...}``."""
    if not dist.is_available():
        return {b: False for b in BACKENDS}
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA and NCCL versions (``None`` where absent)."""
    nccl = None
    if backends()["nccl"] and torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def default_backend(local_world_size: int = 1) -> str:
    """``'nccl'`` when each of the ``local_world_size`` ranks on this machine can have a GPU of its own,
    otherwise ``'gloo'``.  The one backend policy of the course: ``launch.run`` and the recipes use it."""
    if backends()["nccl"] and 0 < local_world_size <= gpu_count():
        return "nccl"
    return "gloo"


def check_backend(backend: str | None, local_world_size: int) -> str:
    """Resolve ``backend`` (``None`` means :func:`default_backend`) and refuse what cannot work.

    ``local_world_size`` is the number of ranks on *this* machine (all of them for ``launch.run``;
    ``LOCAL_WORLD_SIZE`` under torchrun).  Raises ``ValueError`` at once, with what to do, instead of
    letting a run fail later inside NCCL.
    """
    if backend is None:
        return default_backend(local_world_size)
    backend = str(backend).lower()
    gloo = "use the gloo backend (backend='gloo'; --backend gloo for a script)"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)} (or None to pick one)")
    if backend == "nccl" and gpu_count() == 0:
        raise ValueError(f"the nccl backend needs CUDA GPUs and this machine has none: {gloo} to run the ranks "
                         "on the CPU.")
    if not backends()[backend]:
        have = [b for b, ok in backends().items() if ok]
        raise ValueError(f"this build of torch has no {backend!r} backend; it has {have}: {gloo}.")
    if backend == "nccl":
        n = gpu_count()
        if local_world_size > n:
            raise ValueError(
                f"the nccl backend needs one GPU per rank: {local_world_size} ranks on this machine and it has "
                f"{n} GPU{'s' if n != 1 else ''}. NCCL refuses two ranks on one GPU: {gloo} to run several ranks "
                f"on one GPU, or start at most {n} rank{'s' if n != 1 else ''} here.")
    return backend


def local_rank() -> int:
    """This process's index on its machine: ``LOCAL_RANK``, as every launcher sets it (``launch.run``, torchrun,
    the SLURM script). Never the global rank: on the second node, global rank 8 is local rank 0."""
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("LOCAL_RANK is not set: start the ranks with a launcher that sets it (torchrun, or "
                           "course_lib.launch.run), or pass the local rank yourself")
    return int(os.environ["LOCAL_RANK"])


def device_for_rank(local_rank: int, backend: str | None = None) -> torch.device:
    """The device a rank should compute on, chosen by its **local** rank.

    NCCL: ``cuda:local_rank`` (one GPU each).  Gloo: GPUs are shared round-robin when there are any
    (Gloo moves CUDA tensors through host memory), else the CPU.
    """
    n = gpu_count()
    if backend == "nccl":
        if local_rank >= n:
            raise ValueError(f"local rank {local_rank} has no GPU of its own ({n} visible): use backend='gloo'")
        return torch.device("cuda", local_rank)
    if n:
        return torch.device("cuda", local_rank % n)
    return torch.device("cpu")


def backend_kind() -> str:
    """The running process group's backend as one word: ``'nccl'`` when NCCL serves it (also for a compound
    backend such as ``'cuda:nccl,cpu:gloo'``), ``'gloo'`` for Gloo alone (also spelt ``'cpu:gloo'``), otherwise
    the name ``dist.get_backend()`` gives. Compare this, never ``dist.get_backend()``'s exact string."""
    name = str(dist.get_backend())
    for kind in ("nccl", "gloo"):
        if kind in name:
            return kind
    return name


def rank_device() -> torch.device:
    """Where this rank's tensors live in a running process group: its own GPU under NCCL (chosen by its
    local rank), the CPU under Gloo (whose hand-written point-to-point paths need host memory)."""
    if backend_kind() == "nccl":
        return device_for_rank(local_rank(), "nccl")
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` to finish its queued work before reading a clock (a GPU runs asynchronously;
    a CPU has nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively on ``device``: NVIDIA GPUs from Ampere on (compute capability 8.0,
    bf16 tensor cores). Older GPUs (V100, T4) accept bf16 but emulate it: slower than fp32, not faster."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def map_device(requested: str | torch.device, verbose: bool = True) -> torch.device:
    """Map a requested device onto one that exists here, printing the mapping when it changes.

    ``cuda:1`` on a one-GPU machine becomes ``cuda:0``; any CUDA device becomes ``cpu`` without GPUs.
    A string PyTorch does not know as a device raises ``ValueError`` saying what is accepted.
    """
    try:
        dev = torch.device(requested)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{requested!r} is not a device: use 'cpu', 'cuda' or 'cuda:N' (N = 0, 1, ...)") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"{requested!r}: this course maps only 'cpu' and 'cuda:N' devices")
    n = gpu_count()
    index = 0 if dev.index is None else dev.index
    if n == 0:
        mapped, why = torch.device("cpu"), "no GPU on this machine"
    elif index >= n:
        mapped, why = torch.device("cuda", index % n), f"only {n} GPU{'s' if n != 1 else ''} here"
    else:
        return torch.device("cuda", index)
    if verbose:
        print(f"device {dev} -> {mapped} ({why})")
    return mapped


def summary() -> str:
    """A few lines that say what this machine is: print it at the top of every notebook."""
    v = versions()
    gpu_list = gpus()
    lines = [
        f"python {v['python']}, torch {v['torch']}, {platform.system()} {platform.machine()}, "
        f"{cpu_count()} CPU core{'s' if cpu_count() != 1 else ''}",
        "GPUs: " + ("; ".join(map(str, gpu_list)) if gpu_list else "none (ranks run on the CPU with Gloo)"),
        "backends: " + ", ".join(f"{b}{'' if ok else ' (absent)'}" for b, ok in backends().items())
        + (f"; CUDA {v['cuda']}, NCCL {v['nccl']}" if gpu_list else ""),
    ]
    return "\n".join(lines)
