"""course_lib/recipes/slurm_ddp.sbatch under a real SLURM: the two nodes n1, n2 of tests/slurm/local-cluster.sh.

The cluster binds tasks to cores and lets two jobs share a node, as real clusters do. These tests run where that
cluster is up (`sudo bash tests/slurm/local-cluster.sh start`), and are skipped, saying so, where it is not;
with COURSE_SLURM=1 (set by .ci/run) a missing cluster is a failure, not a skip.
"""
import os
import re
import sys
import time
from datetime import datetime

import pytest
from conftest import RECIPE_ARGS as ARGS
from conftest import ROOT

from course_lib.hardware import cpu_count
from course_lib.launch import slurm
from course_lib.launch.commands import CommandError, json_lines

SCRIPT = os.path.join(ROOT, "course_lib", "recipes", "slurm_ddp.sbatch")
CPUS = min(2, cpu_count())                                  # per node: the local cluster's nodes have this host's
CRASH_JOBS = int(os.environ.get("COURSE_CRASH_JOBS", "10"))  # two-node crash-and-restart jobs (10 in CI)


@pytest.fixture(scope="module")
def cluster():
    found = slurm.probe()
    if found is None:
        why = "no SLURM on this machine (no sbatch)"
    elif found.name is None:
        why = f"SLURM is installed but no controller answers ({found.error})"
    elif found.name != "course":
        why = f"the SLURM here is cluster {found.name!r}, and these tests submit only to the course's local one"
    elif sorted(found.nodes) != ["n1", "n2"] or not all(s in ("idle", "mixed") for s in found.nodes.values()):
        why = f"the course's local cluster should have nodes n1, n2 idle, not {found.nodes}"
    else:
        return found
    message = f"{why}: start it with `{slurm.LOCAL_CLUSTER}` (tests/slurm/README.md)"
    if os.environ.get("COURSE_SLURM") == "1":
        pytest.fail(f"COURSE_SLURM=1 asks for the SLURM tests, but {message}")
    pytest.skip(message)


def sbatch_args(tmp_path, nodes: int, *extra: str) -> tuple:
    """A CPU-node job in its own folder (output, checkpoints/), cancelled by SLURM if it runs past 3 minutes."""
    return (f"--chdir={tmp_path}", "--output=%x-%j.out", "--time=3", f"--nodes={nodes}", "--gres=none",
            f"--cpus-per-task={CPUS}", *extra)


def job_env(ranks_per_node: int | None) -> dict:
    """The environment a user submits from: the course's Python first on PATH, the project importable."""
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
           "OMP_NUM_THREADS": "1"}          # the two "nodes" share this host's cores
    if ranks_per_node is not None:
        env["NPROC_PER_NODE"] = str(ranks_per_node)
    return env


def finished(jobs: list[int], timeout: float = 600) -> dict[int, tuple[dict, str]]:
    """Wait for the jobs; each one's scontrol fields and output (raises for a job that did not complete)."""
    infos = slurm.wait(jobs, timeout=timeout)
    return {job: (info, slurm.check(job, info)) for job, info in infos.items()}


def summary(output: str) -> dict:
    return json_lines(output)[-1]


def test_one_node_two_ranks_on_cores_given_to_srun(cluster, tmp_path, uninterrupted):
    job = slurm.submit(SCRIPT, *ARGS, sbatch_args=sbatch_args(tmp_path, 1), env=job_env(2))
    info, out = finished([job])[job]
    s = summary(out)
    assert s["world_size"] == 2 and s["weights"] == uninterrupted["weights"] and "resumed" not in out
    # the cluster binds tasks to cores: torchrun's workers get the job's --cpus-per-task only if srun asks for them
    assert s["cpus"] == CPUS, f"the workers could use {s['cpus']} core(s), the job has {CPUS}"
    assert os.path.exists(tmp_path / "checkpoints" / f"ddp-course-{job}.pt")


def test_two_jobs_at_once_on_two_nodes_then_a_resumed_one(cluster, tmp_path, uninterrupted):
    """Two 2-node jobs whose first node is the same machine, at once; then a third resumes the second's snapshot."""
    full = slurm.submit(SCRIPT, *ARGS, sbatch_args=sbatch_args(tmp_path, 2), env=job_env(1))
    short = slurm.submit(SCRIPT, "--epochs", "1", *ARGS[2:], sbatch_args=sbatch_args(tmp_path, 2), env=job_env(1))
    done = finished([full, short])
    (a, out_a), (b, out_b) = done[full], done[short]
    assert a["NodeList"] == b["NodeList"] == "n[1-2]"
    start = {j: datetime.fromisoformat(done[j][0]["StartTime"]) for j in done}
    end = {j: datetime.fromisoformat(done[j][0]["EndTime"]) for j in done}
    assert start[full] < end[short] and start[short] < end[full], "the two jobs did not run at the same time"
    ports = {re.search(r"rendezvous n1:(\d+)", out).group(1) for out in (out_a, out_b)}
    assert len(ports) == 2, "two jobs on one head node need two rendezvous ports"
    assert summary(out_a)["weights"] == uninterrupted["weights"] and summary(out_a)["world_size"] == 2
    # a new submission from the same folder starts afresh: each job has a checkpoint of its own
    assert "resumed" not in out_a + out_b and summary(out_b)["epochs"] == 1
    snapshot = f"checkpoints/ddp-course-{short}.pt"
    resumed = slurm.submit(SCRIPT, *ARGS, "--checkpoint", snapshot, sbatch_args=sbatch_args(tmp_path, 2),
                           env=job_env(1))
    out = finished([resumed])[resumed][1]
    assert f"resumed from {snapshot} after 1 epoch(s)" in out
    assert summary(out)["weights"] == uninterrupted["weights"]


def test_a_killed_rank_on_two_nodes_is_recovered_every_time(cluster, tmp_path, uninterrupted):
    """Rank 1 (on n2) SIGKILLs itself half-way through epoch 2 of each job; torchrun restarts the job on both nodes.
    All jobs are submitted at once: SLURM runs two at a time (the nodes' cores may be shared by two jobs)."""
    jobs = [slurm.submit(SCRIPT, *ARGS, "--crash-at-epoch", "2", sbatch_args=sbatch_args(tmp_path, 2),
                         env=job_env(1)) for i in range(CRASH_JOBS)]
    infos = slurm.wait(jobs, timeout=480)
    results = {}
    for job, info in infos.items():
        out = slurm.output(info)
        weights = json_lines(out)[-1]["weights"] if info.get("JobState") == "COMPLETED" and json_lines(out) else None
        results[job] = (info.get("JobState"), "killing myself" in out, "resumed from" in out, weights)
    good = [j for j, r in results.items() if r == ("COMPLETED", True, True, uninterrupted["weights"])]
    assert len(good) == CRASH_JOBS, f"{len(good)} of {CRASH_JOBS} recovered; the others: " + \
        str({j: r for j, r in results.items() if j not in good})


def test_a_cpu_node_without_a_rank_count_stops_with_the_command_to_use(cluster, tmp_path):
    with pytest.raises(CommandError) as info:
        slurm.run_job(SCRIPT, *ARGS, sbatch_args=sbatch_args(tmp_path, 1), env=job_env(None), echo=False, timeout=120)
    assert "ended FAILED (exit code 2:0)" in str(info.value)
    assert "NPROC_PER_NODE=2 sbatch --gres=none --cpus-per-task=2" in info.value.output


def test_a_job_past_its_wait_is_cancelled_not_left_running(cluster, tmp_path):
    script = tmp_path / "sleeper.sbatch"
    script.write_text("#!/bin/bash\necho started\nsleep 120\n")
    job = slurm.submit(str(script), sbatch_args=(f"--chdir={tmp_path}", "--output=%j.out", "--time=3", "--gres=none"))
    start = time.monotonic()
    with pytest.raises(CommandError, match=f"job\\(s\\) {job} did not end within 3 s and were cancelled"):
        slurm.wait([job], timeout=3)
    assert slurm.job_info(job)["JobState"] == "CANCELLED" and time.monotonic() - start < 40
