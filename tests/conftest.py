import os
import time

import psutil
import pytest
import torch

from course_lib import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_with_path(*first: str) -> dict:
    """``os.environ`` for a child Python that imports ``first``, then this project, then what PYTHONPATH
    already had (on the offline GPU machine the course's packages are only reachable through it)."""
    parts = [*first, ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


RECIPE = "course_lib.recipes.train_ddp"
RECIPE_ARGS = ("--epochs", "3", "--samples", "600", "--hidden", "32")


@pytest.fixture(scope="session")
def uninterrupted():
    """The recipe's summary for ``RECIPE_ARGS`` on 2 ranks of one torchrun: the weights that a resumed, restarted,
    two-node or SLURM run of the same job must end with."""
    from course_lib.launch.commands import json_lines, torchrun
    out = torchrun(RECIPE, *RECIPE_ARGS, nproc_per_node=2, module=True, echo=False, timeout=300)
    return json_lines(out.output)[-1]


@pytest.fixture(scope="session")
def warm():
    """Start the launcher's forkserver once, so process counts below are not disturbed by it."""
    launch.run(lambda r, w: None, 1, show_output=False)


def descendants() -> set[int]:
    """Live processes below this one, the launcher's long-lived forkserver excepted."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "forkserver" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, within: float = 10.0) -> set[int]:
    """The pids still alive after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _alive(p)}
        time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def no_leftovers(warm):
    """Assert that a test leaves no process behind: the process count returns to where it was."""
    before = descendants()
    yield
    assert wait_gone(descendants() - before) == set(), "processes were left behind"


@pytest.fixture
def pid_file(tmp_path):
    return os.fspath(tmp_path / "pids")
