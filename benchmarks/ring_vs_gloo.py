"""Throughput of the hand-written ring all-reduce against Gloo's dist.all_reduce, measured side by side.

Goal: on 4 ranks of a 2-core CPU machine the ring reaches at least 0.6x Gloo's throughput
at 16 MiB and above.  Both run in the same process group, alternately, each timed as the best of
``--repeats`` (the slowest rank's time per all-reduce), so machine noise hits both alike.

    python benchmarks/ring_vs_gloo.py [--ranks 4] [--sizes-mib 16 32 64] [--repeats 7]
"""
import argparse

from course_lib import hardware
from course_lib.comm import allreduce
from course_lib.comm.costmodel import busbw, time_all_reduce
from course_lib.launch import run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    sizes = [m * 2**20 for m in a.sizes_mib]
    impls = {"ring": allreduce.ring_all_reduce, "dist.all_reduce": allreduce.library_all_reduce}
    res = run(time_all_reduce, a.ranks, impls, sizes, a.repeats, show_output=False, timeout=1800)[0]
    print(f"{a.ranks} ranks, float32, best of {a.repeats}")
    print(f"{'size':>8}  {'ring ms':>9} {'gloo ms':>9}  {'ring busbw':>11} {'gloo busbw':>11}  ring/gloo throughput")
    worst = float("inf")
    for s, tr, tg in zip(sizes, res["ring"], res["dist.all_reduce"]):
        ratio = tg / tr
        worst = min(worst, ratio)
        print(f"{s / 2**20:6.0f} MiB {tr * 1e3:9.1f} {tg * 1e3:9.1f}  {busbw(s, tr, a.ranks) / 1e9:8.2f} GB/s "
              f"{busbw(s, tg, a.ranks) / 1e9:8.2f} GB/s  {ratio:5.2f}x")
    print(f"lowest ratio {worst:.2f}x (goal >= 0.6: {'met' if worst >= 0.6 else 'NOT met'})")


if __name__ == "__main__":
    main()
