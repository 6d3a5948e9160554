"""Data-parallel scaling on a CPU: 2 ranks of 1 thread each against 1 rank of 1 thread, side by side.

Goal: >= 1.7x the samples/s on a compute-bound model on a 2-core machine.  Both are torch
DDP over Gloo with the same batch per rank (so the global batch doubles), measured alternately
``--rounds`` times; the median of each is compared.

    python benchmarks/dp_scaling.py [--rounds 3] [--width 512] [--batch 2048]
"""
import argparse
import functools
import statistics

from course_lib import hardware
from course_lib.data_parallel import measure
from course_lib.launch import run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    job = functools.partial(measure.throughput_worker, width=a.width, depth=a.depth, batch=a.batch, steps=a.steps)
    rates = {1: [], 2: []}
    for _ in range(a.rounds):
        for n in rates:
            rates[n].append(run(job, n, backend="gloo", threads=1, show_output=False)[0])
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"MLP {a.width} wide, {a.depth} layers, batch {a.batch} per rank, torch DDP over Gloo, 1 thread per rank")
    print(f"  1 rank : {one:10.0f} samples/s   (rounds: {', '.join(f'{r:.0f}' for r in rates[1])})")
    print(f"  2 ranks: {two:10.0f} samples/s   (rounds: {', '.join(f'{r:.0f}' for r in rates[2])})")
    print(f"speed-up 2 ranks / 1 rank = {two / one:.2f}x (goal >= 1.7: {'met' if two / one >= 1.7 else 'NOT met'})")


if __name__ == "__main__":
    main()
