"""On one GPU: the DDP step time of the recipe's model against the same model trained without DDP.

Goal: DDP within 5% of no DDP.  The model, optimizer (SGD with momentum) and bf16 autocast are
the recipe's (``course_lib.recipes.train_ddp``); NCCL with world size 1; both models in one process,
measured alternately, median of the rounds.  Two sizes: the recipe's defaults (a small MLP: a step is a
few kernel launches, so DDP's fixed cost per step shows most) and a GPU-sized one (``--hidden``).
Needs a CUDA GPU (prints why and exits 2 without one).

    python benchmarks/ddp_overhead_gpu.py [--hidden 4096] [--depth 8] [--batch-size 512] [--rounds 10]
"""
import argparse
import statistics
import sys
import time

import torch

from course_lib import hardware
from course_lib.launch import run
from course_lib.models import make_mlp
from course_lib.recipes import train_ddp


def worker(rank, world_size, configs, rounds, steps=20):
    """Median step times ``{"no DDP": s, "DDP": s}`` per config (the CPU under Gloo: for testing this code)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = hardware.rank_device()
    on_gpu = device.type == "cuda"
    results = []
    for hidden, depth, batch, lr in configs:
        x = torch.randn(batch, 16, device=device)                   # the recipe's data: 16 features
        y = torch.randint(4, (batch,), device=device)
        plain = make_mlp(hidden=hidden, depth=depth, seed=0).to(device)
        wrapped = DDP(make_mlp(hidden=hidden, depth=depth, seed=0).to(device),
                      device_ids=[device.index] if on_gpu else None)
        runs = {"no DDP": plain, "DDP": wrapped}
        opts = {k: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for k, m in runs.items()}
        times = {k: [] for k in runs}
        for r in range(rounds + 1):
            for name, model in runs.items():
                hardware.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    train_ddp.train_step(model, opts[name], x, y, amp=on_gpu)   # the recipe's own step
                hardware.synchronize(device)
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) / steps)
        results.append({k: statistics.median(v) for k, v in times.items()})
    return results


def main():
    defaults = train_ddp.parse_args([])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096, help="the GPU-sized row (the recipe's default: "
                   f"{defaults.hidden})")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    print(hardware.summary())
    if hardware.gpu_count() == 0:
        print("needs a CUDA GPU: nothing measured")
        sys.exit(2)
    configs = [(defaults.hidden, defaults.depth, defaults.batch_size, defaults.lr),
               (a.hidden, a.depth, a.batch_size, defaults.lr)]
    rows = run(worker, 1, configs, a.rounds, backend="nccl", show_output=False, timeout=900)[0]
    print("recipe's model (make_mlp), SGD momentum, bf16 autocast, 1 GPU, NCCL world size 1, median of "
          f"{a.rounds} rounds")
    for (hidden, depth, batch, _), t in zip(configs, rows):
        ratio = t["DDP"] / t["no DDP"]
        print(f"  hidden {hidden:5d} x depth {depth}, batch {batch:4d}: no DDP {t['no DDP'] * 1e3:7.3f} ms/step, "
              f"DDP {t['DDP'] * 1e3:7.3f} ms/step, ratio {ratio:.3f} "
              f"(goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")


if __name__ == "__main__":
    main()
