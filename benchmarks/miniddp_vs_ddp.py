"""Step time of the from-scratch MiniDDP against torch's DistributedDataParallel, side by side.

Goal: MiniDDP's step time <= 1.25x torch DDP's.  Both wrap the same model in the same
process group and alternate, a few steps each, for ``--rounds`` rounds; medians are compared.

    python benchmarks/miniddp_vs_ddp.py [--ranks 2] [--rounds 15]
"""
import argparse

from course_lib import hardware
from course_lib.data_parallel import measure
from course_lib.launch import run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    print(hardware.summary().splitlines()[0])
    t = run(measure.compare_wrappers_worker, a.ranks, a.width, a.depth, a.batch, a.rounds, 5, backend="gloo",
            show_output=False)[0]
    ratio = t["mini_ddp"] / t["torch_ddp"]
    print(f"{a.ranks} ranks, MLP {a.width} wide, {a.depth} layers, batch {a.batch} per rank, "
          f"median of {a.rounds} rounds")
    print(f"  MiniDDP  : {t['mini_ddp'] * 1e3:7.2f} ms/step")
    print(f"  torch DDP: {t['torch_ddp'] * 1e3:7.2f} ms/step")
    print(f"ratio MiniDDP / torch DDP = {ratio:.2f}x (goal <= 1.25: {'met' if ratio <= 1.25 else 'NOT met'})")


if __name__ == "__main__":
    main()
