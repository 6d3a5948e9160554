"""Run a SLURM batch script from a notebook cell or a test, and fail when the job fails.

``sbatch`` returns at once with a job id; the job runs later, on the cluster's nodes, and writes its output
to a file. :func:`run_job` submits, waits, prints the job's output and raises
:class:`~course_lib.launch.commands.CommandError` unless the job ``COMPLETED`` — so a crashed job fails the cell, as
``course_lib.launch.commands.torchrun`` does. :func:`submit` and :func:`wait` run several jobs at once.
Jobs are followed with ``scontrol show job``, which needs no accounting database (``sacct`` does).

No SLURM at hand? ``tests/slurm/local-cluster.sh`` starts a real one on this machine (Debian/Ubuntu, root):
two nodes, ``n1`` and ``n2``, served by two ``slurmd`` on this host.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from .commands import CommandError, Completed

LOCAL_CLUSTER = "sudo bash tests/slurm/local-cluster.sh start"
END_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
              "BOOT_FAIL", "DEADLINE"}


@dataclass
class Cluster:
    """What this machine's SLURM client sees: its version, and the controller's cluster and nodes."""

    version: str
    name: str | None = None                              # None: no controller answered
    nodes: dict[str, str] = field(default_factory=dict)  # node name -> state (idle, mixed, down...)
    error: str = ""


def _scontrol(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout)


def probe() -> Cluster | None:
    """The SLURM this machine submits to; ``None`` where there is no ``sbatch``."""
    if not (shutil.which("sbatch") and shutil.which("scontrol") and shutil.which("sinfo")):
        return None
    try:
        version = subprocess.run(["sbatch", "--version"], capture_output=True, text=True, timeout=20).stdout.strip() \
            or "sbatch (version unknown)"
        config = _scontrol("show", "config")
        if config.returncode != 0:
            return Cluster(version, error=(config.stderr or config.stdout).strip().splitlines()[-1])
        name = next((line.split("=", 1)[1].strip() for line in config.stdout.splitlines()
                     if line.startswith("ClusterName")), "?")
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Cluster("sbatch", error=f"{type(e).__name__}: {e}")
    nodes = dict(line.split() for line in sinfo.stdout.splitlines() if len(line.split()) == 2)
    return Cluster(version, name, nodes)


def job_info(job_id: int) -> dict[str, str]:
    """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``NodeList``, ``StdOut``...); ``{}`` if unknown."""
    out = _scontrol("show", "job", "-o", str(job_id))
    if out.returncode != 0:
        return {}
    return dict(token.split("=", 1) for token in out.stdout.split() if "=" in token)


def submit(script: str, *script_args, sbatch_args: tuple[str, ...] = (), env: dict | None = None,
           cwd: str | None = None) -> int:
    """``sbatch [sbatch_args] script [script_args]``: the job id, or :class:`CommandError` with sbatch's reason.

    The job gets this process's environment plus ``env`` (sbatch's default ``--export=ALL``), so activate
    the course's environment first: the job runs the ``python`` it finds on ``PATH``.
    """
    args = ["sbatch", "--parsable", *map(str, sbatch_args), str(script), *map(str, script_args)]
    full_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    out = subprocess.run(args, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=60)
    if out.returncode != 0:
        raise CommandError(f"sbatch refused the job: {out.stderr.strip()}", out.returncode, out.stdout + out.stderr)
    return int(out.stdout.strip().split(";")[0])


def wait(job_ids: list[int], timeout: float = 300, poll: float = 0.5) -> dict[int, dict[str, str]]:
    """Wait until every job has ended; their ``scontrol`` fields. Past ``timeout`` they are cancelled."""
    pending, ended = list(job_ids), {}
    deadline = time.monotonic() + timeout
    while pending:
        for job in list(pending):
            info = job_info(job)
            if info.get("JobState") in END_STATES or not info:
                ended[job] = info
                pending.remove(job)
        if pending and time.monotonic() > deadline:
            subprocess.run(["scancel", *map(str, pending)], capture_output=True, timeout=60)
            stop = time.monotonic() + 30
            while time.monotonic() < stop and any(job_info(j).get("JobState") not in END_STATES for j in pending):
                time.sleep(poll)
            raise CommandError(f"job(s) {', '.join(map(str, pending))} did not end within {timeout:g} s and were "
                               f"cancelled", None, "".join(output(job_info(j)) for j in pending))
        if pending:
            time.sleep(poll)
    return ended


def output(info: dict[str, str]) -> str:
    """What the job wrote to its output file (``--output``), ``""`` when there is none (yet)."""
    try:
        with open(info.get("StdOut", ""), errors="backslashreplace") as f:
            return f.read()
    except OSError:
        return ""


def check(job: int, info: dict[str, str], tail: int = 40) -> str:
    """The job's output; :class:`CommandError` with its last lines unless it ``COMPLETED``."""
    text = output(info)
    state = info.get("JobState", "unknown (scontrol no longer knows it)")
    if state != "COMPLETED":
        last = "\n".join(text.splitlines()[-tail:])
        raise CommandError(f"SLURM job {job} ended {state} (exit code {info.get('ExitCode', '?')}). "
                           f"Last output:\n{last}", None, text)
    return text


def run_job(script: str, *script_args, sbatch_args: tuple[str, ...] = (), env: dict | None = None,
            cwd: str | None = None, timeout: float = 300, echo: bool = True) -> Completed:
    """Submit one job, wait for it, print its output; raise unless it completed."""
    job = submit(script, *script_args, sbatch_args=sbatch_args, env=env, cwd=cwd)
    info = wait([job], timeout)[job]
    text = output(info)
    if echo:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
    check(job, info)
    return Completed(["sbatch", *map(str, sbatch_args), str(script), *map(str, script_args)], 0, text)
