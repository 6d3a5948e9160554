"""course_lib installed as a wheel (not ``-e``), used from another folder: the map and the preflight still list
every notebook, and say where the notebooks are or where they looked."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from course_lib import course_map

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A wheel built from this checkout, installed into a folder of its own (no -e, no dependencies)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist",
                    ROOT], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp / "dist").glob("course_lib-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "course_lib/requirements.txt" in names and "course_lib/recipes/slurm_ddp.sbatch" in names
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", tmp / "site", wheel],
                   check=True, timeout=300, capture_output=True)
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return tmp / "site", elsewhere


def course_lib_cli(site, cwd, *args, env=None):
    import os
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_NOTEBOOKS")}
    environ.update({"PYTHONPATH": str(site), **(env or {})})
    return subprocess.run([sys.executable, "-m", "course_lib", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=180)


def test_the_installed_package_is_the_wheel_and_its_version_is_the_one_version(installed):
    site, elsewhere = installed
    out = subprocess.run([sys.executable, "-c", "import course_lib, json; print(json.dumps([course_lib.__file__, "
                          "course_lib.__version__]))"], cwd=elsewhere, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    where, version = json.loads(out.stdout)
    import course_lib
    assert where.startswith(str(site)) and version == course_lib.__version__


def test_map_and_doctor_list_every_notebook_from_another_folder(installed):
    site, elsewhere = installed
    out = course_lib_cli(site, elsewhere, "map")
    assert out.returncode == 0, out.stderr
    assert all(nb.file in out.stdout for nb in course_map.NOTEBOOKS) and "coming" not in out.stdout
    out = course_lib_cli(site, elsewhere, "doctor", "--no-smoke")
    assert all(nb.file in out.stdout for nb in course_map.NOTEBOOKS), out.stdout
    assert "not written yet" not in out.stdout
    assert "[warn] notebooks: not found (looked in: " in out.stdout and str(elsewhere) in out.stdout
    assert "COURSE_NOTEBOOKS" in out.stdout


@pytest.mark.parametrize("how", ["COURSE_NOTEBOOKS", "from the course folder", "from notebooks/"])
def test_doctor_finds_the_notebooks(installed, how):
    site, elsewhere = installed
    cwd, env = {"COURSE_NOTEBOOKS": (elsewhere, {"COURSE_NOTEBOOKS": str(ROOT / "notebooks")}),
                "from the course folder": (ROOT, None), "from notebooks/": (ROOT / "notebooks", None)}[how]
    out = course_lib_cli(site, cwd, "doctor", "--no-smoke", env=env)
    assert f"[  ok] notebooks: in {ROOT / 'notebooks'}" in out.stdout, out.stdout
