"""run_command and torchrun: output shown, failures raised, timeouts stop the whole process tree."""
import sys
import textwrap
import time

import pytest
from conftest import descendants, wait_gone

from course_lib.launch.commands import CommandError, json_lines, run_command, torchrun, torchrun_nodes

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} sum {t.item():g}", flush=True)
    if len(sys.argv) > 1 and dist.get_rank() == 1:
        sys.exit(int(sys.argv[1]))
    dist.destroy_process_group()
""")


def test_run_command_streams_and_returns(capsys):
    done = run_command([sys.executable, "-c", "print('one'); print('two')"])
    assert done.returncode == 0 and done.output == "one\ntwo\n"
    assert capsys.readouterr().out == "one\ntwo\n"


def test_run_command_raises_with_the_tail_of_the_output():
    with pytest.raises(CommandError) as info:
        run_command([sys.executable, "-c", "import sys; print('about to fail'); sys.exit(3)"], echo=False)
    assert info.value.returncode == 3 and "exit code 3" in str(info.value) and "about to fail" in str(info.value)
    with pytest.raises(CommandError, match="was not found"):
        run_command(["no-such-command-anywhere"])


def test_run_command_timeout_stops_the_process_tree():
    before = descendants()
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(CommandError, match="did not finish within 2 s"):
        run_command([sys.executable, "-c", code], timeout=2, echo=False)
    assert time.monotonic() - start < 10
    assert wait_gone(descendants() - before) == set()


def test_torchrun_runs_every_rank_and_raises_on_failure(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = torchrun(str(script), nproc_per_node=2, timeout=120)
    out = capsys.readouterr().out
    assert "[default0]:rank 0 sum 3" in out and "[default1]:rank 1 sum 3" in out
    assert done.returncode == 0
    with pytest.raises(CommandError) as info:
        torchrun(str(script), 7, nproc_per_node=2, timeout=120, echo=False)
    assert info.value.returncode != 0 and "FAILED" in info.value.output and "exitcode" in info.value.output


def test_torchrun_bad_arguments():
    with pytest.raises(ValueError, match="nproc_per_node"):
        torchrun("x.py", nproc_per_node=0)
    with pytest.raises(ValueError, match="nproc_per_node"):
        torchrun_nodes("x.py", nproc_per_node=-1)
    with pytest.raises(ValueError, match="nnodes"):
        torchrun_nodes("x.py", nnodes=0)
    with pytest.raises(FileNotFoundError, match="pass module=True"):
        torchrun("course_lib.recipes.train_ddp")


@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_nodes_meet_in_either_form_and_share_one_master(form):
    nodes = torchrun_nodes("course_lib.recipes.whoami", nnodes=2, nproc_per_node=2, module=True, echo=False,
                           rendezvous=form, timeout=120)
    told = [w for node in nodes for w in json_lines(node.output)]
    assert sorted(w["RANK"] for w in told) == [0, 1, 2, 3]
    assert all(w["RANK"] == 2 * w["GROUP_RANK"] + w["LOCAL_RANK"] for w in told)
    assert len({w["master"] for w in told}) == 1
    if form == "static":
        assert f"--master-port={told[0]['master'].split(':')[1]}" in nodes[0].args


def test_torchrun_nodes_refuses_an_unknown_rendezvous():
    with pytest.raises(ValueError, match="'c10d' or 'static'"):
        torchrun_nodes("course_lib.recipes.whoami", module=True, rendezvous="etcd")


def test_run_command_can_unset_a_variable(monkeypatch):
    monkeypatch.setenv("COURSE_SOME_SETTING", "from the kernel")
    show = [sys.executable, "-c", "import os; print(os.environ.get('COURSE_SOME_SETTING', 'unset'))"]
    assert run_command(show, echo=False).output.strip() == "from the kernel"
    assert run_command(show, echo=False, env={"COURSE_SOME_SETTING": None}).output.strip() == "unset"


def test_json_lines_reads_objects_that_ranks_printed_onto_one_line():
    # Under PYTHONUNBUFFERED a print is two writes; two ranks sharing a stdout then give {...}{...} and "", and
    # torchrun's --tee copies a half-written line as it finds it.
    out = ('{"rank": 0}{"rank": 1, "x": {"y": 2}}\n\n[default0]:{"rank": 2}\n'
           '[default0]: {"rank": 3}[default1]:{"rank": 4}\n[default0]:{"rank": 5}[default0]:\n'
           'loss {"not": "a report"}\n{"rank": 6} and a tail\n{"rank": 7}[1]\n{"truncated": \n')
    assert [o["rank"] for o in json_lines(out)] == [0, 1, 2, 3, 4, 5]


def test_print_json_is_one_write(monkeypatch):
    import io

    from course_lib.launch.commands import print_json

    class Counting(io.StringIO):
        writes = 0

        def write(self, text):
            Counting.writes += 1
            return super().write(text)

    out = Counting()
    monkeypatch.setattr(sys, "stdout", out)
    print_json({"rank": 0, "nested": {"a": [1, 2]}})
    assert Counting.writes == 1 and json_lines(out.getvalue()) == [{"rank": 0, "nested": {"a": [1, 2]}}]


def test_plain_torchrun_workers_report_every_rank():
    # The shape notebook 05 runs: no --tee, both workers write to the one stdout at once.
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "-m", "course_lib.recipes.whoami"], echo=False, timeout=120).output
    assert sorted(w["RANK"] for w in json_lines(out)) == [0, 1], out
