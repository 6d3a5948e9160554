"""torch.distributed.pipelining on Gloo ranks: its gradients equal the from-scratch schedule's and the unsplit model's
(with torch's 1/m gradient scaling stated exactly), it runs the ops in the orders the course teaches, and its
timeline is complete; the zero-bubble schedules (ZBV, DualPipeV) give the unsplit model's gradients and their plans
idle (p-1)/(6m+p-1)."""
import pytest
import torch
import torch.nn.functional as F

from course_lib import pipeline_parallel as P
from course_lib.launch import run
from course_lib.pipeline_parallel import zero_bubble as Z
from course_lib.pipeline_parallel.torch_pipelining import stage_indices, torch_pipeline_step, torch_pipeline_worker

WIDTH, LAYERS, BATCH, M = 16, 2, 16, 4


def unsplit_grads(stages, batch=BATCH):
    full = P.make_full_model(stages, WIDTH, LAYERS)
    x, y = P.make_batch(batch, WIDTH)
    loss = F.mse_loss(full(x), y)
    loss.backward()
    return [p.grad for p in full.parameters()], loss.item()


def in_stage_order(results):
    """The gradients of every stage, in stage order, from the ranks' ``{stage: grads}``."""
    by_stage = {s: g for r in results for s, g in r["grads"].items()}
    return [g for s in sorted(by_stage) for g in by_stage[s]]


def assert_all_close(got, expected, scale=1.0):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e * scale, atol=1e-6, rtol=1e-5)


def test_two_ranks_gpipe_1f1b_and_interleaved_equal_the_from_scratch_schedule():
    configs = [dict(schedule="gpipe", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS),
               dict(schedule="1f1b", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS),
               dict(schedule="1f1b", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS,
                    scale_grads=False),
               dict(schedule="interleaved", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS,
                    stages_per_rank=2)]
    res = run(torch_pipeline_worker, 2, *configs, backend="gloo", show_output=False, timeout=120)
    gpipe, one_f_one_b, unscaled, interleaved = ([r[k] for r in res] for k in range(len(configs)))
    for kind, torch_run in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        scratch = run(P.pipeline_worker, 2, kind, M, BATCH, WIDTH, LAYERS, backend="gloo", show_output=False)
        assert_all_close(in_stage_order(torch_run), [g for r in scratch for g in r["grads"]])
    # scale_grads=False: torch sums the micro-batches' mean losses' gradients, m times the batch mean's
    assert_all_close(in_stage_order(unscaled), in_stage_order(one_f_one_b), scale=M)
    # interleaved: 2 ranks x 2 stages = the 4-stage model, equal to the from-scratch pipeline on 4 ranks
    scratch4 = run(P.pipeline_worker, 4, "1f1b", M, BATCH, WIDTH, LAYERS, backend="gloo", show_output=False)
    assert_all_close(in_stage_order(interleaved), [g for r in scratch4 for g in r["grads"]])
    grads, loss = unsplit_grads(4)
    assert_all_close(in_stage_order(interleaved), grads)
    losses = interleaved[1]["losses"]          # on the rank of the last stage: one mean loss per micro-batch
    assert len(losses) == M and sum(losses) / M == pytest.approx(loss, rel=1e-5)
    assert interleaved[0]["losses"] == []


def test_torch_runs_the_orders_the_course_teaches_and_times_every_op():
    configs = [dict(schedule=kind, micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS)
               for kind in ("gpipe", "1f1b")]
    configs.append(dict(schedule="interleaved", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS,
                        stages_per_rank=2))
    res = run(torch_pipeline_worker, 2, *configs, backend="gloo", show_output=False, timeout=120)
    ran = [[(op, i) for op, i, *_ in r[1]["timeline"]] for r in res]
    assert ran == P.schedule("1f1b", 2, M)                                    # Schedule1F1B is the course's 1F1B
    forwards, backwards = [("F", i) for i in range(M)], [("B", i) for i in range(M)]
    assert all([(op, i) for op, i, *_ in r[0]["timeline"]] == forwards + backwards for r in res)  # GPipe: B0 first
    for rank, r in enumerate(res):
        for k, config in enumerate(configs):
            timeline = r[k]["timeline"]
            stages = stage_indices(rank, 2, config.get("stages_per_rank", 1))
            assert sorted((op, i, s) for op, i, s, *_ in timeline) == sorted(
                (op, i, s) for op in "FB" for i in range(M) for s in stages)
            assert all(0 <= a < b and 0 < cpu <= (b - a) * 1.05 + 1e-3 for *_, cpu, a, b in timeline)
            assert all(x[5] <= y[4] + 1e-9 for x, y in zip(timeline, timeline[1:]))  # one op at a time per rank
    assert stage_indices(1, 2, 2) == [1, 3]
    # the orders torch ran, played with equal forwards and equal backwards: idle / compute is (p-1)/(v m) exactly
    for k, chunks in ((0, 1), (1, 1), (2, 2)):
        ranks = [[(op, i, s, 1.0 if op == "F" else 2.0) for op, i, s, *_ in r[k]["timeline"]] for r in res]
        b = P.play(ranks, 2 * chunks)["bubble"]
        assert b / (1 - b) == pytest.approx(P.bubble_overhead(2, M, chunks), abs=1e-12)
    assert P.replayed([r[2] for r in res])["makespan"] > 0                  # the same, with the measured CPU times


def test_four_ranks_1f1b_and_interleaved_equal_the_unsplit_model():
    configs = [dict(schedule="1f1b", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS),
               dict(schedule="interleaved", micro_batches=M, batch=BATCH, width=WIDTH, layers_per_stage=LAYERS,
                    stages_per_rank=2)]
    res = run(torch_pipeline_worker, 4, *configs, backend="gloo", show_output=False, timeout=180)
    assert_all_close(in_stage_order([r[0] for r in res]), unsplit_grads(4)[0])
    assert_all_close(in_stage_order([r[1] for r in res]), unsplit_grads(8)[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="zero-bubble"), "unknown schedule"),
    (dict(schedule="1f1b", stages_per_rank=2), "needs 'interleaved'"),
    (dict(schedule="gpipe", batch=10, micro_batches=4), "does not divide into 4 equal micro-batches"),
])
def test_bad_arguments_are_refused_before_any_communication(kwargs, message):
    with pytest.raises(ValueError, match=message):
        torch_pipeline_step(0, 2, **kwargs)


# ---------------------------------------------------------------------------------- zero bubble: ZBV and DualPipeV
def _v_configs(m, width=WIDTH):
    return [dict(schedule=k, micro_batches=m, batch=4 * m, width=width, layers_per_stage=LAYERS) for k in Z.SCHEDULES]


@pytest.mark.parametrize("ranks, m", [(2, 4), (3, 6)])
def test_zero_bubble_schedules_equal_the_unsplit_model_and_their_plans_idle_p_minus_1_units(ranks, m):
    if Z.missing():
        pytest.skip(f"torch {torch.__version__} has no {Z.missing()}: the zero-bubble schedules need torch 2.13")
    res = run(Z.v_pipeline_worker, ranks, *_v_configs(m), backend="gloo", show_output=False, timeout=180)
    full = P.make_full_model(2 * ranks, WIDTH, LAYERS)
    x, y = P.make_batch(4 * m, WIDTH)
    F.mse_loss(full(x), y).backward()
    for k in range(len(Z.SCHEDULES)):
        assert sorted(s for r in res for s in r[k]["grads"]) == list(range(2 * ranks))     # a V: r and 2p-1-r
        assert_all_close(in_stage_order([r[k] for r in res]), [p.grad for p in full.parameters()])
        plan = res[0][k]["plan"]
        assert all(r[k]["plan"] == plan for r in res)                      # every rank holds the whole plan
        ran = [op for rank_ops in plan for op in rank_ops]
        for i in range(m):
            for s in range(2 * ranks):      # one forward; a split backward (I, W) or a whole one (B)
                assert ran.count(("F", i, s)) == 1
                assert [ran.count((op, i, s)) for op in "IWB"] in ([1, 1, 0], [0, 0, 1])
        split, fused = Z.play_actions(plan)["bubble"], Z.play_actions(Z.fuse_backward(plan))["bubble"]
        assert split == pytest.approx((ranks - 1) / (6 * m + ranks - 1), abs=1e-12)
        assert split < fused < P.bubble_formula(ranks, m)
        assert 0 < res[0][k]["alone"] and 0 < res[0][k]["step"]


def test_play_actions_follows_the_dependencies_and_names_a_deadlock():
    one_rank = [[("F", 0, 0), ("F", 0, 1), ("I", 0, 1), ("W", 0, 1), ("I", 0, 0), ("W", 0, 0)]]
    played = Z.play_actions(one_rank)
    assert played["makespan"] == 6 and played["bubble"] == 0
    assert Z.fuse_backward(one_rank) == [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]]
    assert Z.play_actions(Z.fuse_backward(one_rank))["makespan"] == 6
    with pytest.raises(RuntimeError, match="deadlocks: rank 0 waits before I0 of stage 0"):
        Z.play_actions([[("F", 0, 0), ("I", 0, 0)], [("I", 0, 1), ("F", 0, 1)]])
    assert Z.v_stages(0, 2) == [0, 3] and Z.v_stages(1, 2) == [1, 2]


@pytest.mark.parametrize("kwargs, message", [(dict(schedule="zb-h1"), "unknown schedule"),
                                             (dict(batch=10, micro_batches=4), "does not divide")])
def test_v_pipeline_step_refuses_bad_arguments_before_any_communication(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Z.v_pipeline_step(0, 2, **kwargs)


def test_actions_reads_ops_by_name_whatever_the_enum_values_are():
    """torch 2.13's _ComputationType values are the letters; older versions numbered them: read the names."""
    import enum
    from types import SimpleNamespace

    Kind = enum.Enum("Kind", ["FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD"])   # values 1..4

    def act(kind, i, s):
        return SimpleNamespace(computation_type=Kind[kind], microbatch_index=i, stage_index=s, sub_actions=None)
    order = {0: [act("FORWARD", 0, 0), None, act("BACKWARD_INPUT", 0, 0), act("BACKWARD_WEIGHT", 0, 0)],
             1: [act("FULL_BACKWARD", 1, 1)]}
    assert Z.actions(order) == [[("F", 0, 0), ("I", 0, 0), ("W", 0, 0)], [("B", 1, 1)]]
