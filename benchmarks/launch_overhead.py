"""How long a trivial 4-rank job takes with course_lib.launch.run and with torchrun, side by side.

Both do the same work: start 4 ranks, initialise a Gloo process group, all-reduce one tensor, tear down.
Prints the median wall time of each and their ratio (goal: run / torchrun <= 0.1 after the first run).

    python benchmarks/launch_overhead.py [--repeats 10] [--torchrun-repeats 3] [--ranks 4]
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from course_lib import hardware
from course_lib.launch import run

JOB = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def job(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--torchrun-repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])

    t = time.perf_counter()
    assert run(job, a.ranks, show_output=False) == [float(a.ranks)] * a.ranks
    first = time.perf_counter() - t
    runs = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        run(job, a.ranks, show_output=False)
        runs.append(time.perf_counter() - t)

    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(JOB)
        f.flush()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}", f.name]
        tr = []
        for _ in range(a.torchrun_repeats):
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            tr.append(time.perf_counter() - t)

    med_run, med_tr = statistics.median(runs), statistics.median(tr)
    print(f"{a.ranks} ranks, init + all_reduce + teardown")
    print(f"  course_lib run, first call (starts the forkserver): {first:6.2f} s")
    print(f"  course_lib run, median of {a.repeats}:                  {med_run:6.3f} s  (min {min(runs):.3f})")
    print(f"  torchrun --standalone, median of {a.torchrun_repeats}:             {med_tr:6.3f} s  (min {min(tr):.3f})")
    ratio = med_run / med_tr
    print(f"ratio run / torchrun = {ratio:.3f}  (goal <= 0.1: {'met' if ratio <= 0.1 else 'NOT met'})")


if __name__ == "__main__":
    main()
