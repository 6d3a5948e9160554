"""Whole-layer activation checkpointing of the small transformer: step time and memory, side by side.

Goal: checkpointing every block (``torch.utils.checkpoint``, non-reentrant) costs at most 1.45x the step time
of no checkpointing, while saving at least 60% of the activation bytes (the bytes held between forward and
backward). A training step is zero_grad, forward, backward and an AdamW step. The two models (same weights)
alternate in one process, one step each, for ``--rounds`` rounds (fine-grained alternation: on a busy machine a
time slice lost hits every policy alike); medians are compared. One thread on a
CPU (so that another busy process cannot stall a second one), the GPU where there is one. Selective
recomputation (keep every matrix product) is measured alongside, for reference.

Why about 1.33x is expected: recomputation runs each block's forward a second time, and a backward costs
about two forwards, so a step goes from 1 + 2 to 1 + 1 + 2 forwards. The model is sized so that the matrix
products, not Python's per-operator overhead, take the time (as in real training).

    python benchmarks/recompute_cost.py [--rounds 20] [--dim 256] [--seq 128] [--layers 4] [--batch 8]
"""
import argparse

from course_lib import hardware
from course_lib.launch import run
from course_lib.memory.recompute import step_time_worker
from course_lib.models import TransformerConfig

TIME_GOAL, SAVED_GOAL = 1.45, 0.60


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    cfg = TransformerConfig(seq_len=a.seq, dim=a.dim, heads=a.heads, hidden=4 * a.dim, layers=a.layers)
    policies = ("none", "full", "matmuls")
    r = run(step_time_worker, 1, cfg, a.batch, policies, a.rounds, a.steps, backend=hardware.default_backend(1),
            threads=1, show_output=False, timeout=900)[0]
    print(f"transformer: {a.layers} layers, width {a.dim}, {a.heads} heads, sequence {a.seq}, batch {a.batch}; "
          f"median of {a.rounds} rounds of {a.steps} steps")
    for name in policies:
        print(f"  {name:9}: {r[name]['seconds'] * 1e3:8.1f} ms per step, {r[name]['held'] / 2**20:7.2f} MiB held "
              f"({r[name]['seconds'] / r['none']['seconds']:.2f}x the time, "
              f"{r[name]['held'] / r['none']['held']:.0%} of the bytes)")
    ratio = r["full"]["seconds"] / r["none"]["seconds"]
    saved = 1 - r["full"]["held"] / r["none"]["held"]
    ok = ratio <= TIME_GOAL and saved >= SAVED_GOAL
    print(f"whole-layer checkpointing: {ratio:.2f}x the step time, {saved:.0%} of the activation bytes saved "
          f"(goal <= {TIME_GOAL}x and >= {SAVED_GOAL:.0%}: {'met' if ok else 'NOT met'})")


if __name__ == "__main__":
    main()
