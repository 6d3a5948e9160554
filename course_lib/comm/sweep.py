"""Notebook 02's measurements as functions: the all-reduce sweep over message sizes and world sizes, the
ratios it prints, and the α-β model fitted to the ring's times (so that the notebook's cells stay short)."""
from __future__ import annotations

import os

from .. import hardware
from ..launch import run
from . import allreduce, costmodel


def sweep_sizes(full: bool | None = None) -> tuple[list[int], int]:
    """The sweep's message sizes (bytes) and repeats: 4 KiB to 64 MiB in steps of 4x, best of 3.  With
    ``COURSE_FULL_SWEEP=1`` in the environment (or ``full=True``): 1 KiB to 256 MiB in steps of 2x, best of 5
    (several minutes)."""
    full = os.environ.get("COURSE_FULL_SWEEP") == "1" if full is None else full
    return ([2**k for k in range(10, 29)], 5) if full else ([2**k for k in range(12, 27, 2)], 3)


def measure(world_sizes, sizes: list[int], repeats: int, timeout: float = 1200) -> dict:
    """Time every all-reduce of ``allreduce.IMPLEMENTATIONS`` (the three written by hand and
    ``dist.all_reduce``) on each of ``world_sizes``, back to back on the same ranks, with
    :func:`costmodel.time_all_reduce`.  NCCL with GPU tensors where every rank has its own GPU, else Gloo with
    CPU tensors; prints which.  Returns ``{world size: {name: [seconds, one per size]}}``."""
    times = {}
    for n in world_sizes:
        backend = hardware.default_backend(n)
        print(f"{n} ranks: {'NCCL, GPU tensors' if backend == 'nccl' else 'Gloo, CPU tensors'}")
        times[n] = run(costmodel.time_all_reduce, n, allreduce.IMPLEMENTATIONS, sizes, repeats,
                       backend=backend, show_output=False, timeout=timeout)[0]
    return times


def print_ratios(times: dict, sizes: list[int], world_size: int, against: str = "ring") -> dict:
    """Print each implementation's time over ``against``'s at the smallest and the largest size, on
    ``world_size`` ranks; returns ``{name: (ratio at the smallest, ratio at the largest)}``."""
    base, ratios = times[world_size][against], {}
    for name, t in times[world_size].items():
        if name == against:
            continue
        ratios[name] = (t[0] / base[0], t[-1] / base[-1])
        print(f"{name} / {against}: {ratios[name][0]:.2f} at {sizes[0] // 2**10} KiB, "
              f"{ratios[name][1]:.2f} at {sizes[-1] // 2**20} MiB")
    return ratios


def fit_ring(sizes: list[int], seconds: list[float], world_size: int) -> dict:
    """The α-β model fitted to the ring's measured times on ``world_size`` ranks.

    Two least-squares fits of :func:`costmodel.fit_alpha_beta`.  The ordinary one is ruled by the largest
    messages, whose milliseconds outweigh everything else: it gives β and R² (the share of the times' variance
    the model explains).  Its α is what those messages leave over, and noise can push it to 0.  So α comes
    from a second fit, on *relative* errors, where the small messages count as much as the large.
    Returns α (s), β (s/byte), the bandwidth 1/β (bytes/s) and R².
    """
    ols = costmodel.fit_alpha_beta(sizes, seconds, "ring", world_size)
    rel = costmodel.fit_alpha_beta(sizes, seconds, "ring", world_size, relative=True)
    return {"alpha": rel["alpha"], "beta": ols["beta"], "bandwidth": ols["bandwidth"], "r2": ols["r2"]}
