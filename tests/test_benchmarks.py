"""The benchmark scripts' own code: the GPU one's worker runs (on the CPU here), and it refuses without a GPU."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from course_lib.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ddp_overhead_worker_times_both_models_for_each_config():
    bench = load("ddp_overhead_gpu")
    rows = run(bench.worker, 1, [(16, 2, 8, 0.05), (32, 3, 16, 0.05)], 2, 3, backend="gloo", show_output=False)[0]
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"no DDP", "DDP"} and all(t > 0 for t in row.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_ddp_overhead_benchmark_says_it_needs_a_gpu():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ddp_overhead_gpu.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stdout


def test_context_parallel_worker_times_both_variants_and_the_ring_holds_half_the_keys():
    bench = load("context_parallel")
    times, held = run(bench.worker, 4, 64, 2, 8, 1, 1, backend="gloo", show_output=False)[0]
    assert set(times) == set(held) == {"ring", "all-gather K/V"} and all(t > 0 for t in times.values())
    assert held["ring"] * 2 == held["all-gather K/V"]        # two blocks of four against the whole sequence
