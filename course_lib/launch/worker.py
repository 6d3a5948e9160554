"""The rank's side of :func:`course_lib.launch.run`: what each of the N processes does.

Read this to see what a launcher such as ``torchrun`` does for every worker process:

1. it joins the *rendezvous*: every rank connects to one key-value store (a ``TCPStore`` at
   ``MASTER_ADDR:MASTER_PORT``) to learn who the others are;
2. it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``... in the environment, picks the device by
   ``LOCAL_RANK`` and calls ``init_process_group``;
3. it runs the user's function, and tears the process group down at the end.

One step is ``run``'s own: no rank starts the function before every rank is initialised
(:func:`_wait_for_every_rank`).

What is specific to running from a notebook: the output of the whole process (file descriptors 1 and 2,
so C++ and library messages too) goes to a file the parent prints in rank order; a watchdog thread
kills the rank when the parent (the Jupyter kernel) dies; ``SIGUSR1`` dumps every thread's stack, which
the parent asks for before it kills a rank that ran out of time.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta

import cloudpickle


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def _die_with_parent(lifeline) -> None:
    """Block on a pipe only the parent writes to: end of file means the parent is gone."""
    def watch():
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(70)  # the parent closed the pipe or died: no rank outlives its notebook
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def init_process_group(spec: dict):
    """Join the rendezvous (a client of the store the parent hosts) and initialise the default group; returns the
    store."""
    import torch
    import torch.distributed as dist

    rank, world_size, backend = spec["rank"], spec["world_size"], spec["backend"]
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before init, by LOCAL rank
    # A client of the store the launcher hosts (torchrun does the same); with init_method="env://",
    # rank 0 would host it at MASTER_ADDR:MASTER_PORT instead.
    store = dist.TCPStore(spec["host"], spec["port"], world_size, is_master=False,
                          timeout=timedelta(seconds=spec["timeout"]))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec["pg_timeout"]))
    return store


def _wait_for_every_rank(store, world_size: int) -> None:
    """``run``'s own step, not torchrun's: no rank goes on to ``fn`` before every rank is initialised.

    Gloo's connection handshake can finish on one rank before the other, and a rank whose ``fn`` returns at once
    could then exit while its peer still reads the handshake ("connectFullMesh failed ... Connection closed by
    peer": 6 in 1108 two-rank runs on a loaded 2-core machine, none in 812 with this step). Counted through the
    store (each run has a fresh one), so that no collective is added to what ``fn`` does; torch's own
    ``TORCH_DIST_INIT_BARRIER=1`` is a barrier of the same kind, off by default."""
    if store.add("course_lib/initialised", 1) == world_size:
        store.set("course_lib/all_initialised", "1")
    store.wait(["course_lib/all_initialised"])        # within the store's timeout: the run's


def _frames(exc: BaseException) -> list[tuple[str, int, str, str]]:
    te = traceback.TracebackException.from_exception(exc)
    return [(f.filename, f.lineno or 0, f.name, f.line or "") for f in te.stack]


def main(spec_bytes: bytes, conn, lifeline) -> None:
    """Entry point of one rank (called in a fresh process)."""
    spec = cloudpickle.loads(spec_bytes)
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # its own process group: the parent can kill the rank with everything it started
    _die_with_parent(lifeline)
    _redirect_output(spec["out_path"])
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["threads"])
        # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read it again
        dist.set_debug_level_from_env()
        if spec["init"]:
            _wait_for_every_rank(init_process_group(spec), spec["world_size"])
        fn, args = cloudpickle.loads(spec["payload"])
        result = fn(spec["rank"], spec["world_size"], *args)
        try:
            message = cloudpickle.dumps(("ok", result))
        except Exception as e:
            raise TypeError(f"the return value of rank {spec['rank']} cannot be sent back to the notebook "
                            f"({type(e).__name__}: {e}); return tensors, numbers, lists or dicts") from e
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(message)
        if spec["init"] and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # report everything, KeyboardInterrupt and SystemExit included
        code = 1
        sys.stdout.flush()
        detail = ("error", type(e).__name__, str(e), _frames(e), traceback.format_exc())
        try:
            conn.send_bytes(cloudpickle.dumps(detail))
        except Exception:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: leftover threads must not keep the rank alive
