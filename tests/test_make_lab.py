"""`make lab` as learners and instructors run it: as root too (Docker, cloud GPU VMs), with JupyterLab's own
options passed through LAB_ARGS, and serving the course's notebooks."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from course_lib.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_lab(stamp: Path, *variables: str, dry_run: bool = False) -> list[str]:
    """``make lab`` with this Python's environment (its bin folder; an up-to-date stamp, so nothing installs)."""
    stamp.touch()
    return ["make", "--no-print-directory", *(["-n"] if dry_run else []), "-C", str(ROOT), "lab",
            f"BIN={Path(sys.executable).parent}", f"STAMP={stamp}", *variables]


def get(url: str):
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status, reply.read()


def test_make_lab_with_lab_args_starts_jupyterlab_and_serves_the_course(tmp_path):
    port, token = free_port(), "make-lab-test"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = tmp_path / "make-lab.log"
    cmd = make_lab(tmp_path / "stamp", f"LAB_ARGS=--no-browser --port {port} --IdentityProvider.token={token}")
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                status, _ = get(f"{base}/lab?token={token}")
                break
            except OSError:
                assert proc.poll() is None, f"make lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"JupyterLab did not answer in 90 s:\n{log.read_text()[-3000:]}"
                time.sleep(0.3)
        assert status == 200
        _, body = get(f"{base}/api/contents?token={token}")    # it serves the notebooks' folder
        served = {item["name"] for item in json.loads(body)["content"]}
        assert {p.name for p in (ROOT / "notebooks").glob("*.ipynb")} <= served
    finally:
        os.killpg(proc.pid, signal.SIGTERM)            # what Ctrl+C does: JupyterLab shuts down
        try:
            proc.wait(timeout=30)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    command = next(line for line in log.read_text().splitlines() if "jupyter lab" in line)
    assert ("--allow-root" in command) == (os.geteuid() == 0), command
    assert f"--port {port}" in command


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root, to try another user")
def test_make_lab_allows_root_only_for_root():
    """The same Makefile, read by root and by `nobody`: only root's command has --allow-root."""
    folder = Path(tempfile.mkdtemp(prefix="make-lab-", dir="/tmp"))   # one that `nobody` can read
    try:
        folder.chmod(0o755)
        shutil.copy(ROOT / "Makefile", folder / "Makefile")
        (folder / "Makefile").chmod(0o644)
        (folder / "pyproject.toml").touch()           # the set-up step's prerequisites
        (folder / "course_lib").mkdir()
        (folder / "course_lib" / "requirements.txt").write_text("torch>=2.11\n")
        for p in (folder / "course_lib", folder / "course_lib" / "requirements.txt"):
            p.chmod(0o755 if p.is_dir() else 0o644)

        def lab_command(*as_user: str) -> str:
            done = subprocess.run([*as_user, "make", "-n", "-C", str(folder), "lab", "LAB_ARGS=--no-browser"],
                                  capture_output=True, text=True, check=False)
            assert done.returncode == 0, done.stderr
            return next(line for line in done.stdout.splitlines() if "jupyter lab" in line)

        assert "--allow-root --no-browser" in lab_command()
        as_nobody = lab_command("runuser", "-u", "nobody", "--")
        assert "--allow-root" not in as_nobody and "--no-browser" in as_nobody
    finally:
        shutil.rmtree(folder)
