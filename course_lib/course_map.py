"""The course map: every notebook, what it teaches, the hardware it needs and how long it runs.

One list serves README's table (``python -m course_lib map`` prints it; a test keeps README equal to
it), notebook 00, and the preflight's "what runs on this machine" table.  A test keeps the list equal to
the notebooks in the repository.

The notebooks are not inside the installed package: :func:`notebook_dir` finds them (a source checkout,
the current folder or one above it, or ``$COURSE_NOTEBOOKS``) and :func:`searched` says where it looked.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FIRST = "00_welcome.ipynb"   # the file that marks a folder as the course's notebooks


@dataclass(frozen=True)
class Notebook:
    """One notebook of the course.

    ``gpus_for_all``: GPUs needed to run every cell on GPUs (0: everything runs on the CPU).
    ``cpu``: what a machine without GPUs runs of it: ``"full"`` or ``"partial"`` (GPU cells fall
    back to the CPU and say so).  ``runtime_s``: measured top to bottom on a 2-core CPU machine.
    """

    file: str
    title: str
    learn: str
    gpus_for_all: int
    cpu: str
    runtime_s: int | None = None

    @property
    def number(self) -> str:
        return self.file[:2]


NOTEBOOKS: list[Notebook] = [
    Notebook("00_welcome.ipynb", "Welcome and your machine",
             "the course map; what your machine has; the preflight", 0, "full", 10),
    Notebook("01_ranks_and_collectives.ipynb", "Ranks and collectives on the CPU (Gloo)",
             "processes, ranks, the rendezvous; send/recv; every collective as a picture", 0, "full", 25),
    Notebook("02_allreduce_from_scratch.ipynb", "All-reduce from scratch",
             "naive, ring and recursive-doubling all-reduce; bus bandwidth; an α-β cost model", 0, "full", 25),
    Notebook("03_data_parallel.ipynb", "Data parallelism, from scratch to DDP",
             "gradient averaging, DistributedSampler, buckets and overlap, no_sync, LR scaling", 0, "full", 45),
    Notebook("04_ddp_nccl_torchrun.ipynb", "DDP on GPUs with NCCL and torchrun",
             "the seed program fixed; torchrun; resume; multi-node and SLURM; NCCL variables; bf16; bus bandwidth", 2,
             "partial", 55),
    Notebook("05_model_parallel.ipynb", "Manual model parallelism",
             "training memory arithmetic; layers split across cuda:0/cuda:1 (you write it); the idle problem", 2,
             "partial", 10),
    Notebook("06_pipeline_schedules.ipynb", "Pipeline schedules",
             "stages as processes; GPipe and 1F1B (you write it); the bubble, measured; torch.distributed.pipelining, "
             "interleaved 1F1B", 0, "full", 40),
    Notebook("07_faults_and_debugging.ipynb", "Faults and debugging",
             "hangs made errors; a killed rank; resuming; atomic checkpoints; pitfalls", 0, "full", 50),
    Notebook("08_sharded_data_parallel.ipynb", "Sharded data parallelism: ZeRO and FSDP2",
             "ZeRO-1/2/3 from scratch; bytes held and sent per rank; FSDP2, DTensor; sharded checkpoints (DCP)", 0,
             "full", 60),
    Notebook("09_tensor_parallel.ipynb", "Tensor parallelism",
             "f and g; column/row-parallel layers, attention split by heads; sequence parallelism; dropout under TP; "
             "DTensor, DeviceMesh, parallelize_module; a 2×2 mesh with FSDP2", 0, "full", 50),
    Notebook("10_memory_and_precision.ipynb", "Activation memory, recomputation and mixed precision",
             "saved activations counted and derived; checkpointing; fp32/bf16/fp16, loss scaling, bf16 on the wire; "
             "gradient accumulation; a layout calculator", 2, "partial", 30),
]


def searched() -> list[Path]:
    """Where :func:`notebook_dir` looks, in order: ``$COURSE_NOTEBOOKS``, the checkout this package lives in
    (an editable install), then ``notebooks/`` in the current folder and in each folder above it."""
    places = [Path(os.environ["COURSE_NOTEBOOKS"])] if os.environ.get("COURSE_NOTEBOOKS") else []
    places.append(Path(__file__).resolve().parent.parent / "notebooks")
    here = Path.cwd().resolve()
    places += [d / "notebooks" for d in (here, *here.parents)]
    places.append(here)                       # run from inside notebooks/ itself
    return list(dict.fromkeys(places))


def notebook_dir() -> Path | None:
    """The folder holding the course's notebooks, or ``None`` when none of :func:`searched` has them."""
    return next((d for d in searched() if (d / FIRST).is_file()), None)


def support(nb: Notebook, gpu_count: int) -> str:
    """How much of ``nb`` runs on a machine with ``gpu_count`` GPUs: ``full``, ``partial`` or ``no``."""
    if gpu_count >= nb.gpus_for_all:
        return "full"
    if gpu_count == 0:
        return nb.cpu
    return "partial"  # some GPUs, fewer than every cell wants: the rest is mapped or falls back


def hardware_label(nb: Notebook) -> str:
    if nb.gpus_for_all == 0:
        return "CPU"
    return f"CPU (part); all of it on {nb.gpus_for_all}+ GPU{'s' if nb.gpus_for_all > 1 else ''}"


def markdown_table() -> str:
    """The course map as a Markdown table (README's copy is checked against this)."""
    rows = ["| # | notebook | you learn | hardware | 2-core CPU runtime |", "|---|---|---|---|---|"]
    for nb in NOTEBOOKS:
        runtime = f"~{nb.runtime_s} s" if nb.runtime_s else "—"
        link = f"[{nb.title}](notebooks/{nb.file})"
        rows.append(f"| {nb.number} | {link} | {nb.learn} | {hardware_label(nb)} | {runtime} |")
    return "\n".join(rows)
