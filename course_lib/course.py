"""The course map: every notebook, what it teaches, the hardware it needs and how long it runs.

One list serves README's table (``python -m course_lib map`` prints it; a test keeps README equal to
it), notebook 00, and the preflight's "what runs on this machine" table.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


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
    def path(self) -> Path:
        return NOTEBOOK_DIR / self.file

    @property
    def available(self) -> bool:
        return self.path.exists()


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
             "training memory arithmetic; layers split across cuda:0/cuda:1; the idle problem", 2, "partial", 10),
    Notebook("06_pipeline_schedules.ipynb", "Pipeline schedules",
             "stages as processes; GPipe and 1F1B; the bubble, measured; activation memory", 0, "full", 25),
    Notebook("07_faults_and_debugging.ipynb", "Faults and debugging",
             "hangs made errors; a killed rank; resuming; atomic checkpoints; pitfalls", 0, "full", 50),
]


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
        name = f"[{nb.title}](notebooks/{nb.file})" if nb.available else f"{nb.title} (coming)"
        runtime = f"~{nb.runtime_s} s" if nb.runtime_s else "—"
        rows.append(f"| {nb.file[:2]} | {name} | {nb.learn} | {hardware_label(nb)} | {runtime} |")
    return "\n".join(rows)
