"""The hub's SLURM variant (``make hub HUB_SPAWNER=slurm``): a learner's JupyterLab as a batch job of theirs,
submitted through batchspawner's SlurmSpawner to the local two-node SLURM that tests/slurm/local-cluster.sh starts.

Needs what tests/test_hub.py needs (root, the hub's environment) and a SLURM controller that answers; skipped
without them unless ``COURSE_HUB=required`` and ``COURSE_SLURM=1`` (``.ci/run`` sets both). The local cluster has
no GPUs, so no ``--gres`` is asked for; what is checked is the job: the learner's, running the learner's server,
with the ``MASTER_PORT`` its job id gives, and cancelled when the hub stops.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import time

import pytest
from test_hub import REQUIRED, Hub, cli, environ, missing, uid_of

from course_lib.hub import system
from course_lib.launch import free_port
from course_lib.launch.slurm import probe

LEARNER, ADMIN, BASE, SPAN = "hubslurm1", "hubslurmadmin", 21000, 10000   # ports 21000-30999: below 32768


@pytest.fixture(scope="module")
def slurm_hub():
    gaps = missing()
    found = probe()
    if found is None or found.name is None:
        gaps.append("a SLURM controller that answers (sudo bash tests/slurm/local-cluster.sh start)")
    if gaps:
        must = REQUIRED and os.environ.get("COURSE_SLURM") == "1"
        (pytest.fail if must else pytest.skip)(f"the hub's SLURM test needs {'; '.join(gaps)}")
    for name in (LEARNER, ADMIN):
        if system.user_exists(name):
            pytest.fail(f"user {name} exists: remove it (python -m course_lib.hub remove-users) first")
    token = os.urandom(24).hex()
    env = {**os.environ, "COURSE_HUB_PASSWORD": "learners-" + os.urandom(6).hex(),
           "COURSE_HUB_ADMIN_PASSWORD": "instructor-" + os.urandom(16).hex(), "COURSE_HUB_API_TOKEN": token}
    port = free_port()
    up = cli("up", "--names", LEARNER, "--admin", ADMIN, "--spawner", "slurm", "--partition", "debug",
             "--port", str(port), "--hub-api-port", str(free_port()), "--proxy-api-port", str(free_port()),
             "--port-base", str(BASE), env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield Hub(port, token, ("", ""))
    finally:
        cli("stop", timeout=180)
        cli("remove-users", timeout=120)


def squeue(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%u %T"], capture_output=True, text=True).stdout.strip()


def test_a_learners_server_is_their_own_slurm_job_and_ends_with_the_hub(slurm_hub):
    status, body = slurm_hub.api(f"users/{LEARNER}/server", "POST")
    assert status in (201, 202), (status, body, slurm_hub.log())
    deadline = time.monotonic() + 240
    while True:
        _, user = slurm_hub.api(f"users/{LEARNER}")
        server = user["servers"].get("")
        if server and server["ready"]:
            break
        assert time.monotonic() < deadline, f"the job's server never became ready:\n{slurm_hub.log()}"
        time.sleep(1)
    job = server["state"]["job_id"]
    assert squeue(job) == f"{LEARNER} RUNNING"
    uid = pwd.getpwnam(LEARNER).pw_uid
    servers = [p for p, u, cmd in system.processes({uid}) if "jupyterhub-singleuser" in cmd and u == uid]
    assert servers, "no jupyterhub-singleuser process of the learner's"
    env = environ(servers[0])
    assert uid_of(servers[0]) == uid and env["SLURM_JOB_ID"] == job
    assert env["MASTER_PORT"] == str(BASE + int(job) % SPAN) and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    out = cli("stop", timeout=180)
    assert out.returncode == 0 and "hub: stopped" in out.stdout, out.stdout + out.stderr
    deadline = time.monotonic() + 60      # scancel'ed: the job is gone, or known as ended (MinJobAge)
    while squeue(job).split()[1:] in (["RUNNING"], ["PENDING"], ["COMPLETING"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert squeue(job).split()[1:] in ([], ["CANCELLED"], ["COMPLETED"]), f"job {job} after the hub stopped: " \
        f"{squeue(job)}"
    assert system.processes({uid}) == []
