"""Notebook 05's capstone: a typical DDP script from the web, fixed by the learner, run as two "nodes" of one GPU each.

The script (see notebook 05) has bugs that only show on more than one node: it uses the *global* rank as
the device index, picks the device after ``init_process_group`` (not a failure there, but a trap: see the check's
message), never destroys the process group, and keeps the
learning rate of one process while the global batch grows with the ranks. The check runs the learner's file the way a
two-node job runs it: two ``torchrun`` agents over loopback (:func:`course_lib.launch.commands.torchrun_nodes`), one
worker each, so global rank 1 is local rank 0 of node 1. Each "node" has one GPU, simulated on the CPU by
:func:`node_gpus`, so the global-rank bug fails here as it does on a cluster: node 1 has no second GPU.

The program gets its pieces from this module (so that the check can see what it did): :func:`node_gpus` (the GPUs of
this node), :func:`set_device` (``torch.cuda.set_device``), :class:`YourModel`, :func:`YourDataset` and
:func:`report`. Run as ``python -m course_lib.exercises.ex05 FILE``, the module runs the learner's file and then says
whether the process group was left initialised.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..data import make_dataset
from ..launch.commands import print_json
from ..models import make_mlp
from . import NOT_ATTEMPTED, Feedback, passed, wrong

BASE_LR = 0.01          # the web script's learning rate, tuned for one process with batch 32
PER_RANK_BATCH = 32     # the web script's batch size per rank
GPUS_PER_NODE_ENV = "COURSE_GPUS_PER_NODE"
_state = {"set_device_before_init": None}


class NodeGPUs:
    """The GPUs of this node: ``cuda:0`` .. ``cuda:{n-1}``, simulated on the CPU (each is ``torch.device("cpu")``).

    Indexing past the node's GPUs fails as ``torch.cuda.set_device(8)`` fails on an 8-GPU node."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.device:
        if not 0 <= index < self.count:
            raise IndexError(f"cuda:{index} does not exist on this node: it has {self.count} GPU(s), "
                             f"cuda:0..cuda:{self.count - 1} (global rank {os.environ.get('RANK')}, "
                             f"local rank {os.environ.get('LOCAL_RANK')})")
        return torch.device("cpu")


def node_gpus() -> NodeGPUs:
    """This node's GPUs: as many as ``$COURSE_GPUS_PER_NODE`` (the check sets 1), else as many as its ranks."""
    return NodeGPUs(int(os.environ.get(GPUS_PER_NODE_ENV, os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def set_device(device: torch.device) -> None:
    """``torch.cuda.set_device`` for the simulated GPUs: records whether it came before ``init_process_group``."""
    _state["set_device_before_init"] = not dist.is_initialized()
    if device.type == "cuda":
        torch.cuda.set_device(device)


def YourModel() -> torch.nn.Module:  # noqa: N802 (the web script's name)
    """The web script's ``YourModel()``: the course's small classifier, the same weights on every rank."""
    return make_mlp(seed=0)


def YourDataset(n: int = 512):  # noqa: N802 (the web script's name)
    """The web script's ``YourDataset()``: generated points in 4 classes."""
    return make_dataset(n, seed=0)


def report(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Print, as JSON, what the check needs to know about this rank's run."""
    module = getattr(model, "module", model)
    print_json({"event": "report", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "lr": optimizer.param_groups[0]["lr"], "weights": checkpoint.fingerprint(module.state_dict()),
                "set_device_before_init": _state["set_device_before_init"]})


def _run_file(path: str) -> None:
    """``python -m course_lib.exercises.ex05 FILE``: run the learner's program, then report what it left behind.

    It ends with ``os._exit``: once DDP has used a Gloo group, Gloo's threads can still be freeing the last
    all-reduce while Python shuts down, and abort the process (see the recipe's ``main``); the check is about the
    program, not that race."""
    import gc
    program = runpy.run_path(path, run_name="__main__")
    left = dist.is_available() and dist.is_initialized()
    print_json({"event": "exit", "rank": int(os.environ.get("RANK", -1)), "group_left_initialised": left})
    program.clear()
    gc.collect()
    sys.stdout.flush()
    os._exit(0)


REFERENCE = Path(__file__).with_name("web_ddp_fixed.py")


def _run_two_nodes(path) -> tuple[list[dict] | None, str]:
    """Run ``path`` as 2 nodes x 1 worker; the JSON lines it printed (``None`` when it failed) and its output."""
    from ..launch.commands import CommandError, json_lines, torchrun_nodes
    try:
        nodes = torchrun_nodes("course_lib.exercises.ex05", str(path), nnodes=2, nproc_per_node=1, module=True,
                               timeout=180, echo=False, env={GPUS_PER_NODE_ENV: "1"})
    except CommandError as e:
        return None, e.output
    return [line for node in nodes for line in json_lines(node.output)], "".join(n.output for n in nodes)


def _run_three_ranks(path) -> float | None:
    """Run ``path`` as 1 node x 3 workers (3 GPUs); the learning rate it reported, ``None`` when it did not run."""
    from ..launch.commands import CommandError, json_lines, torchrun
    try:
        done = torchrun("course_lib.exercises.ex05", str(path), nproc_per_node=3, module=True, timeout=180,
                        echo=False, env={GPUS_PER_NODE_ENV: "3"})
    except CommandError:
        return None
    return next((line["lr"] for line in json_lines(done.output) if line.get("event") == "report"), None)


_reference_weights: dict[str, str] = {}


def check_web_script(path) -> Feedback:
    """Run the learner's fixed web script as two nodes of one GPU each, and name what is still wrong.

    It verifies four things: each rank's device is its local rank's; the device is picked before
    ``init_process_group``; the process group is destroyed at the end; the learning rate is ``BASE_LR`` times the
    world size (also on a one-node job of 3 ranks, so a hard-coded number is caught). Then the final weights must
    equal the reference solution's."""
    path = Path(path)
    if not path.is_file():
        return wrong(f"{path} does not exist: run the cell that writes the program first")
    if "raise NotImplementedError" in path.read_text():
        return Feedback(NOT_ATTEMPTED, "remove the `raise NotImplementedError` line and fix the program, then run "
                                       "the check again")
    lines, output = _run_two_nodes(path)
    if lines is None:
        if "does not exist on this node" in output:
            return wrong("node 1 has one GPU, cuda:0, and its worker asked for the device of its GLOBAL rank, 1. A "
                         "rank's device is its LOCAL rank: int(os.environ['LOCAL_RANK']), which torchrun sets")
        tail = "\n".join(output.strip().splitlines()[-6:])
        return wrong(f"the two-node job failed. Its last lines:\n{tail}")
    reports = [line for line in lines if line.get("event") == "report"]
    exits = [line for line in lines if line.get("event") == "exit"]
    if len(reports) != 2 or len(exits) != 2:
        return wrong("each of the 2 ranks must reach `ex05.report(model, optimizer)` at the end of training "
                     f"(got {len(reports)} report(s))")
    if any(r["set_device_before_init"] is not True for r in reports):
        return wrong("your program may well run, but pick the device (ex05.set_device) BEFORE init_process_group, "
                     "as the recipe does. With NCCL, anything that touches the GPU before set_device opens a CUDA "
                     "context on GPU 0 in every rank; on torch 2.3+ you can also pass "
                     "device_id=torch.device('cuda', local_rank) to init_process_group")
    if any(e["group_left_initialised"] for e in exits):
        return wrong("the process group is still initialised when the program ends: call "
                     "dist.destroy_process_group() at the end")
    world = reports[0]["world_size"]
    if any(abs(r["lr"] - BASE_LR * world) > 1e-12 for r in reports):
        return wrong(f"the global batch is {world} x {PER_RANK_BATCH} = {world * PER_RANK_BATCH}, {world} times the "
                     f"batch lr={BASE_LR} was tuned for, and the program still uses lr={reports[0]['lr']:g}: scale the "
                     f"learning rate with the world size (notebook 04's linear rule: {BASE_LR * world:g})")
    three = _run_three_ranks(path)                # on 2 ranks, a hard-coded lr=0.02 would pass
    if three is not None and abs(three - BASE_LR * 3) > 1e-12:
        return wrong(f"on 2 ranks the learning rate was right, but on 3 ranks (one node) it is {three:g}, not "
                     f"{BASE_LR * 3:g}: compute it from the world size, BASE_LR * dist.get_world_size(), instead of "
                     "writing the number")
    if path.resolve() == REFERENCE.resolve():
        _reference_weights["reference"] = reports[0]["weights"]
    if "reference" not in _reference_weights:
        ref, ref_output = _run_two_nodes(REFERENCE)
        if ref is None:
            raise RuntimeError(f"the reference solution failed:\n{ref_output[-2000:]}")
        _reference_weights["reference"] = next(r["weights"] for r in ref if r.get("event") == "report")
    if any(r["weights"] != _reference_weights["reference"] for r in reports):
        return wrong("the job ran, but its final weights differ from the fixed web script's: did something else "
                     "change (the model, the data, the sampler, the number of epochs)?")
    return passed("two nodes of one GPU each: local-rank devices chosen before init, the learning rate scaled for the "
                  "global batch (on 2 and 3 ranks), the process group destroyed, and the same weights as the reference")


if __name__ == "__main__":
    _run_file(sys.argv[1])
