"""The from-scratch ZeRO-3 against PyTorch's FSDP2, and the optimizer state ZeRO leaves each rank.

Goals, each measured side by side in one run:
  1. from-scratch ZeRO-3 (course_lib.zero.fully_shard) step time <= 1.3x FSDP2's, same model, 2 ranks;
  2. per-rank optimizer-state bytes (AdamW) at 4 ranks <= 0.26x DDP's, for ZeRO stages 1, 2 and 3.
Step times: both strategies in one process group, alternating round after round; medians compared.

    python benchmarks/zero_vs_fsdp.py [--rounds 7] [--width 512] [--depth 4] [--batch 64]
"""
import argparse

from course_lib import hardware
from course_lib.launch import run
from course_lib.zero import measure


def state_bytes_worker(rank, world_size, width, depth):
    """This rank's optimizer-state bytes after two AdamW steps, under DDP and ZeRO stages 1, 2 and 3."""
    held = measure.memory_worker(rank, world_size, measure.STRATEGIES, width, depth)
    return {s: held[s]["optimizer states"] for s in measure.STRATEGIES}


def report(times: dict, state_bytes: dict) -> str:
    """The two goals, from median step times ``{3: s, "fsdp2": s}`` and the largest per-rank state bytes."""
    ratio = times[3] / times["fsdp2"]
    worst = max(state_bytes[s] / state_bytes["ddp"] for s in (1, 2, 3))
    lines = [f"  from-scratch ZeRO-3: {times[3] * 1e3:8.2f} ms/step",
             f"  FSDP2               : {times['fsdp2'] * 1e3:8.2f} ms/step",
             f"ratio ZeRO-3 / FSDP2 = {ratio:.2f}x (goal <= 1.3: {'met' if ratio <= 1.3 else 'NOT met'})",
             "optimizer-state bytes per rank at 4 ranks: "
             + ", ".join(f"{'DDP' if s == 'ddp' else f'ZeRO-{s}'} {b}" for s, b in state_bytes.items()),
             f"largest ratio ZeRO / DDP = {worst:.3f}x (goal <= 0.26: {'met' if worst <= 0.26 else 'NOT met'})"]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    times = run(measure.step_time_worker, 2, (3, "fsdp2"), a.width, a.depth, a.batch, a.rounds, 3,
                backend="gloo", show_output=False)[0]
    states = run(state_bytes_worker, 4, a.width, a.depth, backend="gloo", show_output=False)
    largest = {s: max(r[s] for r in states) for s in states[0]}
    print(f"MLP {a.depth} layers of {a.width}x{a.width}, batch {a.batch} per rank, AdamW, Gloo; "
          f"median of {a.rounds} rounds")
    print(report(times, largest))


if __name__ == "__main__":
    main()
