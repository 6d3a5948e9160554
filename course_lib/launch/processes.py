"""The rank processes themselves: how :func:`.runner.run` starts them fast and stops them for sure.

* :func:`context`: a forkserver that imported torch once (a rank then starts in a fraction of a second
  instead of a fresh ``import torch``), or ``spawn`` where the platform has no forkserver.
* :func:`start_rank`: a rank process that runs :func:`.worker.main`, started without re-running the
  caller's script (:func:`without_main_module`).
* :func:`dump_stacks` and :func:`kill`: ask ranks for their Python stacks; kill a rank with its process group.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing import spawn as mp_spawn

import cloudpickle

from . import worker

RANK_PROCESS_PREFIX = "course_lib-rank"
# What a fresh rank process executes: the caller's sys.path first (so it finds what the notebook finds),
# then the worker module's entry point (course_lib/launch/worker.py).
_BOOT = ("import sys\nsys.path[:0] = [p for p in SYS_PATH if p not in sys.path]\n"
         f"from {worker.__name__} import main\nmain(SPEC, CONN, LIFELINE)\n")
_fast_context = None
_start_lock = threading.Lock()


def context():
    """The multiprocessing context: a forkserver with torch preloaded where available, else spawn.

    Process-wide, and why that is safe: Python keeps one forkserver per process, shared by every user of
    the ``forkserver`` start method in this kernel. Asking it to preload torch only makes their processes
    start faster too; if someone else started the server first, it runs as they started it and our runs
    merely start more slowly. The server never touches CUDA, so the ranks can use GPUs (a plain ``fork``
    of a kernel that used CUDA cannot).
    """
    global _fast_context
    if _fast_context is None:
        if "forkserver" in mp.get_all_start_methods():
            _fast_context = mp.get_context("forkserver")
            # torch._dynamo too: DDP, FSDP and DTensor import it on first use, which costs seconds per rank
            _fast_context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "cloudpickle"])
        else:
            _fast_context = mp.get_context("spawn")
    return _fast_context


@contextmanager
def without_main_module():
    """Start our rank processes without re-running the caller's script in them.

    multiprocessing normally re-imports ``__main__`` in every child (hence the ``if __name__ ==
    "__main__"`` rule); ``fn`` travels by value here, so the ranks need nothing from the script.
    multiprocessing has no option for this, so its ``get_preparation_data`` is replaced while our
    processes start. Narrowed to be safe: the replacement is installed under a lock, only for the
    duration of ``start()``, and it changes only processes named ``course_lib-rank*``; any process
    another thread starts meanwhile gets multiprocessing's own preparation data.
    """
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        if name.startswith(RANK_PROCESS_PREFIX):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    with _start_lock:
        mp_spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


def start_rank(rank: int, spec: dict, conn, lifeline):
    """Start rank ``rank``'s process: it runs ``worker.main(spec, conn, lifeline)`` and sends its result on
    ``conn``; it dies when ``lifeline`` closes (the parent's end of that pipe)."""
    child_globals = {"SYS_PATH": list(sys.path), "SPEC": cloudpickle.dumps(spec), "CONN": conn, "LIFELINE": lifeline}
    proc = context().Process(target=exec, args=(_BOOT, child_globals), name=f"{RANK_PROCESS_PREFIX}{rank}",
                             daemon=True)
    with without_main_module():
        proc.start()
    return proc


def kill(proc) -> None:
    """Kill a rank process and its process group (what it started, unless in a session of its own): the rank
    makes itself a group leader first thing (:func:`.worker.main`); before that, the rank alone is killed."""
    if proc.pid is None:
        return
    for kill_it in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill_it()
            return
        except (ProcessLookupError, PermissionError, AttributeError, OSError):
            continue


def dump_stacks(procs, settle: float = 0.5) -> None:
    """Ask each rank for its Python stack (faulthandler, on SIGUSR1) before it is killed."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
    time.sleep(settle)
