"""Measuring all-reduce and modelling its cost: bandwidths the nccl-tests way, and the α-β model.

**Algorithm bandwidth** is what a user sees: bytes reduced / time.  **Bus bandwidth** corrects it for
the algorithm's traffic: a ring all-reduce makes every rank send (and receive) 2(N-1)/N times the data,
so ``busbw = algbw * 2(N-1)/N``.  Bus bandwidth is comparable across world sizes and with the link's
specification (this is how nccl-tests reports it).

The **α-β model** says a message of n bytes costs ``α + n·β``: α is the latency (seconds per
message), β the inverse bandwidth (seconds per byte).  Each algorithm is a number of sequential
steps, each step a message:

* ring:                2(N-1) steps of n/N bytes: ``2(N-1)·α + 2(N-1)/N · n·β``
* recursive doubling:  log2(N) steps of n bytes: ``⌈log2 N⌉·(α + n·β)`` (+2 steps when N is no power of 2)
* naive:               2(N-1) messages of n bytes through rank 0's link: ``2(N-1)·(α + n·β)``
* reduce-scatter, all-gather (ring): N-1 steps of n/N bytes each: ``(N-1)·α + (N-1)/N · n·β``

Fit α and β to your own measurements (:func:`fit_alpha_beta`), and the model predicts the rest.

Real clusters have two levels: GPUs inside a node share fast links (NVLink; on HGX servers the domain is the
node's 8 GPUs, on rack-scale systems such as GB200 NVL72 it is 72), nodes talk over the network.
:func:`predict_two_level` models the hierarchical all-reduce that uses both.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import hardware


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce in bytes/s: ``algbw * 2(N-1)/N`` (nccl-tests' definition)."""
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size


def steps_and_volume(algorithm: str, world_size: int) -> tuple[float, float]:
    """(number of α terms, multiple of n·β) of ``algorithm`` on ``world_size`` ranks."""
    n = world_size
    if n == 1:
        return 0.0, 0.0
    if algorithm == "ring":
        return 2 * (n - 1), 2 * (n - 1) / n
    if algorithm == "recursive doubling":
        k = math.floor(math.log2(n)) + (0 if n & (n - 1) == 0 else 2)
        return k, k
    if algorithm == "naive":
        return 2 * (n - 1), 2 * (n - 1)
    if algorithm in ("reduce-scatter", "all-gather"):
        return n - 1, (n - 1) / n
    raise ValueError(f"no cost model for {algorithm!r}: use one of {', '.join(ALGORITHMS)}")


ALGORITHMS = ("ring", "recursive doubling", "naive", "reduce-scatter", "all-gather")
RING_OF = {"all-reduce": "ring", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter"}


def ring_steps_and_bytes(kind: str, nbytes: float, world_size: int) -> tuple[float, float]:
    """(sequential messages, bytes each rank sends) of the collective ``kind`` (``"all-reduce"``, ``"all-gather"``
    or ``"reduce-scatter"``) over an ``nbytes`` buffer, done as a ring on ``world_size`` ranks: the gather and the
    scatter move (N-1)/N of it, an all-reduce (one of each) twice that."""
    if kind not in RING_OF:
        raise ValueError(f"unknown collective {kind!r}: use one of {list(RING_OF)}")
    steps, volume = steps_and_volume(RING_OF[kind], world_size)
    return steps, volume * nbytes


def predict(algorithm: str, nbytes, world_size: int, alpha: float, beta: float):
    """Predicted seconds for one all-reduce of ``nbytes`` (a number or an array)."""
    steps, volume = steps_and_volume(algorithm, world_size)
    return steps * alpha + volume * np.asarray(nbytes, dtype=float) * beta


def predict_two_level(nbytes, gpus_per_node: int, nodes: int, intra: tuple[float, float],
                      inter: tuple[float, float]):
    """Seconds for a hierarchical all-reduce of ``nbytes`` on ``nodes`` x ``gpus_per_node`` GPUs.

    Three phases, each a ring: reduce-scatter inside every node over the fast links (``intra`` = (α, β)),
    so each GPU holds the node's sum of 1/g of the data; all-reduce of that 1/g across the nodes over the
    network (``inter``), GPU k of every node with GPU k of the others, all g rings at once, one network
    link per GPU; all-gather inside the node. The network carries 1/g of what a flat ring would make it carry.
    """
    g = gpus_per_node
    (a_i, b_i), (a_e, b_e) = intra, inter
    inside = predict("reduce-scatter", nbytes, g, a_i, b_i) + predict("all-gather", nbytes, g, a_i, b_i)
    return inside + predict("ring", np.asarray(nbytes, dtype=float) / g, nodes, a_e, b_e)


def fit_alpha_beta(nbytes, seconds, algorithm: str, world_size: int, relative: bool = False) -> dict:
    """Least-squares fit of α and β to measured times of ``algorithm``.

    Ordinary least squares on the times (so R² has its usual meaning), with α kept >= 0.  That fit is ruled by
    the largest messages, and α, a few microseconds next to their milliseconds, is what noise leaves over.
    ``relative=True`` minimises the *relative* errors instead (each time weighted by 1/t), so the small
    messages set α: use it when α is the number you want.  Returns α (s), β (s/byte), the implied bandwidth
    1/β (bytes/s), R² of the fitted times and the largest relative error.
    """
    x, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 3:
        raise ValueError("measure at least 3 message sizes to fit two parameters and judge the fit")
    steps, volume = steps_and_volume(algorithm, world_size)
    if steps == 0:
        raise ValueError("one rank communicates nothing: fit on 2 or more ranks")
    design = np.stack([np.full_like(x, steps), volume * x], axis=1)
    w = 1 / t if relative else np.ones_like(t)          # rows scaled by 1/t: least squares on relative errors
    (alpha, beta), *_ = np.linalg.lstsq(design * w[:, None], t * w, rcond=None)
    if alpha < 0:  # latency cannot be negative: refit the bandwidth term alone
        alpha = 0.0
        beta = float(np.linalg.lstsq(design[:, 1:] * w[:, None], t * w, rcond=None)[0][0])
    fitted = steps * alpha + volume * x * beta
    r2 = 1 - np.sum((t - fitted) ** 2) / np.sum((t - t.mean()) ** 2)
    return {"alpha": float(alpha), "beta": float(beta), "bandwidth": 1 / beta if beta > 0 else math.inf,
            "r2": float(r2), "max_rel_error": float(np.max(np.abs(fitted - t) / t))}


def _confirmed(samples: list[float], agree: float) -> bool:
    """Whether the two best samples agree within a fraction ``agree`` of the best."""
    best, second = sorted(samples)[:2]
    return second <= best * (1 + agree)


def time_all_reduce(rank, world_size, implementations: dict, sizes: list[int], repeats: int = 5,
                    min_seconds: float = 0.0, agree: float = 0.25) -> dict | None:
    """Worker: time each implementation on float32 tensors of ``sizes`` bytes; rank 0 returns the results.

    The tensors live where the backend wants them: on the rank's GPU with NCCL, in CPU memory with Gloo.

    Every measurement starts after a barrier, and the time of an all-reduce is the *slowest* rank's
    (an all-reduce is done when every rank has the result).  The best of ``repeats`` is kept (the least
    disturbed by other processes on a shared machine).  A best that no second sample confirms (within
    ``agree``, 25 %) may be a burst of load, not the machine: up to 3 x ``repeats`` samples are taken until
    two agree.  Every rank sees the same all-reduced samples, so all make the same choice.  Small messages
    are repeated until ``min_seconds`` have passed, to see past the clock's resolution.
    """
    device = hardware.rank_device()
    results: dict[str, list[float]] = {}
    for name, fn in implementations.items():
        results[name] = []
        for nbytes in sizes:
            x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)  # zeros never overflow
            fn(x)  # warm-up: connections, allocations
            samples = []
            while len(samples) < repeats or (1 < repeats and len(samples) < 3 * repeats
                                             and not _confirmed(samples, agree)):
                inner = 1
                while True:
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn(x)
                    hardware.synchronize(device)  # a GPU runs asynchronously: wait before reading the clock
                    elapsed = torch.tensor([(time.perf_counter() - t0) / inner], dtype=torch.float64, device=device)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if elapsed.item() * inner >= min_seconds or inner >= 1024:
                        break
                    inner *= 4
                samples.append(elapsed.item())
            results[name].append(min(samples))
    return results if rank == 0 else None


def algorithms_side_by_side(rank, world_size, names, nbytes: int, rounds: int = 7) -> dict:
    """Worker: median seconds of each of the all-reduce ``names`` (keys of ``allreduce.IMPLEMENTATIONS``) on one
    tensor of ``nbytes``, run in alternation (:func:`course_lib.parallelism.side_by_side`), so that a burst of load
    from another process hits all of them: their order holds on a busy machine where a sweep's separate timings,
    taken at different moments, do not."""
    from ..parallelism import side_by_side
    from .allreduce import IMPLEMENTATIONS

    device = hardware.rank_device()
    x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)   # zeros never overflow
    variants = {name: (lambda fn=IMPLEMENTATIONS[name]: fn(x)) for name in names}
    for fn in variants.values():
        fn()                                                                       # warm-up: connections
    return side_by_side(variants, rounds, 1, device)
