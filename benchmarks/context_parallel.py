"""Ring attention against the all-gather-K/V variant: forward + backward time and the K/V bytes a rank holds.

Goal: on 4 ranks, ring attention takes at most 1.3x the all-gather variant's time, holding at most 1/2 of its
keys and values at once. "Holding" counts the K/V buffers each variant allocates in the forward pass, beside the
rank's own K and V, which both keep (with them counted, 3 blocks against 5 on 4 ranks). Both run on the same
inputs (causal, zig-zag layout: each rank an even share of the work) and alternate, a few steps each, for
``--rounds`` rounds; medians are compared, each step timed at its slowest rank. NCCL where every rank has its own
GPU, Gloo on the CPU otherwise.

    python benchmarks/context_parallel.py [--ranks 4] [--rounds 9] [--seq 2048] [--heads 8] [--head-dim 64]
"""
import argparse
import functools

import torch

from course_lib import hardware
from course_lib.launch import run
from course_lib.parallelism import side_by_side

GOALS = {"time": 1.3, "kv": 0.5}


def worker(rank, world_size, seq, heads, head_dim, rounds, steps):
    """Median seconds of a forward + backward of each variant, and the K/V bytes each held (rank 0's view)."""
    from course_lib import context_parallel as cp

    device = hardware.rank_device()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, seq // world_size, head_dim, generator=g).to(device).requires_grad_()
               for _ in range(3))
    variants = {"ring": cp.ring_attention, "all-gather K/V": cp.allgather_attention}
    held = {}

    def step(fn):
        fn(q, k, v, causal=True, layout="zigzag").sum().backward()

    for name, fn in variants.items():      # warm-up; count what each holds
        with cp.count() as counted:
            step(fn)
        held[name] = counted["kv_held"]
    calls = {name: functools.partial(step, fn) for name, fn in variants.items()}
    return side_by_side(calls, rounds, steps, device), held


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    backend = hardware.default_backend(a.ranks)
    times, held = run(worker, a.ranks, a.seq, a.heads, a.head_dim, a.rounds, a.steps, backend=backend,
                      show_output=False)[0]
    print(f"{a.ranks} ranks ({backend}), causal attention, sequence {a.seq} (zig-zag), {a.heads} heads of "
          f"{a.head_dim}, fp32; median of {a.rounds} rounds of {a.steps} forward + backward steps")
    for name in times:
        print(f"  {name:15}: {times[name] * 1e3:8.1f} ms a step, {held[name] / 2**20:6.2f} MiB of K/V buffers held "
              "at once, besides its own")
    ratio, kv = times["ring"] / times["all-gather K/V"], held["ring"] / held["all-gather K/V"]
    print(f"ratio ring / all-gather: time {ratio:.2f}x (goal <= {GOALS['time']}: "
          f"{'met' if ratio <= GOALS['time'] else 'NOT met'}), K/V held {kv:.2f}x (goal <= {GOALS['kv']}: "
          f"{'met' if kv <= GOALS['kv'] else 'NOT met'})")


if __name__ == "__main__":
    main()
