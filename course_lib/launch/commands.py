"""Run a command, or a script under ``torchrun``, from a notebook cell — and fail the cell when it fails.

``!torchrun train.py`` in a notebook never fails the cell: a crashed job, or a missing ``torchrun``,
passes silently (and under nbval, a test passes).  These helpers stream the command's output into the
cell as it comes, stop it (and everything it started) at ``timeout``, and raise
:class:`CommandError`, with the last lines of output, when it exits non-zero.

``torchrun`` is called as ``python -m torch.distributed.run`` with this kernel's Python, so it is the
torchrun of the torch the notebook uses, whatever ``PATH`` says.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from .runner import free_port


class CommandError(RuntimeError):
    """A command failed or timed out: ``returncode`` (``None`` on timeout) and ``output``."""

    def __init__(self, message: str, returncode: int | None, output: str):
        super().__init__(message)
        self.returncode, self.output = returncode, output


@dataclass
class Completed:
    """A command that succeeded: its argument list, exit code (0) and whole output."""

    args: list[str]
    returncode: int
    output: str


def run_command(args: list[str], timeout: float = 300, env: dict | None = None, cwd: str | None = None,
                echo: bool = True, tail: int = 40) -> Completed:
    """Run ``args``, print its output (stdout and stderr merged) as it arrives, raise if it fails.

    ``env`` adds variables to this process's environment for the command; a value of ``None`` removes one.

    The command runs in a session of its own, so on timeout (or Ctrl-C / the notebook's stop button)
    it is stopped together with every process it started.
    """
    return run_commands([args], timeout=timeout, env=env, cwd=cwd, echo=echo, tail=tail)[0]


def run_commands(commands: list[list[str]], labels: list[str] | None = None, timeout: float = 300,
                 env: dict | None = None, cwd: str | None = None, echo: bool = True, tail: int = 40) -> list[Completed]:
    """Run several commands at once (e.g. one torchrun per "node"), each line prefixed with its label.

    All must succeed: when one fails or the time runs out, the others are stopped too, and
    :class:`CommandError` shows the last lines of the one that failed.
    """
    commands = [[str(a) for a in args] for args in commands]
    labels = labels or [""] * len(commands)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in (env or {}).items()}}
    for name in [k for k, v in (env or {}).items() if v is None]:     # None: unset it for the command
        del full_env[name]
    lines: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    try:
        for i, args in enumerate(commands):
            try:
                proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="backslashreplace", env=full_env, cwd=cwd, start_new_session=True)
            except FileNotFoundError as e:
                raise CommandError(f"{args[0]!r} was not found: is it installed in this environment?", None, "") from e
            procs.append(proc)
            threading.Thread(target=_pump, args=(proc, i, lines), daemon=True).start()
        outputs: list[list[str]] = [[] for _ in commands]
        last: list[deque] = [deque(maxlen=tail) for _ in commands]
        open_streams, deadline = len(commands), time.monotonic() + timeout
        while open_streams:
            try:
                i, line = lines.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    busy = [" ".join(commands[k]) for k, p in enumerate(procs) if p.poll() is None]
                    raise CommandError(f"{'; '.join(busy)} did not finish within {timeout:g} s and was stopped. "
                                       f"Last output:\n{''.join(line for d in last for line in d)}", None,
                                       "".join(line for o in outputs for line in o)) from None
                continue
            if line is None:
                open_streams -= 1
                procs[i].wait()
                if procs[i].returncode != 0:
                    raise CommandError(f"{' '.join(commands[i])} failed with exit code {procs[i].returncode}. "
                                       f"Last output:\n{''.join(last[i])}", procs[i].returncode, "".join(outputs[i]))
                continue
            line = f"{labels[i]}{line}"
            outputs[i].append(line)
            last[i].append(line)
            if echo:
                print(line, end="", flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _stop(proc)
    return [Completed(args, 0, "".join(out)) for args, out in zip(commands, outputs)]


def _pump(proc: subprocess.Popen, index: int, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put((index, line))
    lines.put((index, None))


def _stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the command's whole session, then SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                # torchrun's workers may outlive the agent for a moment: make sure the group is gone
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


# torchrun's agent keeps one rendezvous store for all restart rounds unless told otherwise, and restarted workers
# then read the dead round's keys: every launch here asks for a fresh store per round (train_ddp.check_restarts).
FRESH_STORE_PER_RESTART = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _check_launch(target: str, module: bool, cwd: str | None, **counts) -> None:
    """Refuse at once what torchrun would only refuse after starting its workers."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not module and not os.path.isfile(os.path.join(cwd or os.getcwd(), target)):
        raise FileNotFoundError(f"script {target!r} not found (from {cwd or os.getcwd()}); for a module "
                                f"(python -m NAME) pass module=True")


def torchrun(target: str, *script_args, nproc_per_node: int = 2, module: bool = False,
             torchrun_args: tuple[str, ...] = (), standalone: bool = True, timeout: float = 300,
             env: dict | None = None, cwd: str | None = None, echo: bool = True) -> Completed:
    """Launch ``target`` (a script path, or a module with ``module=True``) under torchrun.

    With ``standalone=True`` torchrun hosts its own rendezvous on a free port of this machine
    (``--standalone``); pass ``standalone=False`` and ``torchrun_args=("--nnodes=2", ...)`` for the
    multi-node form.  Every worker's output is prefixed by torchrun with ``[default<rank>]:``.
    """
    _check_launch(target, module, cwd, nproc_per_node=nproc_per_node)
    args = [sys.executable, "-m", "torch.distributed.run"]
    if standalone:
        args.append("--standalone")
    args += [f"--nproc-per-node={nproc_per_node}", "--tee=3", *torchrun_args]
    args += (["-m", target] if module else [target]) + [str(a) for a in script_args]
    return run_command(args, timeout=timeout, env={**FRESH_STORE_PER_RESTART, **(env or {})}, cwd=cwd, echo=echo)


def torchrun_nodes(target: str, *script_args, nnodes: int = 2, nproc_per_node: int = 1, module: bool = False,
                   rendezvous: str = "c10d", torchrun_args: tuple[str, ...] = (), timeout: float = 300,
                   env: dict | None = None, cwd: str | None = None, echo: bool = True) -> list[Completed]:
    """Simulate a multi-node job on this machine: one torchrun per "node", meeting over loopback.

    ``rendezvous="c10d"``: each gets ``--nnodes``, its own ``--node-rank`` and the same c10d rendezvous
    endpoint (``127.0.0.1:<free port>``), exactly as on ``nnodes`` real machines sharing a head node's
    address.  ``rendezvous="static"``: the older form, ``--master-addr``/``--master-port`` and a
    ``--node-rank`` that must be given, no restarts of single nodes.  ``torchrun_args`` go to every
    torchrun (e.g. ``("--max-restarts=3",)``).  The "nodes" share this machine's cores: each worker gets
    ``OMP_NUM_THREADS`` = cores / workers (unless set), as torchrun does for the workers of one node.
    """
    from ..hardware import cpu_count
    _check_launch(target, module, cwd, nnodes=nnodes, nproc_per_node=nproc_per_node)
    if rendezvous not in ("c10d", "static"):
        raise ValueError(f"rendezvous must be 'c10d' or 'static', got {rendezvous!r}")
    port = free_port()
    meet = (["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=course-job"]
            if rendezvous == "c10d" else ["--master-addr=127.0.0.1", f"--master-port={port}"])
    commands = []
    for node in range(nnodes):
        args = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
                f"--nproc-per-node={nproc_per_node}", *meet, "--tee=3", *torchrun_args]
        commands.append(args + (["-m", target] if module else [target]) + [str(a) for a in script_args])
    threads = os.environ.get("OMP_NUM_THREADS", max(1, cpu_count() // (nnodes * nproc_per_node)))
    return run_commands(commands, labels=[f"[node {n}]" for n in range(nnodes)], timeout=timeout,
                        env={**FRESH_STORE_PER_RESTART, "OMP_NUM_THREADS": threads, **(env or {})}, cwd=cwd, echo=echo)


def json_lines(output: str) -> list[dict]:
    """The JSON objects a job printed (torchrun's ``[default0]:`` prefixes removed).

    Workers that share one stdout can interleave: under ``PYTHONUNBUFFERED`` a ``print`` is two writes (the text,
    then the newline), so two ranks printing at once give ``{...}{...}`` on one line, and torchrun's ``--tee`` copies
    a half-written line as it finds it (``[default0]:{...}[default1]:{...}``). A line made only of objects and such
    prefixes is read whole; any other line (a log, a warning) is skipped. Print with :func:`print_json` to avoid
    the split in the first place."""
    import json
    import re
    decoder = json.JSONDecoder()
    first = re.compile(r"\s*(\[[^\]]*\]:?\s*)*")            # [default0]: or [node0][default0]: before a line
    between = re.compile(r"\s*((\[[^\]]*\])+:\s*)*")         # and before a line torchrun's copy ran into
    found = []
    for line in output.splitlines():
        objects, at = [], first.match(line).end()
        while line.startswith("{", at):
            try:
                obj, at = decoder.raw_decode(line, at)
            except ValueError:
                break
            objects.append(obj)
            at = between.match(line, at).end()
        if objects and at == len(line):
            found += objects
    return found


def print_json(obj) -> None:
    """Print ``obj`` as one line of JSON in one write: ranks that share a stdout cannot split each other's lines (a
    ``print`` is two writes when Python runs unbuffered, as under the course's launchers). A pipe keeps a write whole
    up to 4096 bytes (PIPE_BUF): keep reports shorter."""
    import json
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
