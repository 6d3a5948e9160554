"""Broken on purpose: every hang ends as a clear error in time, with no process left; kills never corrupt
an atomic checkpoint; the pitfall demos show what they claim."""
import socket

import pytest

from course_lib import checkpoint, faults
from course_lib.launch import RankError, RunTimeoutError, run


def ends_with(error, fn, world_size, within, **kwargs):
    e = faults.expect_failure(fn, world_size, error, within, quiet=True, **kwargs)
    assert len(faults.pids_in(e.outputs)) == world_size  # every rank announced itself
    return e


def test_expect_failure_refuses_a_worker_that_does_not_fail_or_is_too_slow():
    with pytest.raises(AssertionError, match="did not fail"):
        faults.expect_failure(lambda rank, world_size: None, 2, quiet=True)
    with pytest.raises(AssertionError, match="promised under 0.01 s"):
        faults.expect_failure(faults.mismatched_shapes, 2, RankError, within=0.01, quiet=True)


def test_partial_collective_times_out_with_the_process_group_timeout(no_leftovers):
    e = ends_with(RankError, faults.only_rank_0_reduces, 2, within=3 + 10, timeout=60)
    assert e.rank == 0 and "Timed out" in str(e)


def test_monitored_barrier_names_the_missing_rank(no_leftovers):
    e = ends_with(RankError, faults.one_rank_never_arrives, 3, within=2 + 10, timeout=60)
    assert "Ranks 2 failed to pass monitoredBarrier" in str(e)


def test_debug_detail_names_the_mismatch_and_plain_mode_still_fails(no_leftovers):
    ends_with(RankError, faults.mismatched_shapes, 2, within=15, timeout=60)
    e = ends_with(RankError, faults.mismatched_shapes, 2, within=15, timeout=60,
                  env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "Detected mismatch between collectives" in str(e) and "TensorShape=[3]" in str(e)


def test_launcher_timeout_shows_each_ranks_stack(no_leftovers):
    e = ends_with(RunTimeoutError, faults.silent_hang, 2, within=3 + 10, timeout=3)
    assert "all_reduce" in e.outputs[0] and "silent_hang" in e.outputs[1]


def test_port_in_use_fails_fast_and_says_so(no_leftovers):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        e = ends_with(RankError, lambda r, w: faults.port_in_use_worker(r, w, port), 2, within=25, init=False,
                      timeout=60)
    assert e.rank == 0 and "address already in use" in str(e).lower()


def test_kills_during_saves_never_corrupt_an_atomic_checkpoint(tmp_path):
    path = tmp_path / "atomic.pt"
    results = faults.kill_during_saves(str(path), atomic=True, kills=12, mib=32, seed=7)
    assert all(r["loadable"] for r in results), results
    # the last complete checkpoint: the one before the interrupted save, or that save itself when a loaded
    # machine delivered the kill only after it had finished (seen once with other jobs on both cores)
    assert all(r["step"] in (r["killed_while_saving"] - 1, r["killed_while_saving"]) for r in results), results
    assert sum(r["step"] == r["killed_while_saving"] - 1 for r in results) >= len(results) // 2, results
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "atomic.pt"]
    assert len(leftovers) <= 1                      # at most the last killed writer's temporary file...
    checkpoint.save_atomic({"step": 99}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["atomic.pt"]  # ...which the next save removes


def test_kills_during_in_place_saves_do_corrupt(tmp_path):
    results = faults.kill_during_saves(str(tmp_path / "in_place.pt"), atomic=False, kills=3, mib=32, seed=3)
    assert any(not r["loadable"] for r in results), results
    # a loadable file means the kill missed the write on a busy machine: it came before the write began (the previous
    # step survives; seen once in 48 kills with one core busy) or after it ended (the step being saved)
    assert all(not r["loadable"] or r["step"] in (r["killed_while_saving"] - 1, r["killed_while_saving"])
               for r in results), results


def test_weights_only_refuses_a_pickle_that_runs_code(tmp_path, capsys):
    import torch
    path = tmp_path / "x.pt"
    torch.save({"x": faults.RunsCodeWhenLoaded()}, path)
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        checkpoint.load(path)
    assert "this ran" not in capsys.readouterr().out


def test_pitfall_demos_show_what_they_claim():
    seeds = run(faults.seeds_worker, 3, backend="gloo", show_output=False)
    distinct = lambda key: len({str(s[key]) for s in seeds})  # noqa: E731
    assert distinct("noise_same_seed") == 1 and distinct("noise_seed_plus_rank") == 3
    assert distinct("init_before_ddp") == 3 and distinct("init_after_ddp") == 1
    assert all(s["init_after_ddp"] == seeds[0]["init_before_ddp"] for s in seeds)
    losses = run(faults.loss_logging_worker, 4, backend="gloo", show_output=False)
    mean = sum(loss["local"] for loss in losses) / 4
    assert all(abs(loss["mean"] - mean) < 1e-6 for loss in losses) and len({loss["local"] for loss in losses}) == 4
    assert all(t["wall"] > 0 and t["cpu"] > 0 for t in run(faults.matmul_worker, 2, 64, 5, backend="gloo",
                                                             show_output=False))



def loader_seeds(rank, fix):
    """Notebook 08's exercise 4, its solution as the notebook shows it (a call plays one rank, seeded as it would be:
    the ranks of ``run`` are daemonic processes, which cannot start DataLoader workers)."""
    import torch
    torch.manual_seed(0)                                   # every rank seeded alike, as for the model
    generator = torch.Generator().manual_seed(0 + rank) if fix else None
    return faults.dataloader_worker_seeds(generator)


def test_dataloader_workers_share_their_seeds_across_ranks_seeded_alike_unless_given_a_generator():
    same = [loader_seeds(r, False) for r in (0, 1)]
    fixed = [loader_seeds(r, True) for r in (0, 1)]
    assert same[0] == same[1] and len(set(same[0])) == 2            # workers differ, ranks do not
    assert not set(fixed[0]) & set(fixed[1])                        # with seed + rank: nothing shared
