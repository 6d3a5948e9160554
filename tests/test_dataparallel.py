"""Hand-written data parallelism and MiniDDP equal torch DDP and one process on the global batch."""
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from course_lib import checkpoint, viz
from course_lib.data import make_dataset
from course_lib.data_parallel import MiniDDP, ddp_features, measure, training
from course_lib.data_parallel.training import TrainConfig, max_difference
from course_lib.launch import RankError, RunTimeoutError, run
from course_lib.models import WithExtras, make_mlp

TOL = 1e-5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n, drop_last", [(250, False), (251, True)])
def test_every_strategy_equals_one_process_on_the_global_batch(world_size, n, drop_last):
    cfg = TrainConfig(n=n, batch_size=8, epochs=2, lr=0.1, drop_last=drop_last)
    reference = training.train_reference(cfg, world_size)
    for strategy in ("by_hand", "mini_ddp", "torch_ddp"):
        out = run(training.train_worker, world_size, cfg.with_(strategy=strategy), backend="gloo",
                  show_output=False)
        assert max_difference(out[0]["state"], reference["state"]) < TOL, strategy
        assert all(max_difference(o["state"], out[0]["state"]) == 0 for o in out), "ranks must agree exactly"
        assert out[0]["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
    assert reference["losses"][-1] < reference["losses"][0] / 2


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_mini_ddp_handles_buffers_and_unused_parameters_like_torch_ddp(world_size):
    cfg = TrainConfig(n=120, batch_size=8, epochs=1, model="extras")
    mini = run(training.train_worker, world_size, cfg.with_(strategy="mini_ddp"), backend="gloo", show_output=False)
    ddp = run(training.train_worker, world_size, cfg.with_(strategy="torch_ddp"), backend="gloo", show_output=False)
    for r in range(world_size):
        assert max_difference(mini[r]["state"], ddp[r]["state"]) < TOL
    untouched = training.build_model(cfg).state_dict()
    for k in ("unused.weight", "unused.bias"):  # never used: never updated
        assert torch.equal(mini[0]["state"][k], untouched[k])


def inspect_mini_ddp(rank, world_size, cap):
    torch.manual_seed(rank)                      # different initial weights on purpose...
    model = WithExtras(seed=rank)
    ddp = measure.TimedMiniDDP(model, bucket_cap_mb=cap)   # ...made equal by the broadcast from rank 0
    x, y = make_dataset(16, seed=rank).tensors
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return {"weights": weights, "grads": grads, "buckets": [len(b) for b in ddp.buckets],
            "order": [t["bucket"] for t in ddp.timeline], "unused_grad": model.unused.weight.grad}


def test_mini_ddp_broadcasts_buckets_in_order_and_averages():
    tiny = run(inspect_mini_ddp, 3, 1e-6, backend="gloo", show_output=False)
    whole = run(inspect_mini_ddp, 3, 100.0, backend="gloo", show_output=False)
    assert all(torch.equal(r["weights"], tiny[0]["weights"]) for r in tiny)   # broadcast at construction
    assert all(torch.equal(r["grads"], tiny[0]["grads"]) for r in tiny)       # gradients averaged
    torch.testing.assert_close(tiny[0]["grads"], whole[0]["grads"])           # bucket size changes nothing
    assert tiny[0]["buckets"] == [1] * 8 and whole[0]["buckets"] == [8]        # one per tensor vs one in all
    assert tiny[0]["order"] == list(range(8))                                   # launched in order
    assert tiny[0]["unused_grad"] is None                                       # as in DDP


def rank_zero_only_worker(rank, world_size, wrapper):
    """A layer used only on rank 0 (and one used nowhere): the gradients each rank holds after one step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class RankZeroExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.extra, self.nowhere = (torch.nn.Linear(16, 4) for _ in range(3))

        def forward(self, x):
            out = self.body(x)
            return out + self.extra(x) if dist.get_rank() == 0 else out
    model = RankZeroExtra()
    wrapped = MiniDDP(model) if wrapper == "mini" else DDP(model, find_unused_parameters=True)
    x, y = make_dataset(16, seed=rank).tensors
    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    if wrapper == "mini":
        wrapped.finish_gradient_synchronization()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_mini_ddp_gives_a_parameter_used_on_one_rank_its_average_on_every_rank_like_torch_ddp():
    mini = run(rank_zero_only_worker, 2, "mini", backend="gloo", show_output=False)
    ddp = run(rank_zero_only_worker, 2, "torch", backend="gloo", show_output=False)
    for r in range(2):
        assert mini[r]["extra.weight"] is not None and ddp[r]["extra.weight"] is not None
        assert mini[r]["nowhere.weight"] is None and ddp[r]["nowhere.weight"] is None   # unused on every rank
        for name in ("body.weight", "body.bias", "extra.weight", "extra.bias"):
            torch.testing.assert_close(mini[r][name], ddp[r][name])
    torch.testing.assert_close(mini[1]["extra.weight"], mini[0]["extra.weight"])       # rank 1 got rank 0's / 2


def test_mini_ddp_rejects_a_bad_bucket_size():
    with pytest.raises(RankError, match="bucket_cap_mb must be positive"):
        run(lambda r, w: MiniDDP(make_mlp(), bucket_cap_mb=0), 1, backend="gloo", show_output=False)


def test_timeline_shows_overlap():
    rec = run(measure.timeline_worker, 2, backend="gloo", show_output=False)[0]
    assert len(rec["buckets"]) == 8
    assert min(b["launched"] for b in rec["buckets"]) < rec["backward_done"]
    assert all(b["finished"] >= b["launched"] for b in rec["buckets"])


def test_no_sync_accumulation_equals_one_big_step():
    for world_size in (1, 2, 3):
        out = run(ddp_features.accumulation_worker, world_size, backend="gloo", show_output=False)
        assert all(r["max_difference"] < 1e-6 for r in out)
        assert all(r["grads_differed_before_sync"] == (world_size > 1) for r in out)


def test_checkpoint_from_rank_0_loads_everywhere(tmp_path):
    path = tmp_path / "ckpt.pt"
    out = run(ddp_features.checkpoint_worker, 3, str(path), backend="gloo", show_output=False)
    assert all(r["same_weights"] and r["step"] == 5 for r in out)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_atomic_save_keeps_the_old_checkpoint_when_a_save_fails(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save_atomic({"step": 1, "w": torch.ones(3)}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):    # a lambda cannot be pickled
        checkpoint.save_atomic({"step": 2, "bad": lambda: None}, path)  # cannot be pickled: fails mid-save
    assert checkpoint.load(path)["step"] == 1
    assert os.listdir(tmp_path) == ["ckpt.pt"]


class NotPlainData:
    pass


def test_weights_only_load_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": NotPlainData()}, path)  # unpickling it would import and build a class: refused
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        checkpoint.load(path)


def test_throughput_and_wrapper_workers_report_numbers():
    assert run(measure.throughput_worker, 2, 64, 2, 32, 2, backend="gloo", show_output=False)[0] > 0
    times = run(measure.compare_wrappers_worker, 2, 64, 2, 32, 2, 2, backend="gloo", show_output=False)[0]
    assert set(times) == {"mini_ddp", "torch_ddp", "ratio"} and all(t > 0 for t in times.values())


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown model"):
        training.build_model(TrainConfig(model="resnet"))
    with pytest.raises(RankError, match="unknown strategy"):
        run(training.train_worker, 1, TrainConfig(strategy="fsdp"), backend="gloo", show_output=False)
    with pytest.raises(ValueError, match="classes >= 2"):
        make_dataset(10, classes=1)


def test_sampler_pictures_use_the_real_sampler():
    assert training.sampler_shards(10, 4) == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert training.sampler_shards(10, 4, drop_last=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    _, same = viz.draw_epoch_orders(8, 2, 3, set_epoch=False)
    _, new = viz.draw_epoch_orders(8, 2, 3, set_epoch=True)
    assert same[0] == same[1] == same[2] and len({tuple(o) for o in new}) == 3
    fig = viz.draw_sampler(7, 3)
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(map(str, [0, 3, 6, 1, 4, 0, 2, 5, 1]))


def test_an_unused_parameter_fails_at_the_next_forward_unless_ddp_is_told():
    with pytest.raises(RankError, match="Expected to have finished reduction in the prior iteration"):
        run(ddp_features.unused_parameter_worker, 2, False, backend="gloo", show_output=False, timeout=60)
    assert run(ddp_features.unused_parameter_worker, 2, True, backend="gloo", show_output=False) == ["2 steps"] * 2


def test_uneven_inputs_hang_without_join_and_finish_with_it(no_leftovers):
    with pytest.raises(RunTimeoutError):
        run(ddp_features.uneven_inputs_worker, 2, False, backend="gloo", show_output=False, timeout=5)
    assert run(ddp_features.uneven_inputs_worker, 3, True, backend="gloo", show_output=False) == [3, 4, 5]


def test_ddp_broadcasts_rank_0s_buffers_at_every_forward():
    out = run(ddp_features.buffers_worker, 3, backend="gloo", show_output=False)
    assert [o["own"] for o in out] == [0.0, 1.0, 2.0] and all(o["seen_in_forward"] == 0.0 for o in out)


def test_the_side_by_side_scaling_worker_measures_both():
    out = run(measure.side_by_side_worker, 2, 64, 2, 32, 2, 2, backend="gloo", threads=1, show_output=False)[0]
    assert 1.0 <= out["concurrency"] <= 2.0 and out["speedup"] > 0 and out["efficiency"] > 0


def test_torch_ddp_defaults_the_notebook_states():
    """Notebook 03 says torch's DDP fills 25 MB buckets, the first one only 1 MiB (private: checked here)."""
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp_module
    assert ddp_module._DEFAULT_BUCKET_CAP_MB == 25 and dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20


def test_notebook_03_exercise_solutions():
    cfg = TrainConfig(n=1001, batch_size=16, epochs=1, lr=0.05, drop_last=True)         # exercise 1
    out = run(training.train_worker, 4, cfg.with_(strategy="by_hand"), backend="gloo", show_output=False)
    assert max_difference(out[0]["state"], training.train_reference(cfg, world_size=4)["state"]) < TOL
    one = run(measure.timeline_worker, 2, 512, 8, 64, 25.0, backend="gloo", show_output=False)[0]   # exercise 2
    assert len(one["buckets"]) == 1 and one["bucket_sizes"][0] < 25 * 2**20


def test_overlap_schedule_and_torchrun_picture():
    s = viz.overlap_schedule([2, 2, 2, 2], [1.5] * 4)
    assert s["without"]["step"] == 14 and s["with"]["step"] == 9.5
    assert s["with"]["spans"][0] == (2, 3.5)                     # bucket 0 leaves as soon as the last layer is done
    slow = viz.overlap_schedule([1, 1], [3, 3])                   # communication-bound: all-reduces queue up
    assert slow["with"]["spans"] == [(1, 4), (4, 7)] and slow["with"]["step"] == 7
    _, workers = viz.draw_torchrun(2, 3)
    assert [w["RANK"] for w in workers] == list(range(6))
    assert [(w["GROUP_RANK"], w["LOCAL_RANK"]) for w in workers] == [(n, k) for n in range(2) for k in range(3)]


def test_sync_batchnorm_gathers_in_forward_and_all_reduces_in_backward():
    """Notebook 04 says so (the text of torch's source: checked here, not in the notebook)."""
    import inspect
    fn = torch.nn.modules._functions.SyncBatchNorm
    assert "all_gather" in inspect.getsource(fn.forward) and "all_reduce" in inspect.getsource(fn.backward)
