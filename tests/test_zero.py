"""ZeRO from scratch (course_lib.zero): every stage equals one process on the global batch, on real Gloo ranks.

Also: FSDP2 equals the from-scratch ZeRO-3, and a check with SGD catches it summing instead of averaging; FSDP2's
collectives with and without reshard_after_forward, and in mixed precision; DCP (model and optimizer) saved on 4 ranks
loads on 2; the bytes each rank keeps match the arithmetic, DDP's buckets included; ZeRO-3 holds one layer's whole
parameters at a time; the traffic of a step, with gradient accumulation too; bad input.
"""
import dataclasses
import functools
import importlib.util
import os
import time

import pytest
import torch
import torch.nn as nn

from course_lib import memory
from course_lib.launch import RankError, run
from course_lib.viz import sharding
from course_lib.zero import ShardedOptimizer, finish_gradient_synchronization, flat, fsdp2, fully_shard, measure, shard
from course_lib.zero import training as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every model with both optimizers and every strategy; torch DDP and FSDP2 on the MLP (FSDP2 wants a tied
# weight in one unit with both its users, which a unit per layer is not)
MATRIX = [(m, o, s) for m in ("mlp", "tiny_lm", "twice") for o in ("adamw", "sgd")
          for s in [1, 2, 3, "sharded_optimizer"] + (["ddp", "fsdp2"] if m == "mlp" else [])]


def matrix_worker(rank, world_size):
    return [T.train_worker(rank, world_size, s, m, o) for m, o, s in MATRIX]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_equals_one_process_on_the_global_batch(world_size, no_leftovers):
    """AdamW with weight decay and SGD with momentum; sizes no world size divides; tied weights, a frozen
    parameter and a buffer (tiny_lm); a layer used twice (twice); ShardedOptimizer with DDP; FSDP2."""
    results = run(matrix_worker, world_size, backend="gloo", show_output=False, timeout=300)
    for k, (model, optimizer, strategy) in enumerate(MATRIX):
        reference = T.train_reference(world_size, model, optimizer)
        for rank, states in enumerate(results):
            gap = T.max_difference(states[k], reference)
            assert gap < 1e-5, (model, optimizer, strategy, rank, gap)
    tiny = results[0][MATRIX.index(("tiny_lm", "adamw", 3))]
    assert tiny["head.weight"] is tiny["embed.weight"]                    # still tied in the full state dict
    assert torch.equal(tiny["scale"], T.build("tiny_lm").scale)           # frozen: never moved


def test_the_baseline_really_trains_and_the_strategies_differ_from_no_averaging():
    """The equalities above mean something: three steps move the weights, and a wrong gradient scale shows."""
    start = T.build("mlp").state_dict()
    trained = T.train_reference(2, "mlp", "sgd")
    assert T.max_difference(start, trained) > 1e-2


def test_gradient_accumulation_over_two_backward_passes(no_leftovers):
    def worker(rank, world_size):
        return [T.train_worker(rank, world_size, s, "tiny_lm", "sgd", micro_batches=2) for s in (1, 2, 3)]
    reference = T.train_reference(2, "tiny_lm", "sgd")
    for states in run(worker, 2, backend="gloo", show_output=False):
        assert all(T.max_difference(s, reference) < 1e-5 for s in states)


def test_fully_shard_in_fp16_casts_like_one_process_that_casts_the_same_way(no_leftovers):
    """One rank: bit for bit equal to the one-process fp16 reference. More ranks: each rank rounds the gradient
    of its own batch to fp16 where one process rounds one gradient of the whole batch, so they agree to fp16's
    precision (measured: up to 1.3e-4 after three steps), not to fp32's."""
    for model in ("mlp", "tiny_lm"):
        reference = T.train_reference(1, model, "adamw", compute_dtype=torch.float16)
        one = run(T.train_worker, 1, "fully_shard", model, "adamw", 3, 4, torch.float16, backend="gloo",
                  show_output=False)[0]
        assert T.max_difference(one, reference) == 0.0
        assert T.max_difference(reference, T.train_reference(1, model, "adamw")) > 1e-5   # fp16 really differs
        reference = T.train_reference(2, model, "adamw", compute_dtype=torch.float16)
        for state in run(T.train_worker, 2, "fully_shard", model, "adamw", 3, 4, torch.float16, backend="gloo",
                         show_output=False):
            assert T.max_difference(state, reference) < 5e-4


def test_fp16_layers_compute_in_fp16_while_shards_grads_and_states_stay_fp32(no_leftovers):
    def worker(rank, world_size):
        model = fully_shard(T.build("tiny_lm"), compute_dtype=torch.float16)
        seen = set()
        model.block[0].register_forward_pre_hook(lambda m, args: seen.add((m.weight.dtype, args[0].dtype)))
        opt = torch.optim.AdamW(model.parameters())
        x, y = T.batches("tiny_lm", 4, 1)[0]
        T.loss_fn("tiny_lm", model(x), y).backward()
        opt.step()
        tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
        tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
        return seen, {t.dtype for t in tensors}
    for seen, dtypes in run(worker, 2, backend="gloo", show_output=False):
        assert seen == {(torch.float16, torch.float16)} and dtypes == {torch.float32}


def test_bytes_held_match_the_arithmetic_and_zero3_holds_one_layer_at_a_time(no_leftovers):
    for n in (2, 4):
        width, depth = 64, 4
        params = depth * (width * width + width)
        for rank_result in run(measure.memory_worker, n, measure.STRATEGIES, width, depth, backend="gloo",
                               show_output=False):
            for stage in measure.STRATEGIES:
                expected = memory.training_memory(params, "fp32", "adam", zero_stage=0 if stage == "ddp" else stage,
                                                  world_size=n)
                got = rank_result[stage]
                assert got == {"parameters": expected["weights"], "gradients": expected["gradients"],
                               "optimizer states": expected["optimizer states"]}, (n, stage, got)
            peak = rank_result["stage 3 peak"]
            assert peak["peak gathered"] == peak["largest layer"] == (width * width + width) * 4
            assert peak["gathered after the step"] == 0
            if n == 4:
                ddp = rank_result["ddp"]["optimizer states"]
                assert all(rank_result[stage]["optimizer states"] <= 0.26 * ddp for stage in (1, 2, 3))


def test_a_frozen_layer_in_the_middle_is_freed_after_its_backward(no_leftovers):
    """Like LoRA's frozen base layers: no gradient of its own, yet still one layer gathered at a time."""
    for held in run(measure.memory_worker, 2, (3,), 32, 4, (1, 2), backend="gloo", show_output=False):
        peak = held["stage 3 peak"]
        assert peak["peak gathered"] == peak["largest layer"] and peak["gathered after the step"] == 0
        assert held[3]["gradients"] == 2 * (32 * 32 + 32) * 4 // 2          # two trainable layers, half each


def test_no_grad_forward_gathers_and_frees_and_training_goes_on(no_leftovers):
    def worker(rank, world_size):
        model = fully_shard(T.build("mlp"))
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
        model.eval()
        with torch.no_grad():
            out = model(x)
        left = model.zero3.gathered_bytes
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            finish_gradient_synchronization(model)          # a no-op after backward, and harmless
            opt.step()
        return out, left, model.zero3.gathered_bytes
    expected = T.build("mlp")(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)))
    for out, left, after in run(worker, 2, backend="gloo", show_output=False):
        assert left == after == 0 and torch.allclose(out, expected, atol=1e-6)


def test_sharded_optimizer_with_groups_and_a_scheduler_equals_the_plain_optimizer(no_leftovers):
    def worker(rank, world_size):
        from torch.nn.parallel import DistributedDataParallel as DDP
        out = []
        for sharded in (False, True):
            model = T.build("mlp")
            ddp = DDP(model)
            decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
            opt = (ShardedOptimizer(groups, torch.optim.AdamW, lr=0.01) if sharded
                   else torch.optim.AdamW(groups, lr=0.01))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            for x, y in T.batches("mlp", 4 * world_size, 3):
                opt.zero_grad()
                T.loss_fn("mlp", ddp(x[rank::world_size]), y[rank::world_size]).backward()
                opt.step()
                sched.step()
            out.append({k: v.clone() for k, v in model.state_dict().items()})
        return out
    for plain, sharded in run(worker, 3, backend="gloo", show_output=False):
        assert T.max_difference(plain, sharded) < 1e-6


def test_dcp_saved_on_4_ranks_loads_on_2_with_the_same_weights_and_optimizer_state(tmp_path, no_leftovers):
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "checkpoint")
    model_fn = functools.partial(measure.deep_mlp, 32, 2)
    saved = run(fsdp2.dcp_save_worker, 4, path, model_fn, backend="gloo", show_output=False)
    assert sorted(os.listdir(path)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert all(T.max_difference(s["weights"], saved[0]["weights"]) == 0 for s in saved)
    assert all(fsdp2.optimizer_state_difference(s["optimizer"], saved[0]["optimizer"]) == 0 for s in saved)
    state = saved[0]["optimizer"]["state"]["0.weight"]
    assert state["exp_avg"].shape == (32, 32) and state["exp_avg"].abs().max() > 0 and state["step"] == 2
    loaded = run(fsdp2.dcp_load_worker, 2, path, model_fn, backend="gloo", show_output=False)
    fresh = {k: v for k, v in model_fn(seed=123).state_dict().items()}
    for result in loaded:
        assert T.max_difference(result["weights"], saved[0]["weights"]) == 0.0
        assert T.max_difference(result["weights"], fresh) > 1e-3            # it did load something
        assert result["shapes"]["0.weight"] == ((32, 32), (16, 32))          # resharded: half of the rows each
        assert fsdp2.optimizer_state_difference(result["optimizer"], saved[0]["optimizer"]) == 0.0
        assert result["optimizer"]["param_groups"][0]["lr"] == 0.01          # not the fresh optimizer's 0.5
    # .metadata is DCP's own pickle, read by its reader (torch.load refuses it): where each rank's rows are
    metadata = dcp.FileSystemReader(path).read_metadata()
    chunks = metadata.state_dict_metadata["model.0.weight"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(8 * r, 0) for r in range(4)]
    with pytest.raises(Exception, match="magic number"):
        torch.load(os.path.join(path, ".metadata"), weights_only=False)


def test_optimizer_state_difference_sees_a_changed_state_or_learning_rate():
    state = {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}
    other = {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.full((3,), 1.5)}},
             "param_groups": [{"lr": 0.1}]}
    assert fsdp2.optimizer_state_difference(state, state) == 0.0
    assert fsdp2.optimizer_state_difference(state, other) == 0.5
    assert fsdp2.optimizer_state_difference(state, {**state, "param_groups": [{"lr": 0.2}]}) == float("inf")


def fsdp2_worker(rank, world_size):
    model_fn = functools.partial(measure.deep_mlp, 64, 4)
    reshard = {flag: fsdp2.reshard_worker(rank, world_size, model_fn, flag) for flag in (True, False)}
    mixed = {dtype: fsdp2.mixed_precision_worker(rank, world_size, model_fn, dtype) for dtype in (None, torch.float32)}
    units = fsdp2.fsdp_units(fsdp2.apply_fsdp2(model_fn()))
    forced = [g.force_sum_reduction_for_comms for u in units for g in u._get_fsdp_state()._fsdp_param_groups]
    trained = {(s, o): T.train_worker(rank, world_size, s, "mlp", o) for s in ("fsdp2", "fsdp2_summed")
               for o in ("sgd", "adamw")}
    return reshard, mixed, (len(units), forced), trained


def test_fsdp2_collectives_memory_mixed_precision_and_a_check_that_catches_summed_gradients(no_leftovers):
    """reshard_after_forward=True: 4 all-gathers in forward, 4 more in backward, 4 reduce-scatters on 4 layers;
    False: no all-gather in backward, the whole weights kept in between; both free everything after backward.
    reduce_dtype=None reduce-scatters bf16 (half the bytes of float32). The Gloo workaround reaches every unit.
    FSDP2 summing the gradients (pytorch#162338's effect) is far off one process with SGD, close with AdamW."""
    params = 4 * (64 * 64 + 64)
    for reshard, mixed, (n_units, forced), trained in run(fsdp2_worker, 2, backend="gloo", show_output=False):
        counted = ("forward all-gathers", "backward all-gathers", "reduce-scatters")
        assert [reshard[True][k] for k in counted] == [4, 4, 4]
        assert [reshard[False][k] for k in counted] == [4, 0, 4]
        assert reshard[True]["after forward"] == 0 and reshard[False]["after forward"] == params * 4
        assert reshard[True]["after backward"] == reshard[False]["after backward"] == 0
        assert reshard[True]["reduce-scatter bytes"] == params * 4
        assert mixed[None]["reduce-scatter bytes"] == params * 2
        assert mixed[torch.float32]["reduce-scatter bytes"] == params * 4
        assert all(m["compute"] == torch.bfloat16 and m["gradients"] == torch.float32 for m in mixed.values())
        assert n_units == 5 and forced == [True] * 4          # 4 layers with a param group each, and the empty root
        for o in ("sgd", "adamw"):
            assert T.max_difference(trained["fsdp2", o], T.train_reference(2, "mlp", o)) < 1e-5
        summed = {o: T.max_difference(trained["fsdp2_summed", o], T.train_reference(2, "mlp", o))
                  for o in ("sgd", "adamw")}
        assert summed["sgd"] > 1e-2 and summed["adamw"] < summed["sgd"] / 100


def test_the_2d_mesh_of_notebook_12_sums_on_gloo_in_every_fsdp2_unit(no_leftovers):
    from course_lib.models.transformer import LMTrainConfig
    from course_lib.tensor_parallel.training import build

    def worker(rank, world_size):
        model = build(LMTrainConfig(), "2d", world_size, tp=2)[0]
        units = fsdp2.fsdp_units(model)
        return len(units), [g.force_sum_reduction_for_comms for u in units
                            for g in u._get_fsdp_state()._fsdp_param_groups]
    for n_units, forced in run(worker, 2, backend="gloo", show_output=False):
        assert n_units > 1 and forced and all(forced)


def test_ddp_keeps_a_second_gradient_buffer_unless_gradients_are_views_of_its_buckets(no_leftovers):
    grads = 4 * (64 * 64 + 64) * 4
    for result in run(measure.ddp_bucket_worker, 2, 64, 4, backend="gloo", show_output=False):
        assert result[False] == {"bucket bytes": grads, "gradient bytes": grads, "gradients in the buckets": False}
        assert result[True] == {"bucket bytes": grads, "gradient bytes": grads, "gradients in the buckets": True}


def test_with_gradient_accumulation_zero2_and_zero3_reduce_scatter_every_micro_batch(no_leftovers):
    """ZeRO-1 reduce-scatters once a step, in step(); ZeRO-2 and 3 keep no whole gradients to accumulate into, so
    each backward reduce-scatters (and ZeRO-3 gathers again): two micro-batches, twice the reduce-scatters."""
    depth = 4
    logs = run(measure.traffic_worker, 2, (1, 2, 3), 32, depth, 2, backend="gloo", show_output=False)[0]
    reduce_scatters = {s: sum(op in ("all-reduce", "reduce-scatter") for op, _ in log) for s, log in logs.items()}
    all_gathers = {s: sum(op == "all-gather" for op, _ in log) for s, log in logs.items()}
    assert reduce_scatters == {1: depth, 2: 2 * depth, 3: 2 * depth}
    assert all_gathers == {1: depth, 2: depth, 3: 4 * depth}


def test_traffic_of_a_step_counts_like_a_ring(no_leftovers):
    n, width, depth = 4, 64, 4
    logs = run(measure.traffic_worker, n, (1, 2, 3), width, depth, backend="gloo", show_output=False)[0]
    params_bytes = depth * (width * width + width) * 4
    ddp = flat.ring_bytes_sent("all-reduce", params_bytes, n)
    for stage, log in logs.items():
        assert {op for op, _ in log} <= {"all-gather", "all-reduce"}     # Gloo: reduce-scatter done as all-reduce
        real = sum(flat.ring_bytes_sent("reduce-scatter" if op == "all-reduce" else op, b, n) for op, b in log)
        assert real == pytest.approx(ddp * (1.5 if stage == 3 else 1.0)), stage
        assert sum(op == "all-gather" for op, _ in log) == depth * (2 if stage == 3 else 1)


def test_stage_must_be_1_2_or_3_and_a_process_group_is_needed():
    for bad in (0, "3", 4, True, None):
        with pytest.raises(ValueError, match=repr(bad).replace("'", ".")):
            shard(nn.Linear(2, 2), bad, torch.optim.SGD, lr=0.1)
    for call in (lambda: shard(nn.Linear(2, 2), 1, torch.optim.SGD, lr=0.1),
                 lambda: fully_shard(nn.Linear(2, 2)),
                 lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)):
        with pytest.raises(RuntimeError, match="no(ne)? (process group )?is initialised"):
            call()


def test_bad_arguments_in_a_rank_are_clear_errors(no_leftovers):
    def worker(rank, world_size, what):
        model = T.build("mlp")
        if what == "twice":
            fully_shard(fully_shard(model))
        elif what == "class":
            ShardedOptimizer(model.parameters(), "adam")
        elif what == "dtype":
            fully_shard(model, compute_dtype=torch.int8)
    for what, phrase in (("twice", "sharded already"), ("class", "optimizer class"), ("dtype", "floating-point")):
        with pytest.raises(RankError, match=phrase):
            run(worker, 2, what, backend="gloo", show_output=False)


def test_shards_cover_every_element_once():
    for numel in (0, 1, 3, 7, 10, 64, 65):
        for n in (1, 2, 3, 4):
            covered = [i for r in range(n) for i in range(*flat.shard_bounds(numel, r, n))]
            assert covered == list(range(numel))


def test_memory_arithmetic_with_zero_stages():
    params = 7_000_000_000
    ddp = memory.training_memory(params, "bf16", "adam")
    assert memory.training_memory(params, "bf16", "adam", zero_stage=0, world_size=8) == ddp
    z1 = memory.training_memory(params, "bf16", "adam", zero_stage=1, world_size=8)
    z2 = memory.training_memory(params, "bf16", "adam", zero_stage=2, world_size=8)
    z3 = memory.training_memory(params, "bf16", "adam", zero_stage=3, world_size=8)
    assert z1["optimizer states"] == ddp["optimizer states"] / 8 and z1["gradients"] == ddp["gradients"]
    assert z1["fp32 master weights"] == ddp["fp32 master weights"] / 8
    assert z2["gradients"] == ddp["gradients"] / 8 and z2["weights"] == ddp["weights"]
    assert z3["total"] == ddp["total"] / 8                  # 16 bytes per parameter / 8 = 2 bytes
    assert not memory.fits(ddp, 80) and memory.fits(z1, 80)        # 7B with Adam: ZeRO-1 on 8 GPUs is enough
    big = [memory.training_memory(30_000_000_000, "bf16", "adam", zero_stage=s, world_size=8) for s in range(4)]
    assert [memory.fits(b, 80) for b in big] == [False, False, False, True]   # 30B: only ZeRO-3 fits
    for bad in ({"zero_stage": 4}, {"zero_stage": "1"}, {"world_size": 0}, {"world_size": 2.5}):
        with pytest.raises(ValueError):
            memory.training_memory(params, **bad)


def test_memory_calculator_has_a_zero_stage_and_a_world_size():
    from course_lib.viz.widgets import MemoryCalculator
    calc = MemoryCalculator(billions=7, dtype="bf16", optimizer="adam", device_gib=80)
    assert not calc.state["fits"]
    calc.world_size.value = 8
    assert not calc.state["fits"]                        # 8 GPUs without sharding: each holds everything
    calc.zero_stage.value = 3
    assert calc.state["breakdown"]["total"] == 7e9 * 16 / 8 and calc.state["fits"]
    calc.zero_stage.value = 1
    assert calc.state["breakdown"]["optimizer states"] == 7e9 * 8 / 8 and calc.state["fits"]
    assert "ZeRO-1, 8 GPUs" in calc.out.value           # every control changes what is shown
    calc.world_size.value = 1
    assert "not sharded" not in calc.out.value and "1 GPU:" in calc.out.value


def test_pictures_follow_each_stage():
    n = 4
    for stage in (0, 1, 2, 3):
        phases = sharding.zero_step_states(stage, n)
        last = phases[-1][1]
        for rank, held in enumerate(last):
            owned = [i for i, s in enumerate(held["optimizer states"]) if s]
            assert owned == (list(range(n)) if stage == 0 else [rank])
            if stage < 3:
                assert held["weights"] == ["w'"] * n                   # every rank ends with every weight
            else:
                assert [w for w in held["weights"] if w] == ["w'"]     # ZeRO-3: its own shard only
        fig = sharding.draw_zero_step(stage, n)
        drawn = sharding.drawn_labels(fig)
        for (_, ranks), labels in zip(phases, drawn):
            want = [x for r in ranks for kind in sharding.KINDS for x in r[kind] if x]
            assert labels == want
    with pytest.raises(ValueError):
        sharding.zero_step_states(5, 4)


def test_benchmark_worker_runs(no_leftovers):
    spec = importlib.util.spec_from_file_location("zero_vs_fsdp", os.path.join(ROOT, "benchmarks", "zero_vs_fsdp.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = run(measure.step_time_worker, 2, (3, "fsdp2"), 32, 2, 8, 2, 1, backend="gloo", show_output=False)[0]
    assert set(times) == {3, "fsdp2"} and all(t > 0 for t in times.values())
    states = run(bench.state_bytes_worker, 4, 32, 2, backend="gloo", show_output=False)
    assert all(s[3] == s["ddp"] / 4 for s in states)
    report = bench.report({3: 1.2, "fsdp2": 1.0}, {"ddp": 100, 1: 25, 2: 25, 3: 25})
    assert report.count("goal") == 2 and "NOT met" not in report
    assert "NOT met" in bench.report({3: 2.0, "fsdp2": 1.0}, {"ddp": 100, 1: 25, 2: 25, 3: 25})
    assert "NOT met" in bench.report({3: 1.0, "fsdp2": 1.0}, {"ddp": 100, 1: 30, 2: 25, 3: 25})


@pytest.mark.gpu
def test_on_a_gpu_every_stage_equals_one_process_run_on_the_same_gpu(no_leftovers):
    """Notebook 09's comparison on GPUs: the reference trains on the rank's own GPU (same float32 arithmetic).
    One rank, so NCCL on a one-GPU machine: its real reduce-scatter path, and FSDP2 on CUDA."""
    from course_lib import hardware
    cases = [(m, o, s) for m in ("mlp", "tiny_lm") for o in ("adamw", "sgd")
             for s in [1, 2, 3] + (["ddp", "fsdp2"] if m == "mlp" else [])]

    def worker(rank, world_size):
        device = hardware.rank_device()
        return str(device), {(m, o, s): T.max_difference(T.train_worker(rank, world_size, s, m, o),
                                                         T.train_reference(world_size, m, o, device=device))
                             for m, o, s in cases}
    device, gaps = run(worker, 1, show_output=False)[0]
    assert device.startswith("cuda") and max(gaps.values()) < 1e-5, gaps


def bf16_worker(rank, world_size):
    """Each stage on a model stored in bf16, against stage 1 (which never assigns a gradient itself)."""
    out = {}
    for stage in (1, 2, 3):
        model = T.build("mlp").to(torch.bfloat16)
        wrapped, opt = T.wrap(stage, model, "sgd")
        for x, y in T.batches("mlp", 4 * world_size, 2):
            mine = slice(rank * 4, (rank + 1) * 4)
            opt.zero_grad()
            T.loss_fn("mlp", wrapped(x[mine].bfloat16()), y[mine]).backward()
            opt.step()
        out[stage] = T.state_of(stage, wrapped)
        assert all(v.dtype == torch.bfloat16 for v in out[stage].values())
    return out


def test_every_stage_trains_a_bf16_model_and_the_stages_agree(no_leftovers):
    """ZeRO-2 and ZeRO-3 used to assign an fp32 .grad to a bf16 shard (a RuntimeError); ZeRO-1 worked."""
    for world_size in (2, 3):
        states = run(bf16_worker, world_size, backend="gloo", show_output=False)[0]
        start = T.build("mlp").to(torch.bfloat16).state_dict()
        assert T.max_difference(states[1], start) > 1e-3                # it trained
        for stage in (2, 3):
            assert T.max_difference(states[stage], states[1]) < 2e-2    # a few bf16 steps of 2**-8 apart at most


def test_a_global_norm_clip_needs_an_all_reduce_and_adafactor_is_not_element_wise(no_leftovers):
    from course_lib.zero import clip
    results = run(clip.clip_worker, 2, backend="gloo", show_output=False)
    for r in results:
        norms, gap = r["norms"], r["gap"]
        assert abs(norms["all-reduced"] - norms["one process"]) < 1e-5
        assert norms["torch on the shards"] < norms["one process"] - 0.1      # each rank sees its own slice only
        assert gap["all-reduced"] < 1e-6 and gap["torch on the shards"] > 1e-3
        assert gap["adam"] < 1e-6
        assert gap["adafactor"] is None or gap["adafactor"] > 1e-3
    assert results[0]["norms"]["torch on the shards"] != results[1]["norms"]["torch on the shards"]


def test_sharded_optimizer_under_ddp_sends_one_and_a_half_times_ddp_and_stage_1_sends_ddps(no_leftovers):
    for world_size in (2, 4):
        log = run(measure.zero1_traffic_worker, world_size, backend="gloo", show_output=False)[0]
        sent = {s: sum(flat.ring_bytes_sent(op, n, world_size) for op, n in ops) for s, ops in log.items()}
        assert sorted({op for op, _ in log["sharded_optimizer"]}) == ["all-gather", "all-reduce"]
        assert sorted({op for op, _ in log[1]}) == ["all-gather", "reduce-scatter"]
        assert sent["sharded_optimizer"] == 1.5 * sent["ddp"] and sent[1] == sent["ddp"]


def test_a_model_built_on_meta_is_sharded_made_slice_by_slice_and_equals_one_process(no_leftovers):
    from course_lib.zero import meta_init
    for world_size in (2, 3):
        reference = meta_init.meta_reference(world_size)
        for r in run(meta_init.meta_worker, world_size, backend="gloo", show_output=False):
            assert T.max_difference(r["state"], reference) < 1e-5
            assert r["largest tensor made"] <= r["largest parameter"] < r["whole model"]
            assert r["parameter bytes held"] <= r["whole model"] / world_size + 4 * 16      # 1/N, plus rounding
            assert r["peak bytes"] <= r["parameter bytes held"] + r["largest parameter"]  # shards + one buffer


def test_the_peak_of_live_bytes_tells_a_model_built_whole_from_one_built_on_meta(no_leftovers):
    """The largest single tensor cannot tell them apart (one parameter either way); the bytes alive at once can."""
    from course_lib.zero import meta_init
    for r in run(meta_init.meta_worker, 2, 3, False, backend="gloo", show_output=False):      # built whole
        assert r["largest tensor made"] <= r["largest parameter"]
        assert r["peak bytes"] >= r["whole model"]
        assert r["peak bytes"] > r["parameter bytes held"] + r["largest parameter"]


def test_meta_init_is_the_same_whoever_makes_the_slice():
    from course_lib.zero import meta_init
    init = meta_init.block_init()
    whole = init(3, torch.Size([30, 16]), 0, 480)
    assert torch.equal(torch.cat([init(3, torch.Size([30, 16]), lo, min(lo + 37, 480)) for lo in range(0, 480, 37)]),
                       whole)
    assert not torch.equal(whole, init(4, torch.Size([30, 16]), 0, 480))


def test_a_meta_model_without_init_is_a_clear_error(no_leftovers):
    def worker(rank, world_size):
        with torch.device("meta"):
            model = T.build("mlp")
        fully_shard(model)
    with pytest.raises(RankError, match="pass init="):
        run(worker, 2, backend="gloo", show_output=False)


def test_the_zero3_lifecycle_strip_gathers_twice_and_frees_after_each_use():
    phases = sharding.zero3_lifecycle()
    assert [p for p, collective, _ in phases if collective] == ["all-gather", "all-gather", "reduce-scatter"]
    assert ["whole weight" in held for _, _, held in phases] == [True, True, False, True, True, True, False]
    assert all("weight shard" in held for _, _, held in phases)
    assert phases[-1][2] == {"weight shard", "gradient shard"}
    assert len(sharding.draw_zero3_lifecycle(4).axes[0].patches) == 7 * 4 + 3


@dataclasses.dataclass
class _Out:
    h: torch.Tensor


class _ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 0.3)

    def forward(self, x):
        return _Out(x @ self.w.T)


class _DataclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.inner, self.head = nn.Linear(8, 8), _ReturnsDataclass(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.inner(torch.relu(self.pre(x))).h))


def _dataclass_worker(rank, world_size):
    from course_lib.zero import full_state_dict, fully_shard
    model = fully_shard(_DataclassModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    optimizer.step()
    return full_state_dict(model)


def test_a_layer_that_returns_a_dataclass_is_gathered_for_backward_too(no_leftovers):
    """The pre-backward gather hooks the tensors inside a dataclass output (it used to crash in backward)."""
    states = run(_dataclass_worker, 2, backend="gloo", show_output=False)
    model = _DataclassModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    model(x).pow(2).mean().backward()
    optimizer.step()
    for state in states:
        assert T.max_difference(state, model.state_dict()) < 1e-6


class _SkipsOnRank1(nn.Module):
    """Three layers; on rank 1 the forward skips ``b`` (a parameter used on one rank but not the other)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if not (torch.distributed.get_rank() == 1 and self.skip):
            h = torch.relu(self.b(h))
        return self.c(h)


def _skip_worker(rank, world_size, stage, skip):
    model = _SkipsOnRank1()
    model.skip = skip
    model, optimizer = shard(model, stage, torch.optim.SGD, lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return "trained"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_layer_skipped_on_one_rank_is_a_clear_error_within_seconds_not_a_hang(stage, no_leftovers):
    """Before every layer collective the ranks all-gather which one they are about to run: they disagree, so every
    rank raises a ValueError naming the parameters (ZeRO-2 used to hang until the timeout, ZeRO-3 to crash Gloo).
    The same model that runs b on both ranks trains, so the check does not refuse a good model."""
    assert run(_skip_worker, 2, stage, False, backend="gloo", show_output=False, timeout=60) == ["trained"] * 2
    start = time.monotonic()
    with pytest.raises(RankError) as error:
        run(_skip_worker, 2, stage, True, backend="gloo", show_output=False, timeout=60)
    elapsed = time.monotonic() - start
    assert error.value.exc_type == "ValueError", error.value
    assert "b.weight" in str(error.value) and "rank 1 is about to" in str(error.value), error.value
    assert elapsed < 20, elapsed                          # seconds (about 3 s measured), far from the 60 s timeout
