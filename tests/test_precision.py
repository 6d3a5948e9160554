"""Precision: formats' ranges, bytes per parameter of each mixed-precision mode, fp16 underflow recovered by
GradScaler (and overflow steps skipped), bf16 on the wire halving the bytes (counted) at a small cost."""
import pytest
import torch

from course_lib.data import make_token_dataset
from course_lib.launch import run
from course_lib.memory import training_memory
from course_lib.memory.activations import model_activation_bytes
from course_lib.models import TransformerConfig, transformer
from course_lib.precision import MasterWeights, build, bytes_per_parameter, cast_losses, format_table
from course_lib.precision.scaling import scaler_run, underflow_report
from course_lib.precision.wire import ddp_compress_worker, fsdp_reduce_dtype_worker

CFG = TransformerConfig()


def test_format_table_ranges():
    t = format_table()
    assert t["fp16"]["largest"] == 65504 and t["fp16"]["smallest subnormal"] == 2.0**-24
    assert t["bf16"]["smallest normal"] == t["fp32"]["smallest normal"]          # bf16 has fp32's range
    assert (t["bf16"]["exponent bits"], t["bf16"]["mantissa bits"]) == (8, 7)
    assert (t["fp16"]["exponent bits"], t["fp16"]["mantissa bits"]) == (5, 10)
    x = torch.tensor([1e-9, 2e-8, 1.0, 7e4, 1e30])    # below half of 2^-24 rounds to 0
    assert cast_losses(x, torch.float16) == {"underflow": 2, "overflow": 2, "max_relative_error": 0.0}
    bf = cast_losses(x, torch.bfloat16)
    assert bf["underflow"] == bf["overflow"] == 0 and 0 < bf["max_relative_error"] <= 2.0**-8


def test_bytes_per_parameter_of_each_mode_reconcile_with_the_arithmetic():
    tokens, targets = make_token_dataset(4, CFG.seq_len, CFG.vocab).tensors
    model = transformer(CFG)
    n = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    r = {mode: bytes_per_parameter(mode, transformer(CFG), tokens, targets) for mode in ("fp32", "autocast",
                                                                                       "master", "bf16")}
    assert r["fp32"]["per_parameter"]["total"] == 16 == training_memory(n, "fp32")["total"] / n
    assert r["autocast"]["per_parameter"]["total"] == 16                       # autocast keeps fp32 state
    assert r["autocast"]["per_parameter"]["autocast weight copies (forward to backward)"] == 2 * linear / n
    master = r["master"]["per_parameter"]
    arithmetic = training_memory(n, "bf16")
    assert master["total"] * n == arithmetic["total"]                          # notebook 06's 16 bytes
    assert master["weights"] * n == arithmetic["weights"] and master["fp32 master weights"] == 4
    assert r["bf16"]["per_parameter"]["total"] == 8
    assert r["autocast"]["activation_bytes"] < r["fp32"]["activation_bytes"]
    inputs = 2 * 8 * 4 * CFG.seq_len                     # tokens and targets (int64) existed before the forward
    assert r["fp32"]["activation_bytes"] == model_activation_bytes(CFG, 4)["total"] - inputs + 4   # + the loss
    # a bf16 model: the same table in 2 bytes (the loss and its weight total are 2-byte scalars: 2 + 2 = 4)
    assert r["master"]["activation_bytes"] == model_activation_bytes(CFG, 4, dtype_bytes=2)["total"] - inputs


def test_master_weights_step_like_fp32_adam_and_bf16_alone_loses_updates():
    model, opt, _ = build("master", transformer(CFG), lr=1e-3)
    assert isinstance(opt, MasterWeights) and all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens = torch.randint(32, (4, 32))
    from course_lib.models import lm_loss
    lm_loss(model(tokens), tokens).float().backward()
    opt.step()
    assert all(m.dtype == torch.float32 and m.grad is None for m in opt.masters)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), opt.masters))
    with pytest.raises(ValueError, match="unknown precision mode"):
        build("fp8", transformer(CFG))


def test_grad_scaler_recovers_the_gradients_fp16_zeroes():
    tokens, targets = make_token_dataset(8, CFG.seq_len, CFG.vocab).tensors
    r = underflow_report(CFG, tokens, targets, loss_factor=1e-3)
    assert r["fp16"]["zeroed"] > 0.05 * r["elements"] and r["fp16"]["relative_error"] > 0.1
    assert r["fp16, loss scaled"]["zeroed"] == 0 and r["fp16, loss scaled"]["relative_error"] < 2e-3
    assert r["bf16"]["zeroed"] == 0 and r["bf16"]["relative_error"] < 2e-2


def test_grad_scaler_skips_overflow_steps_halves_and_grows_the_scale():
    r = scaler_run(CFG, steps=16, batch=4, init_scale=2.0**24, growth_interval=3)
    assert r["skipped"][0]                                   # 2^24 overflows fp16 at once
    clean, grew = 0, 0
    for i, skipped in enumerate(r["skipped"]):               # GradScaler's rule, step by step
        after = r["scale"][i + 1] if i + 1 < len(r["scale"]) else r["final_scale"]
        clean = 0 if skipped else clean + 1
        if skipped:
            expected = r["scale"][i] / 2                     # weights unchanged and the scale halved
        elif clean == 3:
            expected, clean, grew = r["scale"][i] * 2, 0, grew + 1
        else:
            expected = r["scale"][i]
        assert after == expected, (i, r["scale"], r["skipped"])
    assert grew >= 1 and not all(r["skipped"])


def test_bf16_compress_hook_halves_the_bytes_at_a_small_gradient_error():
    r = run(ddp_compress_worker, 2, CFG, 3, 8, backend="gloo", show_output=False)
    for rank in r:
        if torch.version.cuda is None:
            assert "NCCL" in rank["refusal"]             # a CPU build refuses the hook by its name
        fp32, bf16 = rank["fp32"], rank["bf16"]
        assert [k for k, _ in fp32["collectives"]] == ["all-reduce"] * len(fp32["collectives"])
        assert sum(b for _, b in fp32["collectives"]) == 4 * fp32["params"]
        assert sum(b for _, b in bf16["collectives"]) * 2 == sum(b for _, b in fp32["collectives"])
        assert fp32["gradient_error"] < 1e-6 < bf16["gradient_error"] < 2.0**-7
        assert abs(fp32["losses"][-1] - bf16["losses"][-1]) < 0.05


def test_fsdp2_reduce_dtype_bf16_halves_the_reduce_scatter_bytes():
    r = run(fsdp_reduce_dtype_worker, 2, CFG, backend="gloo", show_output=False)[0]
    rs = {dt: sum(b for k, b, _ in v["collectives"] if k == "reduce-scatter") for dt, v in r.items()}
    ag = {dt: sum(b for k, b, _ in v["collectives"] if k == "all-gather") for dt, v in r.items()}
    assert rs["float32"] == 2 * rs["bfloat16"] > 0 and ag["float32"] == ag["bfloat16"] > 0
    assert r["float32"]["grad_dtype"] == r["bfloat16"]["grad_dtype"] == "float32"   # shards step in fp32
    assert 0 < r["bfloat16"]["error_vs_first"] < 2.0**-7


def test_cpu_features_and_matmul_speed_are_measured():
    from course_lib.precision.speed import cpu_features, matmul_worker
    f = cpu_features()
    assert f["capability"] == torch.backends.cpu.get_cpu_capability()
    assert f["native bf16"] == ((f["avx512_bf16"] or f["amx_bf16"]) if f["flags known"] else None)
    rates = run(matmul_worker, 1, 64, 2, backend="gloo", threads=1, show_output=False)[0]
    assert set(rates) == {"float32", "bfloat16", "float16"} and all(v > 0 for v in rates.values())


def test_cpu_features_say_unknown_where_no_flags_can_be_read(monkeypatch):
    """ARM Linux lists no x86 flags and macOS has no /proc/cpuinfo: unknown, never "emulated"."""
    from pathlib import Path

    from course_lib.precision import speed
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    f = speed.cpu_features()
    assert f["native bf16"] is None and f["native fp16"] is None
    assert (speed.describe(None), speed.describe(False), speed.describe(True)) == ("unknown", "emulated", "native")


def test_fsdp2_reduce_dtype_unset_reduces_in_param_dtype():
    r = run(fsdp_reduce_dtype_worker, 2, CFG, (torch.bfloat16, None), backend="gloo", show_output=False)[0]
    rs = {dt: sum(b for k, b, _ in v["collectives"] if k == "reduce-scatter") for dt, v in r.items()}
    assert rs["None"] == rs["bfloat16"] > 0 and r["None"]["error_vs_first"] == 0


def test_a_bf16_ring_loses_more_with_every_rank_and_an_fp32_ring_does_not():
    from course_lib.precision.wire import ring_sum_error
    bf16 = [ring_sum_error(n, seed=1) for n in (2, 8, 64, 512)]
    assert all(a < b for a, b in zip(bf16, bf16[1:]))
    assert 0.002 < bf16[0] < 0.003 and 0.007 < bf16[2] < 0.009 and bf16[3] > 0.02
    assert 0.02 < ring_sum_error(512, noise=3.0) < 0.03              # more noise: the lower end of 2-7%
    same = [ring_sum_error(n, noise=0.0) for n in (2, 8, 64, 512)]   # identical gradients: the worst case
    assert all(a < b for a, b in zip(same, same[1:])) and same[3] > 0.25 > ring_sum_error(512)
    assert ring_sum_error(512, torch.float32) < 1e-6


def _fp16_hook_worker(rank, world_size, value):
    """PyTorch's fp16_compress_hook on a one-element bucket: ``value`` on rank 0, 0 on the others."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    bucket = torch.tensor([value if rank == 0 else 0.0])
    return default_hooks.fp16_compress_hook(None, (bucket,)).wait().item()


def test_fp16_compress_hook_overflows_above_65504_on_one_rank_whatever_the_world_size():
    """Exercise 1's solution: the hook casts before it divides, so 70000 is inf although the average, 35000, fits."""
    over = run(_fp16_hook_worker, 2, 70000.0, backend="gloo", show_output=False)
    under = run(_fp16_hook_worker, 2, 65000.0, backend="gloo", show_output=False)
    assert all(v == float("inf") for v in over)
    assert all(abs(v - 32500.0) < 32 for v in under)


def test_bf16_hook_refusal_matches_torchs_own_condition():
    from course_lib.precision.wire import refusal_on_this_build, refuses_bf16_hook

    def worker(rank, world_size):
        return refusal_on_this_build() is not None, refuses_bf16_hook()
    assert run(worker, 1, backend="gloo", show_output=False)[0] in {(True, True), (False, False)}


def test_scaled_fp8_casts_keep_what_unscaled_casts_flush_to_zero():
    from course_lib.precision import formats
    if not formats.FP8:
        pytest.skip("this torch has no float8 dtypes")
    assert format_table()["fp8 e4m3"]["largest"] == 448 and format_table()["fp8 e5m2"]["largest"] == 57344
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 1e-4
    r = formats.scaled_fp8_cast(x, torch.float8_e4m3fn)
    assert r["unscaled"]["zeroed"] > 0.99 and r["scaled"]["zeroed"] == 0 and r["scaled"]["relative_error"] < 0.05
    assert (x * r["scale"]).abs().max().item() == pytest.approx(448, rel=1e-6)


def test_accumulation_is_exact_with_masked_targets_only_when_normalised_by_the_global_token_count():
    from course_lib.memory.accumulation import masked_accumulation_worker
    r = run(masked_accumulation_worker, 2, CFG, backend="gloo", show_output=False)
    assert r[0]["tokens per micro-batch"] != r[1]["tokens per micro-batch"]       # the premise: counts differ
    for one in r:
        assert one["global token count"] < 1e-5 and one["per micro-batch mean"] > 0.05
        assert abs(one["size without x W"] - 0.5) < 1e-4          # DDP averages: without x W, half-size gradients


def test_a_bf16_model_loses_most_updates_at_a_small_learning_rate():
    from course_lib.precision.mixed import train_worker
    r = run(train_worker, 1, CFG, ("master", "bf16"), 30, 16, 1e-4, backend="gloo", threads=1, show_output=False)[0]
    assert r["bf16"]["lost"][-1] > 0.5
    drop = {m: v["losses"][0] - v["losses"][-1] for m, v in r.items()}
    assert drop["bf16"] < 0.85 * drop["master"]


def test_fp32_gradient_accumulation_holds_18_bytes_and_bf16_accumulation_drifts_with_micro_batches():
    from course_lib.precision.mixed import fp32_accumulation
    x, y = make_token_dataset(16, CFG.seq_len, CFG.vocab).tensors
    few, many = (fp32_accumulation(transformer(CFG), x, y, k) for k in (2, 16))
    assert few["per_parameter"] == many["per_parameter"] == {
        "bf16 weights": 2, "fp32 gradients": 4, "fp32 master weights": 4, "optimizer states": 8, "total": 18}
    assert many["bf16_accumulation_error"] > few["bf16_accumulation_error"] > 0


def test_sharded_grad_scaler_skips_on_every_rank_when_one_rank_overflows():
    from course_lib.precision.scaling import sharded_skip_worker
    r = run(sharded_skip_worker, 2, backend="gloo", show_output=False)
    assert [one["GradScaler"]["skipped"] for one in r] == [True, False]          # plain: the ranks disagree
    assert all(one["ShardedGradScaler"]["skipped"] and one["ShardedGradScaler"]["scale after"] == 2.0**7 for one in r)


def test_the_bf16_hook_is_chosen_by_backend_kind_not_by_the_exact_backend_name(monkeypatch):
    """'cuda:nccl,cpu:gloo' is NCCL (torch's own hook), 'cpu:gloo' is Gloo (the renamed one), like the plain names."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from course_lib import hardware
    from course_lib.precision import wire
    for name, expected in (("nccl", default_hooks.bf16_compress_hook), ("cuda:nccl,cpu:gloo",
                           default_hooks.bf16_compress_hook), ("gloo", wire.bf16_compress),
                           ("cpu:gloo", wire.bf16_compress)):
        monkeypatch.setattr(hardware.dist, "get_backend", lambda name=name: name)
        assert wire.hooks()["bf16"] is expected, name
