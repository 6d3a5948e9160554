"""The hub's roster (course_lib.hub.roster): who gets which GPUs and ports on a shared VM. Plain Python: runs
everywhere; the hub itself is tested in tests/test_hub.py."""
import itertools
import os
import subprocess
import sys

import pytest

from course_lib.hub import Roster, RosterError, plan
from course_lib.hub.roster import ephemeral_low


def test_four_learners_with_two_gpus_each_get_disjoint_gpus_and_port_blocks():
    r = plan(4, 2, gpus=8)
    assert [s.name for s in r.learners] == ["learner1", "learner2", "learner3", "learner4"]
    assert [s.gpus for s in r.learners] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for a, b in itertools.combinations(r.seats, 2):
        assert not set(a.gpus) & set(b.gpus), (a, b)
        assert a.last_port < b.first_port or b.last_port < a.first_port, (a, b)
    assert r.admin.name == "instructor" and r.admin.gpus == ()       # every GPU went to a learner
    assert all(s.last_port < ephemeral_low() for s in r.seats)      # below the range the OS hands out
    env = r.seat("learner2").env()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["MASTER_PORT"] == "20100" and env["COURSE_PORTS"] == "20100-20199"


def test_the_instructor_gets_the_gpus_no_learner_has():
    r = plan(3, 2, gpus=8)
    assert r.admin.gpus == (6, 7) and r.seat("instructor").admin


def test_an_unknown_user_is_refused_by_name():
    r = plan(2, 1, gpus=2)
    with pytest.raises(RosterError, match=r"'mallory' is not on the roster \(learner1, learner2, instructor\)"):
        r.seat("mallory")


def test_too_many_learners_for_the_gpus_is_refused_with_what_fits():
    with pytest.raises(RosterError, match=r"4 learners x 2 GPUs need 8 GPUs; this machine has 4: serve 2 learners "
                                          r"with 2 GPUs each \(LEARNERS=2\) or give each 1 \(GPUS_PER_LEARNER=1\)"):
        plan(4, 2, gpus=4)
    with pytest.raises(RosterError, match="5 learners but only 4 GPUs"):
        plan(5, None, gpus=4)


def test_a_cpu_machine_serves_a_cpu_class_and_says_how():
    r = plan(3, None, gpus=0)
    assert r.gpus_per_learner == 0 and all(s.gpus == () for s in r.seats)
    assert r.seat("learner3").env()["CUDA_VISIBLE_DEVICES"] == ""      # empty: torch sees no GPU
    with pytest.raises(RosterError, match=r"2 learners x 1 GPUs need 2 GPUs and this machine has none \(nvidia-smi "
                                          r"sees no GPU\): say GPUS_PER_LEARNER=0 for a CPU class"):
        plan(2, 1, gpus=0)


def test_even_share_by_default_and_names_given():
    r = plan(2, None, gpus=8, names=["ada", "grace"])
    assert [(s.name, s.gpus) for s in r.learners] == [("ada", (0, 1, 2, 3)), ("grace", (4, 5, 6, 7))]
    with pytest.raises(RosterError, match="not a user name"):
        plan(1, 0, gpus=0, names=["Bad.Name"])
    with pytest.raises(RosterError, match="appears twice"):
        plan(2, 0, gpus=0, names=["ada", "ada"])


def test_port_blocks_that_reach_the_ephemeral_range_are_refused():
    with pytest.raises(RosterError, match="inside the ephemeral range"):
        plan(4, 0, gpus=0, port_base=32000, port_block=200, port_limit=32768)


def test_the_roster_survives_its_file(tmp_path):
    r = plan(2, 1, gpus=3)
    r.save(tmp_path / "roster.json")
    assert Roster.load(tmp_path / "roster.json") == r


def test_the_cli_prints_the_roster_and_refuses_a_roster_the_gpus_cannot_serve():
    cmd = [sys.executable, "-m", "course_lib.hub", "roster", "--gpus", "8", "--learners", "4",
           "--gpus-per-learner", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "learner4" in out.stdout and "6,7" in out.stdout and "20300" in out.stdout
    cmd[cmd.index("--learners") + 1] = "5"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "5 learners x 2 GPUs need 10 GPUs; this machine has 8" in out.stderr


def test_up_without_passwords_says_which_to_set_before_anything_changes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_HUB_")}
    out = subprocess.run([sys.executable, "-m", "course_lib.hub", "up", "--prefix", str(tmp_path), "--gpus", "0",
                          "--names", "hubtestnopw"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    if os.geteuid() == 0:
        assert "set COURSE_HUB_PASSWORD" in out.stderr
    else:
        assert "needs root" in out.stderr
    assert not (tmp_path / "state").exists() and "hubtestnopw" not in open("/etc/passwd").read()
