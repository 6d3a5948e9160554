"""The SLURM variant of the hub: each learner's JupyterLab is a batch job (batchspawner's ``SlurmSpawner``).

SLURM, not the roster, gives the GPUs (``--gres=gpu:K``: it sets ``CUDA_VISIBLE_DEVICES`` inside the job, and with
``ConstrainDevices=yes`` fences the others off); the job's id gives the ``MASTER_PORT`` (``base + id % span``, so two
jobs on one node differ unless their ids are ``span`` apart); the hub's environment must sit on a path every node
sees (``HUB_PREFIX`` on the cluster's shared file system).  The hub runs as root and submits as the learner
(``runuser``), so the job is theirs.
"""
from __future__ import annotations

import os
from pathlib import Path

from .roster import Roster
from .system import COPY, copy_notebooks


def slurm_spawner_class():
    import batchspawner  # noqa: F401  (registers the hub's /api/batchspawner, where the job reports its port)
    from batchspawner import SlurmSpawner
    from traitlets import Unicode

    class CourseSlurmSpawner(SlurmSpawner):
        notebooks = Unicode(help="the notebooks each learner gets a copy of, once").tag(config=True)
        roster_file = Unicode(help="the roster: who may start a server").tag(config=True)

        async def start(self):
            Roster.load(Path(self.roster_file)).seat(self.user.name)    # RosterError: not on the roster
            copy_notebooks(Path(self.notebooks), self.user.name)
            return await super().start()

        def get_env(self):
            env = super().get_env()
            env["COURSE_NOTEBOOKS"] = os.path.join(os.path.expanduser(f"~{self.user.name}"), COPY)
            return env

    return CourseSlurmSpawner


def configure_slurm(c, s: dict, roster: Roster, state: Path) -> None:
    venv_bin = str(Path(s["singleuser"]).parent)
    c.JupyterHub.spawner_class = slurm_spawner_class()
    c.CourseSlurmSpawner.notebooks = s["notebooks"]
    c.CourseSlurmSpawner.roster_file = str(state / "roster.json")
    c.CourseSlurmSpawner.exec_prefix = "runuser -u {username} --"
    c.CourseSlurmSpawner.req_partition = s.get("partition", "")
    c.CourseSlurmSpawner.req_gres = f"gpu:{roster.gpus_per_learner}" if roster.gpus_per_learner else ""
    c.CourseSlurmSpawner.req_runtime = s.get("runtime", "08:00:00")
    c.CourseSlurmSpawner.req_srun = ""
    c.CourseSlurmSpawner.req_prologue = (
        f"export PATH={venv_bin}:$PATH CUDA_DEVICE_ORDER=PCI_BUS_ID MASTER_ADDR=127.0.0.1\n"
        f"export MASTER_PORT=$(( {s.get('port_base', 20000)} + SLURM_JOB_ID % {s.get('port_span', 10000)} ))")
    c.Spawner.start_timeout = 300
