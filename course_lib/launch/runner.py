"""The notebook's side of the launcher: ``run(fn, world_size, *args)`` runs a function on N ranks.

``run`` starts ``world_size`` fresh processes; in each one the default process group is initialised
(Gloo on CPU, NCCL when every rank has a GPU of its own), ``fn(rank, world_size, *args)`` is called,
and its return value comes back to the notebook.  The list of return values is in rank order::

    def hello(rank, world_size):
        print("hello from", rank)
        return rank * 10

    run(hello, 4)          # prints "[rank 0] hello from 0" ... "[rank 3] hello from 3"
    # -> [0, 10, 20, 30]

How it works, and why:

* ``fn`` is serialised **by value** with cloudpickle, so functions, lambdas and closures defined in a
  notebook reach the ranks (``torch.multiprocessing.spawn`` pickles them by name and fails on
  ``__main__``).
* The processes come from a **forkserver** that imported torch once: a run after the first costs a
  fraction of a second instead of a fresh ``import torch`` per rank (:mod:`.processes`, which also starts
  and kills them).
* Every rank's output (Python's and C++'s) is captured and printed here, prefixed and **in rank
  order**, once the run ends: the same in JupyterLab and under nbval.
* Failures are errors, never hangs: a rank that raises, dies or runs past ``timeout`` stops the run,
  the other ranks are killed, and no process is left behind.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait

import cloudpickle

from .. import hardware
from . import processes
from .errors import PEER_GONE, RankDiedError, RankError, RunTimeoutError, remote_traceback

DEFAULT_TIMEOUT = 120.0
HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it: no hard-coded MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _validate(fn, world_size, timeout) -> None:
    if not callable(fn):
        raise TypeError(f"run() needs a function fn(rank, world_size, *args) to call on each rank, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int (the number of ranks), got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (the number of ranks to start), got {world_size}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def run(fn, world_size: int, *args, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
        threads: int | None = None, env: dict | None = None, init: bool = True,
        show_output: bool = True, pg_timeout: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return their results in rank order.

    backend: ``'gloo'``, ``'nccl'`` or ``None`` (NCCL when every rank has its own GPU, else Gloo).
    timeout: seconds for the whole run; past it every rank is stopped and :class:`RunTimeoutError`
        says which ranks were still busy, with each one's stack.
    pg_timeout: the process group's own timeout for a collective (default: ``timeout`` + 60 s, so that the
        run's deadline, which shows where every rank was, comes first; pass less to see the backend's own error).
    threads: torch threads per rank; by default the CPU cores are shared evenly between the ranks.
    env: extra environment variables for the ranks (e.g. ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``).
    init: ``False`` skips ``init_process_group`` (the ranks get ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
        ``WORLD_SIZE`` and may call ``dist.init_process_group(init_method="env://")`` themselves).
    show_output: print each rank's output here, prefixed ``[rank r]``, in rank order.
    """
    _validate(fn, world_size, timeout)
    if pg_timeout is not None and pg_timeout <= 0:
        raise ValueError(f"pg_timeout must be a positive number of seconds, got {pg_timeout!r}")
    pg_timeout = timeout + 60 if pg_timeout is None else pg_timeout
    backend = hardware.check_backend(backend, world_size)
    try:
        payload = cloudpickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"fn or its arguments cannot be sent to the ranks ({type(e).__name__}: {e}). "
                        "Pass plain data (tensors, numbers, lists); open files, locks and sockets inside fn.") from e
    ctx = processes.context()
    store = None
    if init:  # the rendezvous store lives here; the OS picks its port, so parallel runs never collide
        import torch.distributed as dist
        store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        port = store.port
    else:
        port = free_port()
    threads = threads or max(1, hardware.cpu_count() // world_size)
    base_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()},
                "MASTER_ADDR": HOST, "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads)}
    tmpdir = tempfile.mkdtemp(prefix="course_run_")
    procs, conns, lifelines = [], [], []
    outputs: list[str] = []
    failure, finished = None, False
    try:
        for rank in range(world_size):
            spec = {"rank": rank, "world_size": world_size, "backend": backend, "host": HOST, "port": port,
                    "timeout": timeout, "pg_timeout": pg_timeout, "threads": threads, "init": init,
                    "payload": payload,
                    "cwd": os.getcwd(), "out_path": os.path.join(tmpdir, f"rank{rank}.out"),
                    "env": {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}}
            result_r, result_w = ctx.Pipe(duplex=False)
            life_r, life_w = ctx.Pipe(duplex=False)
            proc = processes.start_rank(rank, spec, result_w, life_r)
            result_w.close()
            life_r.close()
            procs.append(proc)
            conns.append(result_r)
            lifelines.append(life_w)
        results, failure = _collect(procs, conns, world_size, timeout, fn)
        finished = failure is None
    finally:
        for proc in procs:
            if finished and proc.is_alive():
                proc.join(timeout=5)  # the rank returned and is tearing down its process group
            if proc.is_alive():
                processes.kill(proc)
        for proc in procs:
            proc.join(timeout=5)
        for c in conns + lifelines:
            c.close()
        outputs = [_read(os.path.join(tmpdir, f"rank{r}.out")) for r in range(world_size)]
        shutil.rmtree(tmpdir, ignore_errors=True)
        del store
        if show_output:
            print_outputs(outputs)
    if failure is not None:
        failure.outputs = outputs
        raise failure
    return [results[r] for r in range(world_size)]


def _collect(procs, conns, world_size, timeout, fn, grace: float = 1.0):
    """Wait for every rank's message; stop at the deadline, or shortly after the first failure.

    One failure usually causes others: a rank that raises exits, and its peers then fail with
    "Connection closed by peer". So after the first failure the other ranks get ``grace`` seconds to
    report, and the error raised is the root cause: the first failure that is not a lost peer.
    """
    deadline = time.monotonic() + timeout
    results, pending, failures = {}, set(range(world_size)), []
    grace_started = False
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if failures:
                break
            processes.dump_stacks([procs[r] for r in sorted(pending)])
            return results, RunTimeoutError(timeout, sorted(pending), world_size)
        waitables = {conns[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        ready = wait(list(waitables), timeout=remaining)
        for rank in sorted({waitables[obj] for obj in ready}):
            message = None
            if conns[rank].poll():
                try:
                    message = cloudpickle.loads(conns[rank].recv_bytes())
                except EOFError:
                    message = None
            pending.discard(rank)
            if message is None:
                if procs[rank].is_alive():
                    procs[rank].join(timeout=1)
                failures.append(RankDiedError(rank, world_size, procs[rank].exitcode))
            elif message[0] == "ok":
                results[rank] = message[1]
            else:
                _, exc_type, exc_message, frames, text = message
                failures.append(RankError(rank, world_size, exc_type, exc_message,
                                          remote_traceback(frames, text, fn)))
        if failures and not grace_started:
            grace_started = True
            deadline = min(deadline, time.monotonic() + grace)  # let the others report, briefly
    if not failures:
        return results, None
    primary = next((f for f in failures if not any(p in str(f) for p in PEER_GONE)), failures[0])
    others = [f for f in failures if f is not primary]
    if others:
        primary.args = (primary.args[0] + "\n\nThen, as a consequence: " +
                        "; ".join(str(f).splitlines()[0] for f in others),)
    return results, primary


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="backslashreplace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def print_outputs(outputs: list[str]) -> None:
    """Print each rank's captured output, every line prefixed with ``[rank r]``, rank 0 first."""
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()
