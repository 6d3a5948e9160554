"""FSDP2's costs, counted on 2 Gloo ranks (course_lib.zero.fsdp2_costs): the backward order under prefetching, the
root's default reshard, bytes per parameter under mixed precision, gradient accumulation, meta-device init."""
import dataclasses
import functools

import torch
import torch.distributed as dist

from course_lib.comm.record import Collective
from course_lib.launch import run
from course_lib.zero import fsdp2_costs, fsdp2_meta, measure


def _all(rank, world_size):
    out = {"order": fsdp2_costs.order_worker(rank, world_size, functools.partial(measure.deep_mlp, 32, 3)),
           "root": fsdp2_costs.root_reshard_worker(rank, world_size),
           "meta": fsdp2_meta.meta_init_worker(rank, world_size, 32, 2)}
    for dtypes in ((None, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
        out[dtypes] = fsdp2_costs.bytes_per_parameter_worker(rank, world_size, 16, *dtypes)
    for mode in ("sync", "no sync", "no sync, keep weights"):
        out[mode] = fsdp2_costs.accumulation_worker(rank, world_size, 16, mode)
    return out


def test_fsdp2_costs_on_two_ranks():
    results = run(_all, 2, backend="gloo", show_output=False)
    r = results[0]
    assert r["order"]["forward"] == ["all-gather"] * 3
    assert r["order"]["backward"] == ["all-gather", "all-gather", "reduce-scatter", "all-gather", "reduce-scatter",
                                      "reduce-scatter"]
    assert max(r["order"]["in flight"]) == 2 and r["order"]["in flight"][-1] == 0
    assert r["root"] == {"whole after forward": ["head.weight", "head.bias"], "backward all-gathers": 3}
    for dtypes in r:
        if isinstance(dtypes, tuple):
            assert [r[dtypes][k] for k in ("parameters", "gradients", "optimizer states")] == [4, 4, 8]
            assert r[dtypes]["dtypes"] == (torch.float32, torch.float32)
    assert (r[None, None]["all-gather"], r[None, None]["reduce-scatter"]) == (4.0, 2.0)         # fp32: 1.5 x DDP's 4
    assert (r[torch.bfloat16, torch.float32]["all-gather"], r[torch.bfloat16, torch.float32]["reduce-scatter"]) == (
        2.0, 2.0)                                                                              # = fp32 DDP's 4
    assert (r[torch.bfloat16, None]["all-gather"], r[torch.bfloat16, None]["reduce-scatter"]) == (2.0, 1.0)
    sync, no_sync, keep = r["sync"], r["no sync"], r["no sync, keep weights"]
    assert (sync["all-gathers"], sync["reduce-scatters"]) == (28, 14)
    assert (no_sync["all-gathers"], no_sync["reduce-scatters"]) == (28, 7)
    assert (keep["all-gathers"], keep["reduce-scatters"]) == (21, 7)
    assert sync["whole gradients"] == 0 and no_sync["whole gradients"] == keep["whole gradients"] == sync["model bytes"]
    assert no_sync["whole weights"] == 0 and keep["whole weights"] == sync["model bytes"]
    for name in sync["grads"]:
        assert torch.allclose(sync["grads"][name], no_sync["grads"][name], atol=1e-6)
        assert torch.allclose(sync["grads"][name], keep["grads"][name], atol=1e-6)
    for m in (res["meta"] for res in results):
        assert m["after building"] == m["after fully_shard"] == 0 and m["after to_empty"] == m["whole"] // 2
        assert (m["placement"], m["shape"], m["local shape"]) == ("S(0)", (32, 32), (16, 32))
        assert m["shards differ"] and m["vs built whole"] == 0.0        # no duplicate neurons: BlockNet(seed) exactly


def _reset_parameters_on_cpu_mesh(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from course_lib.zero import fsdp2
    with torch.device("meta"):
        model = fsdp2_costs.BlockNet(32, 1)
    fully_shard(model, mesh=fsdp2.mesh())
    model.to_empty(device="cpu")
    model.head.reset_parameters()
    return model.head.weight.full_tensor()


def test_meta_init_on_three_ranks_equals_the_whole_build_and_reset_parameters_would_not():
    """The reason for fsdp2_meta.init_shards: on a CPU mesh reset_parameters draws the same rows on every rank."""
    w = run(_reset_parameters_on_cpu_mesh, 2, backend="gloo", show_output=False)[0]
    assert torch.equal(w[:16], w[16:])                                   # duplicate neurons
    for m in run(fsdp2_meta.meta_init_worker, 3, 32, 2, backend="gloo", show_output=False):   # 11 + 11 + 10 rows
        assert m["shards differ"] and m["vs built whole"] == 0.0 and m["after to_empty"] < m["whole"] // 2


def test_in_flight_counts_gathers_not_yet_reduced():
    records = [Collective("all-gather", 8, "forward"), Collective("all-gather", 8, "backward"),
               Collective("all-gather", 8, "backward"), Collective("reduce-scatter", 8, "backward"),
               Collective("reduce-scatter", 8, "backward")]
    assert fsdp2_costs.in_flight(records) == [1, 2, 1, 0]
    assert fsdp2_costs.in_flight(records, "forward") == [1]


def _accumulate_four(rank, world_size):
    return {m: fsdp2_costs.accumulation_worker(rank, world_size, 16, m, micro_batches=4)
            for m in ("sync", "no sync", "no sync, keep weights")}


def test_exercise_2_four_micro_batches():
    r = run(_accumulate_four, 2, backend="gloo", show_output=False)[0]
    assert [(v["all-gathers"], v["reduce-scatters"]) for v in r.values()] == [(56, 28), (56, 7), (35, 7)]


def test_exercise_1_saved_on_3_ranks_loads_on_4(tmp_path):
    import torch.distributed.checkpoint as dcp

    from course_lib.zero import fsdp2, training
    model_fn = functools.partial(measure.deep_mlp, 256, 3)
    path = str(tmp_path / "checkpoint")
    saved = run(fsdp2.dcp_save_worker, 3, path, model_fn, backend="gloo", show_output=False)
    loaded = run(fsdp2.dcp_load_worker, 4, path, model_fn, backend="gloo", show_output=False)
    assert all(r["shapes"]["0.weight"] == ((256, 256), (64, 256)) for r in loaded)
    assert all(training.max_difference(r["weights"], saved[0]["weights"]) == 0.0 for r in loaded)
    chunks = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["model.0.weight"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 86, 172]
    assert sorted(c.sizes[0] for c in chunks) == [84, 86, 86]


def test_hsdp_on_a_2x2_mesh_equals_one_process():
    from course_lib.zero import training
    results = run(fsdp2_costs.hsdp_worker, 4, backend="gloo", show_output=False)
    reference = fsdp2_costs.hsdp_reference(4)
    whole = sum(v.numel() * 4 for v in reference.values())
    for r in results:
        assert training.max_difference(r["weights"], reference) < 1e-6
        assert r["placements"] == "(Replicate(), Shard(dim=0))" and r["local shape"] == (16, 32)
        assert (r["reduce-scatters"], r["all-reduces"]) == (4, 4)                 # 3 blocks and the root, each
        assert (r["reduce-scatter bytes"], r["all-reduce bytes"]) == (whole, whole // 2)   # across: only a shard
    assert [r["groups"] for r in results] == [                 # reduce-scatter along a row, all-reduce down a column
        {"reduce-scatter": [(0, 1)], "all-reduce": [(0, 2)]}, {"reduce-scatter": [(0, 1)], "all-reduce": [(1, 3)]},
        {"reduce-scatter": [(2, 3)], "all-reduce": [(0, 2)]}, {"reduce-scatter": [(2, 3)], "all-reduce": [(1, 3)]}]


class _SkipsABlock(fsdp2_costs.BlockNet):
    """A BlockNet whose block ``skip`` does not run (a parameter unused on this rank)."""

    skip = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.head(x)


def _unit_skipped_on_rank_1(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from course_lib.zero import fsdp2
    model = _SkipsABlock(16)
    model.skip = 1 if rank == 1 else None
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    fsdp2.force_sum_on_gloo(model)
    model(torch.randn(4, 16)).pow(2).mean().backward()


def test_a_unit_skipped_on_one_rank_hangs_and_run_stops_it():
    import pytest

    from course_lib.launch import RunTimeoutError
    with pytest.raises(RunTimeoutError, match="collective that only some ranks call"):
        run(_unit_skipped_on_rank_1, 2, backend="gloo", show_output=False, timeout=15)


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


class _Layer(torch.nn.Module):
    def __init__(self, as_dataclass):
        super().__init__()
        self.linear, self.as_dataclass = torch.nn.Linear(8, 8), as_dataclass

    def forward(self, x):
        y = self.linear(x)
        return _Out(y) if self.as_dataclass else (y,)


class _Two(torch.nn.Module):
    def __init__(self, as_dataclass):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _Layer(as_dataclass), _Layer(as_dataclass)

    def forward(self, x):
        unpack = (lambda o: o.y) if self.a.as_dataclass else (lambda o: o[0])
        return unpack(self.b(unpack(self.a(x))))


def _grads_with_outputs(rank, world_size, as_dataclass):
    from torch.distributed.fsdp import fully_shard

    from course_lib.zero import fsdp2
    model = _Two(as_dataclass)
    for layer in (model.a, model.b):
        fully_shard(layer)                   # resharded after forward: backward must gather them again
    fully_shard(model)
    fsdp2.force_sum_on_gloo(model)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def test_a_dataclass_output_gets_the_same_gradients_as_a_tuple():
    tuples, dataclasses_ = (run(_grads_with_outputs, 2, flag, backend="gloo", show_output=False)[0]
                            for flag in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(tuples, dataclasses_))


def _reshard_to(rank, world_size):
    return {flag: fsdp2_costs.reshard_to_worker(rank, world_size, flag) for flag in (True, 2)}


def test_reshard_after_forward_to_2_of_4_ranks_gathers_backward_from_2():
    r = run(_reshard_to, 4, backend="gloo", show_output=False)[0]
    assert r[True] == [("forward", 4)] * 4 + [("backward", 4)] * 4           # 3 blocks and the head, twice
    assert r[2] == [("forward", 4)] * 4 + [("backward", 2)] * 4              # backward inside a pair of ranks


def _backend_words(rank, world_size):
    from course_lib import hardware
    from course_lib.zero import flat
    dist.init_process_group("cpu:gloo", rank=rank, world_size=world_size)
    return {"name": dist.get_backend(), "kind": hardware.backend_kind(), "device": str(hardware.rank_device()),
            "real reduce-scatter": flat.real_reduce_scatter()}


def test_backend_named_cpu_gloo_is_gloo():
    """init_process_group("cpu:gloo") names its backend 'cpu:gloo': the course's checks must still see Gloo."""
    r = run(_backend_words, 1, init=False, show_output=False)[0]
    assert r == {"name": "cpu:gloo", "kind": "gloo", "device": "cpu", "real reduce-scatter": False}


def _save_training_state(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    from course_lib.zero import resume
    dcp.save({"app": resume._setup(0, ("model", "scheduler", "rng", "data"))}, checkpoint_id=path)


def _load_training_state(rank, world_size, path, parts):
    import torch.distributed.checkpoint as dcp

    from course_lib.zero import resume
    try:
        dcp.load({"app": resume._setup(1, parts)}, checkpoint_id=path)
        return "loaded"
    except BaseException as e:                   # noqa: BLE001 (DCP raises CheckpointException, a BaseException)
        return type(e).__name__


def test_training_state_with_generators_is_tied_to_its_world_size(tmp_path):
    """Notebook 10's claim: per-rank generators tie a TrainingState checkpoint to the world size that saved it;
    the weights and the optimizer alone load on another one."""
    path = str(tmp_path / "ckpt")
    run(_save_training_state, 2, path, backend="gloo", show_output=False)
    with_rng = run(_load_training_state, 4, path, ("model", "scheduler", "rng", "data"), backend="gloo",
                   show_output=False)
    assert "loaded" not in with_rng[2:], with_rng                     # ranks 2 and 3 find no generator of their own
    assert run(_load_training_state, 4, path, ("model",), backend="gloo", show_output=False) == ["loaded"] * 4
