"""The DDP recipe under torchrun: it trains, resumes bit for bit, survives a killed rank, refuses bad launches."""
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import RECIPE
from conftest import RECIPE_ARGS as ARGS

from course_lib.launch.commands import CommandError, json_lines, run_command, torchrun, torchrun_nodes
from course_lib.recipes import fault_injection, train_ddp

CRASH_JOBS = int(os.environ.get("COURSE_CRASH_JOBS", "10"))   # two-node crash-and-restart jobs (10 in CI)


def test_recipe_trains_under_torchrun_with_gloo_on_cpu(uninterrupted):
    s = uninterrupted
    assert s["event"] == "done" and s["world_size"] == 2 and s["epochs"] == 3
    if not torch.cuda.is_available():
        assert s["backend"] == "gloo" and s["device"] == "cpu" and s["bf16"] is False
    assert s["losses"][-1] < s["losses"][0] / 2


def test_resumed_run_ends_with_the_same_weights(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "snap.pt")
    torchrun(RECIPE, "--epochs", "1", *ARGS[2:], "--checkpoint", ckpt, nproc_per_node=2, module=True, echo=False)
    out = torchrun(RECIPE, *ARGS, "--checkpoint", ckpt, nproc_per_node=2, module=True, echo=False)
    resumed = json_lines(out.output)[-1]
    assert "resumed from" in out.output and "after 1 epoch(s)" in out.output
    assert resumed["weights"] == uninterrupted["weights"] and resumed["losses"] == uninterrupted["losses"]
    assert sorted(os.listdir(tmp_path)) == ["snap.pt"]


def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_ends_identically(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "snap.pt")
    out = torchrun(RECIPE, *ARGS, "--checkpoint", ckpt, "--crash-at-epoch", "2", nproc_per_node=2, module=True,
                   echo=False, torchrun_args=("--max-restarts=1",), timeout=300)
    assert "killing myself half-way through epoch 2" in out.output and "resumed from" in out.output
    assert json_lines(out.output)[-1]["weights"] == uninterrupted["weights"]


def test_without_restarts_a_killed_rank_fails_the_job(tmp_path):
    with pytest.raises(CommandError) as info:
        torchrun(RECIPE, *ARGS, "--crash-at-epoch", "1", nproc_per_node=2, module=True, echo=False, timeout=300)
    assert "SIGKILL" in info.value.output or "exitcode" in info.value.output


def test_two_nodes_over_loopback_equal_one_node_with_two_ranks(uninterrupted):
    nodes = torchrun_nodes(RECIPE, *ARGS, "--backend", "gloo", nnodes=2, nproc_per_node=1, module=True,
                           echo=False, timeout=300)
    summary = json_lines(nodes[0].output)[-1]
    assert summary["world_size"] == 2
    if uninterrupted["backend"] == "gloo":
        assert summary["weights"] == uninterrupted["weights"]
    assert json_lines(nodes[1].output) == []  # only global rank 0 prints the summary


def _two_node_crash_job(ckpt_dir: str) -> dict:
    """Rank 1 (the second "node") SIGKILLs itself half-way through epoch 2; torchrun may restart 3 times."""
    nodes = torchrun_nodes(RECIPE, *ARGS, "--backend", "gloo", "--checkpoint", os.path.join(ckpt_dir, "snap.pt"),
                           "--crash-at-epoch", "2", nnodes=2, nproc_per_node=1, module=True, echo=False, timeout=120,
                           torchrun_args=("--max-restarts=3",))
    out = "".join(n.output for n in nodes)
    return {"killed": "killing myself" in out, "resumed": "resumed from" in out,
            "weights": json_lines(nodes[0].output)[-1]["weights"]}


def test_a_killed_rank_on_two_loopback_nodes_is_recovered_every_time(uninterrupted):
    """Each "node" is a torchrun agent that counts its own restarts: the job must still meet again after a crash.
    (With the store shared across restarts and per-attempt keys, 4 of 5 such jobs hung until killed.)"""
    def job(_):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                return _two_node_crash_job(tmp)
            except CommandError as e:
                return {"error": str(e)[-600:]}
    with ThreadPoolExecutor(2) as pool:                    # two jobs at a time: 2 cores, 4 processes
        results = list(pool.map(job, range(CRASH_JOBS)))
    good = [r for r in results if r.get("weights") == uninterrupted["weights"] and r["killed"] and r["resumed"]]
    assert len(good) == CRASH_JOBS, f"{len(good)} of {CRASH_JOBS} recovered: {[r for r in results if r not in good]}"


def test_restarts_with_a_store_shared_across_restarts_are_refused_at_once():
    with pytest.raises(SystemExit, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        train_ddp.check_restarts({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"})
    train_ddp.check_restarts({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"})
    train_ddp.check_restarts({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"})
    train_ddp.check_restarts({})                           # not under torchrun (launch_env says so)


def test_torchrun_helpers_ask_for_a_fresh_store_per_restart():
    """What torch tells the workers: a store shared by all restart rounds by default, a fresh one with the helpers."""
    fresh = json_lines(torchrun("course_lib.recipes.whoami", nproc_per_node=1, module=True, echo=False).output)[0]
    shared = json_lines(torchrun("course_lib.recipes.whoami", nproc_per_node=1, module=True, echo=False,
                                 env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}).output)[0]
    assert fresh["TORCHELASTIC_USE_AGENT_STORE"] == "False" and shared["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_no_launcher_fails_at_once_with_the_command_to_use():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", RECIPE], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.monotonic() - start < 60
    assert "must be started by a launcher" in out.stderr and "torch.distributed.run" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_nccl_without_gpus_fails_with_the_fix():
    with pytest.raises(CommandError) as info:
        run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", RECIPE,
                     "--backend", "nccl"], echo=False, timeout=120)
    assert "needs CUDA GPUs and this machine has none" in info.value.output and "--backend gloo" in info.value.output


def test_the_recipe_uses_the_courses_one_backend_policy(monkeypatch):
    from course_lib import hardware

    def fake(gpus, nccl=True):
        monkeypatch.setattr(hardware, "gpu_count", lambda: gpus)
        monkeypatch.setattr(hardware, "backends", lambda: {"gloo": True, "nccl": nccl, "mpi": False})
    for gpus, local_ranks, nccl, want in ((0, 2, False, "gloo"), (2, 2, True, "nccl"), (2, 3, True, "gloo"),
                                          (8, 8, True, "nccl")):
        fake(gpus, nccl)
        assert train_ddp.choose_backend(None, local_ranks) == hardware.default_backend(local_ranks) == want
    assert train_ddp.choose_backend("gloo", 8) == "gloo"
    fake(2)
    with pytest.raises(SystemExit, match="3 ranks on this machine and it has 2 GPUs.*--backend gloo"):
        train_ddp.choose_backend("nccl", 3)
    fake(1, nccl=False)
    with pytest.raises(SystemExit, match="has no 'nccl' backend"):
        train_ddp.choose_backend("nccl", 1)


def test_launch_env_names_what_is_missing():
    with pytest.raises(SystemExit, match="LOCAL_RANK not set"):
        train_ddp.launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert train_ddp.launch_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == \
        {"RANK": 3, "LOCAL_RANK": 1, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2}


@pytest.mark.parametrize("argv, phrase", [
    (["--save-every", "0"], "--save-every: must be > 0"),
    (["--batch-size", "-4"], "--batch-size: must be > 0"),
    (["--lr", "fast"], "--lr: 'fast' is not a number"),
    (["--epochs", "2", "--crash-at-epoch", "3"], "after the last epoch"),
    (["--crash-at-epoch", "0"], "--crash-at-epoch: must be > 0"),
    (["--checkpoint", "."], "is a directory: give a file name")])
def test_bad_options_stop_with_a_usage_message(argv, phrase, capsys):
    """What ``python -m course_lib.recipes.train_ddp`` parses: the recipe's options and the fault injection's."""
    with pytest.raises(SystemExit) as info:
        fault_injection.parse_args(argv)
    assert info.value.code == 2 and phrase in capsys.readouterr().err


def test_an_unusable_checkpoint_stops_the_job_with_what_to_do(tmp_path):
    """Another model's snapshot, a file that is not a snapshot, a damaged one: no traceback soup."""
    ok = str(tmp_path / "ok.pt")
    torchrun(RECIPE, "--epochs", "1", *ARGS[2:], "--checkpoint", ok, nproc_per_node=1, module=True, echo=False)
    torch.save({"model": 1}, tmp_path / "other.pt")
    (tmp_path / "damaged.pt").write_bytes(open(ok, "rb").read()[:200])
    for name, why in [("ok.pt", "another model's weights (size mismatch"), ("other.pt", "it has no 'optimizer'"),
                      ("damaged.pt", "the file is damaged or is not a torch.save file")]:
        with pytest.raises(CommandError) as info:        # ok.pt has --hidden 32: resume it with 16
            torchrun(RECIPE, "--epochs", "2", "--samples", "600", "--hidden", "16", "--checkpoint",
                     str(tmp_path / name), nproc_per_node=1, module=True, echo=False, timeout=120)
        assert f"cannot resume from {tmp_path / name}: {why}" in info.value.output, info.value.output[-1500:]
        assert "move it away to start afresh" in info.value.output


def test_slurm_template_parses():
    path = os.path.join(os.path.dirname(train_ddp.__file__), "slurm_ddp.sbatch")
    run_command(["bash", "-n", path], echo=False)
    text = open(path).read()
    assert "--rdzv-backend=c10d" in text and "-m course_lib.recipes.train_ddp" in text


def test_json_lines_strips_launcher_prefixes():
    out = '[node 0][default0]:{"a": 1}\nnoise\n[default1]:{"b": 2}\n{"c": 3}\n'
    assert json_lines(out) == [{"a": 1}, {"b": 2}, {"c": 3}]


@pytest.mark.gpu
def test_recipe_with_nccl_and_bf16_on_gpu():
    out = torchrun(RECIPE, *ARGS, nproc_per_node=1, module=True, echo=False, timeout=300)
    s = json_lines(out.output)[-1]
    import torch

    from course_lib import hardware
    assert s["backend"] == "nccl" and s["device"] == "cuda"
    assert s["bf16"] is hardware.fast_bf16(torch.device("cuda", 0))   # on by default where bf16 is native
    assert s["losses"][-1] < s["losses"][0] / 2


def test_the_recipe_listing_holds_no_fault_injection():
    """The part a learner writes in their own job (setup, Trainer, main) says nothing of crashes."""
    import inspect
    listing = "".join(inspect.getsource(f) for f in (train_ddp.setup, train_ddp.Trainer, train_ddp.main))
    assert "crash" not in listing and "SIGKILL" not in listing
    faults, rest = fault_injection.parse_args(["--epochs", "3", "--crash-at-epoch", "2", "--crash-rank", "0"])
    assert (faults.crash_at_epoch, faults.crash_rank, rest) == (2, 0, ["--epochs", "3"])


def test_a_crash_rank_outside_the_job_is_refused(tmp_path):
    with pytest.raises(CommandError) as info:
        torchrun(RECIPE, *ARGS, "--crash-at-epoch", "1", "--crash-rank", "5", nproc_per_node=2, module=True,
                 echo=False, timeout=120)
    assert "--crash-rank 5 is not a rank of this job (0..1)" in info.value.output


def test_command_line_is_what_a_learner_types():
    from course_lib.recipes import command_line
    ran = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", RECIPE,
           "--x", "a b"]
    assert command_line(ran) == f"torchrun --standalone --nproc-per-node=2 -m {RECIPE} --x 'a b'"
    assert command_line([sys.executable, "-m", RECIPE], env={"A": 1, "B": None}) == f"A=1 python -m {RECIPE}"


def test_notebook_05_exercise_solutions(uninterrupted):
    """Exercise 1: 3 ranks scale the rate by 3 and end elsewhere; exercise 2: torchrun's ranks are the picture's."""
    three = json_lines(torchrun(RECIPE, *ARGS, nproc_per_node=3, module=True, echo=False, timeout=300).output)[-1]
    assert three["world_size"] == 3 and three["lr"] == pytest.approx(3 * 0.05)
    assert three["weights"] != uninterrupted["weights"] and three["losses"][-1] < three["losses"][0] / 2
    from course_lib import viz
    nodes = torchrun_nodes("course_lib.recipes.whoami", nnodes=2, nproc_per_node=2, module=True, echo=False,
                           timeout=120)
    told = sorted((w for n in nodes for w in json_lines(n.output)), key=lambda w: int(w["RANK"]))
    _, drawn = viz.draw_torchrun(2, 2)
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK")
    assert [tuple(int(w[k]) for k in keys) for w in told] == [tuple(w[k] for k in keys) for w in drawn]
