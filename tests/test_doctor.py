"""The preflight: its checks, its notebook table, and its exit code."""
import shutil
import subprocess
import sys

from conftest import env_with_path

from course_lib import course_map, doctor
from course_lib.launch import slurm


def test_preflight_passes_here_and_exits_zero():
    out = subprocess.run([sys.executable, "-m", "course_lib", "doctor"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[  ok] gloo 2-rank all_reduce: 2 ranks agreed" in out.stdout
    assert "00_welcome.ipynb" in out.stdout and "ready:" in out.stdout


def test_preflight_fails_with_the_fix_when_something_is_missing(tmp_path):
    # a fake package that shadows cloudpickle and fails to import, as a broken install would
    (tmp_path / "cloudpickle.py").write_text("raise ImportError('simulated missing package')\n")
    env = env_with_path(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "course_lib", "doctor", "--no-smoke"], capture_output=True,
                         text=True, timeout=180, env=env)
    assert out.returncode == 1
    assert "[FAIL] cloudpickle: missing" in out.stdout and "fix: pip install -e '.[test]'" in out.stdout
    assert "NOT READY" in out.stdout


def test_slurm_line_says_whether_the_batch_script_can_be_tried_here():
    absent = doctor._slurm(None)
    assert absent.status == doctor.INFO and "sudo bash tests/slurm/local-cluster.sh start" in absent.detail
    silent = doctor._slurm(slurm.Cluster("slurm-wlm 22.05.8", error="Unable to contact slurm controller"))
    assert silent.status == doctor.WARN and "no controller answers" in silent.detail
    assert "local-cluster.sh" in silent.fix
    up = doctor._slurm(slurm.Cluster("slurm-wlm 22.05.8", "course", {"n1": "idle", "n2": "idle"}))
    assert up.status == doctor.OK and "cluster 'course': n1 idle, n2 idle" in up.detail
    here = doctor._slurm(slurm.probe())                 # what this machine has: a line either way
    assert (here.status == doctor.INFO) == (shutil.which("sbatch") is None)


def test_small_shm_is_a_failure_with_the_docker_fix():
    c = doctor._shm(64.0)
    assert c.status == doctor.FAIL and "--shm-size" in c.fix
    assert doctor._shm(512.0).status == doctor.WARN
    assert doctor._shm(4096.0).status == doctor.OK
    assert doctor._shm(None).status == doctor.INFO


def test_notebook_table_by_gpu_count():
    cpu = dict(doctor.notebook_table(gpu_count=0))
    two = dict(doctor.notebook_table(gpu_count=2))
    assert list(cpu) == [nb.file for nb in course_map.NOTEBOOKS]
    for nb in course_map.NOTEBOOKS:
        if nb.gpus_for_all == 0:
            assert cpu[nb.file] == two[nb.file] == "full"
        else:
            assert cpu[nb.file].startswith(nb.cpu) and two[nb.file] == "full"
            if nb.cpu == "partial":
                assert cpu[nb.file].endswith("fall back to the CPU") and " 1 GPUs" not in cpu[nb.file]
    assert all(s.startswith("no") for _, s in doctor.notebook_table(0, failed=True))


def test_cli_usage_is_explained():
    out = subprocess.run([sys.executable, "-m", "course_lib"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "doctor" in out.stderr


def test_peer_access_report_names_missing_pairs():
    full = doctor._peer_access(2, lambda i, j: True)
    assert full.status == doctor.OK and "all 2 GPU pairs" in full.detail
    partial = doctor._peer_access(3, lambda i, j: (i, j) != (0, 2))
    assert partial.status == doctor.WARN and "0->2" in partial.detail and "nvidia-smi topo -m" in partial.fix


def test_nccl_smoke_failure_is_reported_with_the_fix(monkeypatch):
    from course_lib import launch

    def refuse(*args, **kwargs):
        raise launch.LaunchError("NCCL error: unhandled system error")
    monkeypatch.setattr(launch, "run", refuse)
    check = doctor._nccl_smoke(2)
    assert check.status == doctor.FAIL and "NCCL error" in check.detail and "NCCL_DEBUG=INFO" in check.fix


def test_hub_line_says_how_many_learners_this_vm_serves_and_whether_the_proxy_is_there():
    absent = doctor._hub("/opt/course-hub", 8, 32, None, None, None)
    assert absent.status == doctor.INFO and "make hub" in absent.detail
    ready = doctor._hub("/opt/course-hub", 8, 32, "6.1.1", "/opt/course-hub/node/.bin/chp", None)
    assert ready.status == doctor.OK
    assert "up to 8 learners with 1 GPU each, 4 with 2" in ready.detail and "proxy /opt/course-hub" in ready.detail
    cpu = doctor._hub("/opt/course-hub", 0, 2, "6.1.1", "/x/chp", None)
    assert "a CPU class (GPUS_PER_LEARNER=0), about 1 learner running" in cpu.detail
    no_proxy = doctor._hub("/opt/course-hub", 8, 32, "6.1.1", None, None)
    assert no_proxy.status == doctor.FAIL and "configurable-http-proxy missing" in no_proxy.detail
    assert "make hub-env" in no_proxy.fix and "Node.js 20+" in no_proxy.fix
    roster = {"gpus": 8, "gpus_per_learner": 2, "seats": [{"admin": False}] * 4 + [{"admin": True}]}
    fits = doctor._hub("/opt/course-hub", 8, 32, "6.1.1", "/x/chp", roster)
    assert fits.status == doctor.OK and "roster: 4 learners x 2 GPUs" in fits.detail
    shrunk = doctor._hub("/opt/course-hub", 4, 32, "6.1.1", "/x/chp", roster)   # a VM with fewer GPUs now
    assert shrunk.status == doctor.FAIL and "needs 8 GPUs and this machine has 4" in shrunk.fix
    here = doctor._hub_here()                   # whatever this machine has: a line either way
    assert here.name == "hub" and here.status in (doctor.INFO, doctor.OK, doctor.FAIL)
