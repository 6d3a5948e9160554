"""course_lib.launch.run: real processes, real failures, and a count of processes before and after."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from conftest import env_with_path, wait_gone

from course_lib import hardware, launch
from course_lib.launch import RankDiedError, RankError, RunTimeoutError, run


def test_results_in_rank_order_with_args_closures_and_lambdas(no_leftovers):
    offset = 100  # captured by the closure below: it must travel by value

    def worker(rank, world_size, scale):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x)
        return {"rank": rank, "world": world_size, "sum": x.item() * scale + offset,
                "initialised": dist.is_initialized(), "backend": dist.get_backend()}

    out = run(worker, 3, 2.0, backend="gloo", show_output=False)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 3 * 2.0 + 100 for o in out)
    assert all(o["initialised"] and o["backend"] == "gloo" for o in out)
    assert run(lambda rank, world_size: rank * world_size, 4, show_output=False) == [0, 4, 8, 12]


def test_one_rank_and_eight_ranks(no_leftovers):
    assert run(lambda r, w: dist.get_world_size(), 1, show_output=False) == [1]

    def total(rank, world_size):
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        return t.tolist()
    assert run(total, 8, backend="gloo", show_output=False) == [[28.0, 28.0]] * 8


def test_output_of_every_rank_is_relayed_in_rank_order(capsys, no_leftovers):
    def chatty(rank, world_size):
        time.sleep(0.05 * (world_size - rank))  # the last rank prints first
        print("python says", rank)
        print("to stderr", rank, file=sys.stderr)
        os.write(1, f"C-level write {rank}\n".encode())  # what C++ and libraries print
    run(chatty, 3)
    lines = capsys.readouterr().out.splitlines()
    ranks = [int(line.split("]")[0].split()[1]) for line in lines]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1, 2}
    for r in range(3):
        assert f"[rank {r}] python says {r}" in lines
        assert f"[rank {r}] to stderr {r}" in lines
        assert f"[rank {r}] C-level write {r}" in lines


def test_show_output_false_prints_nothing(capsys):
    run(lambda r, w: print("hidden"), 2, show_output=False)
    assert capsys.readouterr().out == ""


def test_a_rank_that_raises_fails_the_run_fast_with_its_traceback(no_leftovers):
    def faulty(rank, world_size):
        if rank == 1:
            raise ValueError("bad shard on purpose")
        time.sleep(60)  # the others would wait: they must be stopped, not waited for

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run(faulty, 3, show_output=False)
    assert time.monotonic() - start < 10
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError" and "bad shard on purpose" in str(err)
    assert 'raise ValueError("bad shard on purpose")' in err.remote_traceback  # source line shown
    assert "in faulty" in err.remote_traceback


def test_a_rank_that_dies_is_named_with_its_exit_code(no_leftovers):
    def dies(rank, world_size):
        if rank == 2:
            os._exit(3)
        time.sleep(60)
    with pytest.raises(RankDiedError) as info:
        run(dies, 3, show_output=False)
    assert info.value.rank == 2 and info.value.exitcode == 3
    assert "rank 2 of 3 died with exit code 3" in str(info.value)


def test_a_killed_rank_is_reported_with_its_signal(no_leftovers):
    def killed(rank, world_size):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    with pytest.raises(RankDiedError) as info:
        run(killed, 2, show_output=False)
    assert info.value.rank == 0 and info.value.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value)


def test_a_collective_only_some_ranks_call_times_out_and_shows_where_each_rank_was(no_leftovers):
    def half_hang(rank, world_size):
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        else:
            time.sleep(600)

    start = time.monotonic()
    with pytest.raises(RunTimeoutError) as info:
        run(half_hang, 2, backend="gloo", timeout=3, show_output=False)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 3 + 8
    assert info.value.pending == [0, 1]
    assert "all_reduce" in info.value.outputs[0]  # rank 0's stack, dumped before it was killed
    assert "sleep" in info.value.outputs[1] or "half_hang" in info.value.outputs[1]


def test_a_rank_that_exits_while_a_peer_waits_gives_a_hint(no_leftovers):
    with pytest.raises(RankError) as info:
        run(lambda r, w: dist.all_reduce(torch.ones(1)) if r == 0 else None, 2, backend="gloo", timeout=20,
            show_output=False)
    assert info.value.rank == 0
    assert "Every rank must call the same collectives" in str(info.value)


@pytest.mark.parametrize("world_size, error", [(0, ValueError), (-2, ValueError), ("2", TypeError),
                                               (True, TypeError), (2.0, TypeError)])
def test_bad_world_size_fails_at_once(world_size, error):
    with pytest.raises(error, match="world_size"):
        run(lambda r, w: None, world_size)


def test_other_bad_arguments_fail_at_once():
    with pytest.raises(TypeError, match="needs a function"):
        run("not a function", 2)
    with pytest.raises(ValueError, match="timeout"):
        run(lambda r, w: None, 2, timeout=0)
    with pytest.raises(ValueError, match="unknown backend"):
        run(lambda r, w: None, 2, backend="ucc")
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be sent to the ranks"):
        run(lambda r, w, lk: None, 2, lock)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_nccl_without_gpus_says_use_gloo():
    with pytest.raises(ValueError, match=r"has none: use the gloo backend \(backend='gloo'"):
        run(lambda r, w: None, 1, backend="nccl")


def test_nccl_with_more_ranks_than_gpus_says_use_gloo(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_count", lambda: 1)
    monkeypatch.setattr(hardware, "backends", lambda: {"gloo": True, "nccl": True, "mpi": False})
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"use the gloo backend \(backend='gloo'.*\) to run several ranks on one GPU"):
        run(lambda r, w: None, 2, backend="nccl")
    assert time.monotonic() - start < 1
    assert hardware.check_backend(None, 2) == "gloo"
    assert hardware.check_backend(None, 1) == "nccl"


def test_an_unpicklable_return_value_is_explained(no_leftovers):
    with pytest.raises(RankError, match="cannot be sent back to the notebook"):
        run(lambda r, w: threading.Lock(), 2, show_output=False)


def test_cpu_threads_are_shared_between_ranks():
    def threads(rank, world_size):
        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]
    n = hardware.cpu_count()
    for ws in (1, 2, 4):
        expected = max(1, n // ws)
        assert run(threads, ws, show_output=False) == [(expected, str(expected))] * ws
    assert run(threads, 2, threads=3, show_output=False) == [(3, "3")] * 2


def test_environment_is_the_callers_at_call_time(monkeypatch):
    monkeypatch.setenv("COURSE_TEST_VALUE", "changed after the forkserver started")

    def env(rank, world_size):
        keys = ("COURSE_TEST_VALUE", "EXTRA", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")
        return {k: os.environ.get(k) for k in keys}
    out = run(env, 2, env={"EXTRA": 7}, show_output=False)
    assert out[1] == {"COURSE_TEST_VALUE": "changed after the forkserver started", "EXTRA": "7",
                      "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}


def test_init_false_lets_the_ranks_rendezvous_themselves_with_env():
    def own_init(rank, world_size):
        assert not dist.is_initialized()
        dist.init_process_group("gloo", init_method="env://")  # reads MASTER_ADDR/PORT, RANK, WORLD_SIZE
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()
    assert run(own_init, 3, init=False, show_output=False) == [6.0] * 3


def test_parallel_runs_never_collide_on_a_port(no_leftovers):
    def total(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: run(total, 2, backend="gloo", show_output=False), range(8)))
    assert outs == [[2.0, 2.0]] * 8


def _start_waiting_run(pids_file):
    """A 'kernel' (a Python process) that runs 2 ranks which record their pids and wait."""
    script = textwrap.dedent(f"""
        import os, signal, time
        # a Jupyter kernel handles SIGINT (its stop button) even when it inherited SIGINT ignored, as a command
        # started with & from a script does (a shell without job control); Python would then ignore it too
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from course_lib.launch import run
        def wait_forever(rank, world_size):
            with open({str(pids_file)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(600)
        run(wait_forever, 2, timeout=600)
    """)
    kernel = subprocess.Popen([sys.executable, "-c", script], env=env_with_path(),
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pids_file.exists() or len(pids_file.read_text().split()) < 2):
        if kernel.poll() is not None:
            raise AssertionError(f"the kernel script ended early:\n{kernel.stderr.read()}")
        time.sleep(0.1)
    rank_pids = {int(p) for p in pids_file.read_text().split()}
    assert len(rank_pids) == 2
    return kernel, rank_pids


def test_interrupting_the_cell_stops_every_rank(tmp_path):
    """Jupyter's stop button sends SIGINT to the kernel: run() must kill its ranks on the way out."""
    kernel, rank_pids = _start_waiting_run(tmp_path / "pids")
    kernel.send_signal(signal.SIGINT)
    _, err = kernel.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert wait_gone(rank_pids, within=10) == set()


def test_ranks_die_with_the_kernel(tmp_path):
    """A kernel killed with SIGKILL cannot clean up: the ranks must notice and exit by themselves."""
    kernel, rank_pids = _start_waiting_run(tmp_path / "pids")
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    assert wait_gone(rank_pids, within=10) == set()


def test_a_script_without_a_main_guard_is_not_rerun_in_the_ranks(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from course_lib.launch import run\nprint('top level ran')\n"
                      "print(run(lambda r, w: r + 1, 2, show_output=False))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=env_with_path())
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["top level ran", "[1, 2]"]


def test_free_port_is_bindable():
    import socket
    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.gpu
def test_gloo_ranks_share_one_gpu_with_cuda_tensors():
    def on_gpu(rank, world_size):
        device = hardware.device_for_rank(rank, "gloo")
        t = torch.ones(4, device=device) * (rank + 1)
        dist.all_reduce(t)
        return str(t.device), t.sum().item()
    out = run(on_gpu, 2, backend="gloo", show_output=False)
    assert [o[1] for o in out] == [12.0, 12.0] and all(o[0].startswith("cuda") for o in out)


@pytest.mark.gpu
def test_nccl_one_rank_per_gpu():
    def on_gpu(rank, world_size):
        t = torch.ones(4, device=hardware.device_for_rank(rank, "nccl")) * (rank + 1)
        dist.all_reduce(t)
        return dist.get_backend(), t.sum().item()
    n = hardware.gpu_count()
    out = run(on_gpu, n, show_output=False)
    assert out == [("nccl", 4.0 * n * (n + 1) / 2)] * n


def test_debug_detail_set_per_run_names_the_mismatch(no_leftovers):
    """TORCH_DISTRIBUTED_DEBUG is honoured although the forkserver imported torch before it was set."""
    def mismatched(rank, world_size):
        dist.all_reduce(torch.ones(2 + rank))  # rank 0: 2 elements, rank 1: 3
    with pytest.raises(RankError, match="Detected mismatch between collectives"):
        run(mismatched, 2, backend="gloo", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=30, show_output=False)


def test_the_root_cause_is_reported_not_the_peers_that_lost_it(no_leftovers):
    def one_fails(rank, world_size):
        if rank == 2:
            time.sleep(0.2)
            raise KeyError("the real problem")
        dist.all_reduce(torch.ones(1))  # ranks 0 and 1 then lose their peer
    with pytest.raises(RankError) as info:
        run(one_fails, 3, backend="gloo", timeout=30, show_output=False)
    assert info.value.rank == 2 and "the real problem" in str(info.value)


def test_two_ranks_failing_at_once_do_not_wait_for_the_full_timeout(no_leftovers):
    def two_fail_one_hangs(rank, world_size):
        if rank < 2:
            raise ValueError(f"rank {rank} fails")
        time.sleep(600)
    start = time.monotonic()
    with pytest.raises(RankError):
        run(two_fail_one_hangs, 3, backend="gloo", timeout=120, show_output=False)
    assert time.monotonic() - start < 10


def test_the_process_groups_timeout_is_separate_from_the_runs_deadline(no_leftovers):
    def wait_in_recv(rank, world_size):
        if rank == 0:
            dist.recv(torch.zeros(1), src=1)     # rank 1 never sends...
        else:
            time.sleep(60)                       # ...it is busy elsewhere

    with pytest.raises(RunTimeoutError):         # default: the run's deadline comes first, with every rank's stack
        run(wait_in_recv, 2, backend="gloo", timeout=3, show_output=False)
    with pytest.raises(RankError, match="[Tt]imed out"):   # a shorter process-group timeout: the backend's own error
        run(wait_in_recv, 2, backend="gloo", timeout=60, pg_timeout=2, show_output=False)
    with pytest.raises(ValueError, match="pg_timeout"):
        run(wait_in_recv, 2, pg_timeout=0)
