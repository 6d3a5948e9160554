"""On one GPU: the DDP step time of the recipe's model against the same model trained without DDP.

Goal (issue 5): DDP within 5% of no DDP.  NCCL with world size 1, both models in the same process,
alternating; bf16 autocast as in the recipe.  Needs a CUDA GPU (prints why and exits 2 without one).

    python benchmarks/ddp_overhead_gpu.py [--width 4096] [--depth 8] [--batch 512] [--rounds 10]
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from course_lib import hardware
from course_lib.data import make_mlp
from course_lib.launch import run


def worker(rank, world_size, width, depth, batch, rounds, steps=10):
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = torch.device("cuda", 0)
    x, y = torch.randn(batch, width, device=device), torch.randint(10, (batch,), device=device)
    plain = make_mlp(dim=width, hidden=width, classes=10, depth=depth).to(device)
    wrapped = DDP(make_mlp(dim=width, hidden=width, classes=10, depth=depth).to(device), device_ids=[0])
    opts = {"no DDP": (plain, torch.optim.AdamW(plain.parameters())),
            "DDP": (wrapped, torch.optim.AdamW(wrapped.parameters()))}
    times = {k: [] for k in opts}
    for r in range(rounds + 1):
        for name, (model, opt) in opts.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
            if r:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    print(hardware.summary())
    if hardware.gpu_count() == 0:
        print("needs a CUDA GPU: nothing measured")
        sys.exit(2)
    t = run(worker, 1, a.width, a.depth, a.batch, a.rounds, backend="nccl", show_output=False, timeout=900)[0]
    ratio = t["DDP"] / t["no DDP"]
    print(f"MLP {a.width} wide x {a.depth}, batch {a.batch}, bf16 autocast, AdamW, 1 GPU, NCCL world size 1")
    print(f"  no DDP: {t['no DDP'] * 1e3:.2f} ms/step   DDP: {t['DDP'] * 1e3:.2f} ms/step")
    print(f"ratio DDP / no DDP = {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")


if __name__ == "__main__":
    main()
