"""The course map: every notebook, what it teaches, the hardware it needs and how long it runs.

One list serves README's table (``python -m course_lib map`` prints it; a test keeps README equal to
it), notebook 00, and the preflight's "what runs on this machine" table.  A test keeps the list equal to
the notebooks in the repository.

The notebooks are not inside the installed package: :func:`notebook_dir` finds them (a source checkout,
the current folder or one above it, or ``$COURSE_NOTEBOOKS``) and :func:`searched` says where it looked.
"""
from __future__ import annotations

import json
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
    ``core_min`` and ``all_min``: a learner's time in minutes, on the core path and with the end
    exercises, measured by a read of someone new to distributed training (README says how).
    """

    file: str
    title: str
    learn: str
    gpus_for_all: int
    cpu: str
    runtime_s: int | None = None
    core_min: int | None = None
    all_min: int | None = None

    @property
    def number(self) -> str:
        return self.file[:2]


NOTEBOOKS: list[Notebook] = [
    Notebook("00_welcome.ipynb", "Welcome and your machine",
             "the course map; how to use the course; what your machine has; the preflight", 0, "full", 10, 25, 40),
    Notebook("01_ranks_and_collectives.ipynb", "Ranks and collectives on the CPU (Gloo)",
             "processes, ranks, the rendezvous; send/recv; every collective as a picture", 0, "full", 25, 80, 120),
    Notebook("02_allreduce_from_scratch.ipynb", "All-reduce from scratch",
             "naive, ring and recursive-doubling all-reduce; bus bandwidth; an α-β cost model", 0, "full", 25,
             91, 160),
    Notebook("03_data_parallel_from_scratch.ipynb", "Data parallelism from scratch",
             "gradient averaging by hand; DistributedSampler; overlap; buckets; a small DDP equal to torch's", 0,
             "full", 20, 90, 130),
    Notebook("04_ddp_in_practice.ipynb", "DDP in practice",
             "buffers and unused parameters; BatchNorm over all ranks; no_sync; Join; logging; checkpoints; "
             "scaling and the learning rate", 0, "full", 30, 90, 165),
    Notebook("05_ddp_nccl_torchrun.ipynb", "DDP on GPUs with NCCL and torchrun",
             "a typical DDP script from the web, fixed; torchrun; resume; multi-node and SLURM; NCCL variables; "
             "bf16; bus bandwidth", 2, "partial", 55, 90, 115),
    Notebook("06_model_parallel.ipynb", "Manual model parallelism",
             "training memory arithmetic; layers split across cuda:0/cuda:1 (you write it); the idle problem", 2,
             "partial", 10, 70, 90),
    Notebook("07_pipeline_schedules.ipynb", "Pipeline schedules",
             "GPipe and 1F1B (you write it); one stage's loop, its sends and receives (you write it); the bubble, "
             "measured; torch.distributed.pipelining: interleaved 1F1B, zero bubble (ZBV, DualPipeV)", 0, "full", 50,
             90, 135),
    Notebook("08_faults_and_debugging.ipynb", "Faults and debugging",
             "hangs made errors; a killed rank; resuming; atomic checkpoints; pitfalls", 0, "full", 50, 85, 145),
    Notebook("09_zero_from_scratch.ipynb", "ZeRO from scratch",
             "what data parallelism holds N times over; ZeRO-1 and a ZeRO-3 layer (you write them); the library's "
             "three stages, each equal to one process; traffic counted; what sharding breaks; meta-device init", 0,
             "full", 40, 90, 110),
    Notebook("10_fsdp2_and_checkpoints.ipynb", "FSDP2 and distributed checkpoints",
             "bytes held and sent per rank, measured; an FSDP2 training loop; prefetch order, the root's reshard, "
             "HSDP; bytes per parameter under mixed precision; the fully_shard wrapping (you write it); gradient "
             "accumulation; meta-device init; DCP saved on 4 ranks, loaded on 2; when sharding pays", 0, "full", 60,
             90, 155),
    Notebook("11_tensor_parallel.ipynb", "Tensor parallelism",
             "f and g; column/row-parallel layers; attention split by heads; every gradient equal to the unsplit "
             "block; communication per block", 0, "full", 40, 90, 145),
    Notebook("12_sequence_parallel_and_dtensor.ipynb", "Sequence parallelism, DTensor and 2-D meshes",
             "sequence parallelism and what it saves; dropout under TP; DTensor, DeviceMesh, parallelize_module; "
             "a 2×2 mesh with FSDP2", 0, "full", 60, 90, 160),
    Notebook("13_activation_memory.ipynb", "Activation memory and recomputation",
             "saved activations counted and derived; SDPA vs eager; memory over a step; recomputation under a "
             "budget (you choose it); chunked loss", 1, "partial", 60, 85, 105),
    Notebook("14_mixed_precision.ipynb", "Mixed precision",
             "fp32/bf16/fp16/fp8; master weights; the loss-scaling loop (you write it); bf16 on the wire at scale; "
             "exact gradient accumulation", 2, "partial", 60, 90, 107),
    Notebook("15_context_parallel.ipynb", "Context parallelism",
             "one sequence over many ranks: the log-sum-exp merge; ring attention; zig-zag; all-gather K/V; Ulysses",
             0, "full", 15, 80, 105),
    Notebook("16_expert_parallel.ipynb", "Expert parallelism (mixture of experts)",
             "routers, top-k and capacity; experts over ranks; all-to-all dispatch and combine; load balance",
             0, "full", 20, 85, 105),
    Notebook("17_putting_it_together.ipynb", "Putting it together",
             "a 2×2×2 mesh, FSDP2 × TP+SP × 1F1B, equal to one process (you write its groups); each group's "
             "messages; layouts ranked by time and memory (you choose one); MFU; a published table; what breaks first",
             1, "partial", 60, 85, 105),
]


def neighbours(nb: Notebook) -> tuple[Notebook | None, Notebook | None]:
    """The notebooks before and after ``nb`` in the course (``None`` at either end)."""
    i = NOTEBOOKS.index(nb)
    return (NOTEBOOKS[i - 1] if i else None), (NOTEBOOKS[i + 1] if i + 1 < len(NOTEBOOKS) else None)


def nav_line(nb: Notebook) -> str:
    """The links every notebook's first cell carries: the one before, the map, the glossary, the one after."""
    before, after = neighbours(nb)
    parts = [f"[← {before.number} · {before.title}]({before.file})"] if before else []
    parts += [f"[course map]({FIRST}#The-course-map)", "[glossary](glossary.md)"]
    parts += [f"[{after.number} · {after.title} →]({after.file})"] if after else []
    return " · ".join(parts)


def time_line(nb: Notebook) -> str:
    """The first cell's line on the learner's time: the core path, and with the end exercises."""
    return (f"**Learner time:** about {nb.core_min} min on the core path, {nb.all_min} min with the end exercises "
            f"(a first-time learner's read; the course map says how it was measured).")


def write_frames(folder: Path | None = None, write: bool = True) -> list[str]:
    """Put :func:`nav_line` under each notebook's title and :func:`time_line` at the end of its first cell,
    replacing the ones there (``python -m course_lib map --frames``; a test keeps them current).
    Returns the files it changed (with ``write=False``: the files it would change, changing none)."""
    folder = folder or notebook_dir()
    changed = []
    for nb in NOTEBOOKS:
        path = folder / nb.file
        text = path.read_text(encoding="utf-8")
        book = json.loads(text)
        lines = "".join(book["cells"][0]["source"]).split("\n")
        lines = [ln for ln in lines if not ln.startswith(("[← ", "[course map]", "**Learner time:**"))]
        while len(lines) > 1 and lines[1] == "" and (len(lines) < 3 or lines[2] == ""):
            del lines[1]
        while lines and lines[-1] == "":
            lines.pop()
        lines[1:1] = ["", nav_line(nb)]
        lines += ["", time_line(nb)]
        source = "\n".join(lines)
        book["cells"][0]["source"] = [ln + "\n" for ln in source.split("\n")[:-1]] + [source.split("\n")[-1]]
        new = json.dumps(book, indent=1, ensure_ascii=False) + "\n"
        if new != text:
            if write:
                path.write_text(new, encoding="utf-8")
            changed.append(nb.file)
    return changed


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
    rows = ["| # | notebook | you learn | hardware | learner time: core path / with exercises | 2-core CPU runtime |",
            "|---|---|---|---|---|---|"]
    for nb in NOTEBOOKS:
        runtime = f"~{nb.runtime_s} s" if nb.runtime_s else "—"
        link = f"[{nb.title}](notebooks/{nb.file})"
        learner = f"{nb.core_min} / {nb.all_min} min"
        rows.append(f"| {nb.number} | {link} | {nb.learn} | {hardware_label(nb)} | {learner} | {runtime} |")
    return "\n".join(rows)
