"""Tensor parallelism on Gloo with real processes: split layers and blocks equal the unsplit ones, on 2 and 4
ranks; DTensor equals the from-scratch layers; the 2-D mesh trains like one process; the dropout rule holds."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.launch import RankError, run
from course_lib.models import LMTrainConfig, TransformerConfig, train_reference, transformer
from course_lib.tensor_parallel import column_parallel, row_parallel
from course_lib.tensor_parallel.check import KINDS, compare_worker, dropout_worker, grad_placements_worker
from course_lib.tensor_parallel.comm import collectives_worker, ring_steps_and_bytes
from course_lib.tensor_parallel.training import train_worker

SMALL = TransformerConfig(vocab=16, seq_len=8, dim=16, heads=4, layers=2, hidden=32)


def full_linear(in_f, out_f, bias, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Linear(in_f, out_f, bias=bias)


def inputs(in_f, out_f, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, in_f, generator=g), torch.randn(3, 5, out_f, generator=g)


def linear_worker(rank, world_size, in_f, out_f, bias, groups=None):
    """Column- and row-parallel layers from one full Linear; returns what this rank computed."""
    group = None
    if groups:   # every rank creates every group (new_group is collective), then uses its own
        made = [dist.new_group(ranks) for ranks in groups]
        group = next(gr for gr, ranks in zip(made, groups) if rank in ranks)
    full = full_linear(in_f, out_f, bias)
    x, grad_y = inputs(in_f, out_f)
    col = column_parallel(full, group)
    xc = x.clone().requires_grad_()
    yc = col(xc)
    yc.backward(grad_y[..., col.shard("bias", torch.arange(out_f))])
    row = row_parallel(full, group)
    cols = torch.arange(in_f).chunk(dist.get_world_size(group))[dist.get_rank(group)]
    xr = x[..., cols].clone().requires_grad_()
    yr = row(xr)
    yr.backward(grad_y)
    grads = lambda m: [m.weight.grad, None if m.bias is None else m.bias.grad]  # noqa: E731
    return {"group_rank": dist.get_rank(group), "group_size": dist.get_world_size(group),
            "col": [yc.detach(), xc.grad, *grads(col)], "row": [yr.detach(), xr.grad, *grads(row)]}


def expected_linear(in_f, out_f, bias, r, n):
    """The unsplit layer's results, sliced by hand as rank r of n must hold them."""
    full = full_linear(in_f, out_f, bias)
    x, grad_y = inputs(in_f, out_f)
    rows, cols = torch.arange(out_f).chunk(n)[r], torch.arange(in_f).chunk(n)[r]
    xf = x.clone().requires_grad_()
    y = full(xf)
    y.backward(grad_y)
    bias_grad = full.bias.grad if bias else None
    col_w = torch.einsum("bso,bsi->oi", grad_y, x)[rows]
    col_b = grad_y.sum((0, 1))[rows] if bias else None
    # every rank's column slice got its slice of grad_y: together, all of it; f sums the input gradients
    return {"col": [y.detach()[..., rows], xf.grad, col_w, col_b],
            "row": [y.detach(), xf.grad[..., cols], full.weight.grad[:, cols], bias_grad]}


def assert_equal_results(got, want):
    for name in ("col", "row"):
        for what, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got[name], want[name]):
            if b is None:
                assert a is None, f"{name} {what}: expected no bias"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} {what}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_column_and_row_parallel_equal_the_full_linear(world_size, bias, no_leftovers):
    results = run(linear_worker, world_size, 8, 12, bias, backend="gloo", show_output=False)
    for r, got in enumerate(results):
        assert_equal_results(got, expected_linear(8, 12, bias, r, world_size))
    for got in results[1:]:   # row_parallel returns the same full output on every rank, bit for bit
        assert torch.equal(got["row"][0], results[0]["row"][0])


def test_layers_on_subgroups_use_their_group_rank():
    groups = [[0, 2], [1, 3]]   # not contiguous: rank 2 is rank 1 of its group
    results = run(linear_worker, 4, 8, 12, True, groups, backend="gloo", show_output=False)
    assert [r["group_rank"] for r in results] == [0, 0, 1, 1] and {r["group_size"] for r in results} == {2}
    for got in results:
        assert_equal_results(got, expected_linear(8, 12, True, got["group_rank"], 2))


def error_worker(rank, world_size):
    """Every misuse on a rank, and the message it gets."""
    messages = {}
    attempts = {
        "column 3 outputs": lambda: column_parallel(nn.Linear(4, 3)),
        "row 3 inputs": lambda: row_parallel(nn.Linear(3, 4)),
        "column wrong width": lambda: column_parallel(nn.Linear(4, 8))(torch.randn(2, 5)),
        "row wrong width": lambda: row_parallel(nn.Linear(4, 8))(torch.randn(2, 4)),
        "not a linear": lambda: column_parallel(nn.Conv1d(4, 4, 1)),
    }
    pair = dist.new_group([0, 1])
    if rank >= 2:
        attempts["not a member"] = lambda: column_parallel(nn.Linear(4, 4), pair)
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except (ValueError, TypeError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


def test_bad_input_gets_a_clear_error(no_leftovers):
    messages = run(error_worker, 4, backend="gloo", show_output=False)
    for m in messages:
        assert m["column 3 outputs"].startswith("ValueError") and "out_features 3" in m["column 3 outputs"]
        assert "4 ranks" in m["column 3 outputs"]
        assert "in_features 3" in m["row 3 inputs"] and "4 ranks" in m["row 3 inputs"]
        assert "full input, 4 features" in m["column wrong width"] and "(2, 5)" in m["column wrong width"]
        assert "1 of the 4 features" in m["row wrong width"] and "(2, 4)" in m["row wrong width"]
        assert m["not a linear"].startswith("TypeError") and "nn.Linear" in m["not a linear"]
    assert "not a member" in messages[2]["not a member"]


def test_without_a_process_group_the_error_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs a process group"):
        column_parallel(nn.Linear(4, 4))


CASES = [(kind, layout, sp) for kind in KINDS for layout in ("scratch", "dtensor") for sp in (False, True)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_attention_and_block_equal_the_unsplit_ones(world_size, no_leftovers):
    """Output, input gradient and every parameter's gradient (this rank's slice), from scratch and with DTensor,
    with and without sequence parallelism."""
    results = run(compare_worker, world_size, CASES, SMALL, backend="gloo", show_output=False)
    for rank, per_case in enumerate(results):
        assert set(per_case) == set(CASES)
        for case, diffs in per_case.items():
            kind = case[0]
            n_params = {"mlp": 4, "attention": 7, "block": 15}[kind]   # k has no bias
            assert len(diffs) == 2 + n_params, (case, sorted(diffs))
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] < 1e-5, f"rank {rank}, {case}: {worst} differs by {diffs[worst]:.2e}"


def test_bias_free_blocks_equal_the_unsplit_ones():
    cases = [("block", layout, sp) for layout in ("scratch", "dtensor") for sp in (False, True)]
    results = run(compare_worker, 2, cases, SMALL.with_(bias=False), backend="gloo", show_output=False)
    for per_case in results:
        for case, diffs in per_case.items():
            assert len(diffs) == 2 + 10 and max(diffs.values()) < 1e-5, (case, diffs)   # 5 biases fewer


def test_heads_must_divide_by_the_ranks():
    cfg = TransformerConfig(dim=12, heads=3, hidden=12, seq_len=4)
    with pytest.raises(RankError, match="3 heads do not divide by the 2 ranks"):
        run(compare_worker, 2, [("attention", "scratch", False)], cfg, backend="gloo", show_output=False)


def test_dtensor_issues_the_same_collectives_as_the_scratch_layers():
    cases = [case for case in CASES if case[0] != "attention"] + [("attention", "dtensor-unprepared", False)]
    logs = run(collectives_worker, 2, cases, SMALL, backend="gloo", show_output=False)[0]
    act = 2 * SMALL.seq_len * SMALL.dim * 4                          # one (batch, seq, dim) float32 activation
    assert logs["mlp", "scratch", False] == [("all-reduce", act, "forward"), ("all-reduce", act, "backward")]
    two_each = [("all-reduce", act, "forward")] * 2 + [("all-reduce", act, "backward")] * 2
    assert logs["block", "scratch", False] == two_each
    sp_pass = [("all-gather", act), ("reduce-scatter", act)] * 2
    passes = [(*c, "forward") for c in sp_pass] + [(*c, "backward") for c in sp_pass]
    vector = SMALL.dim * 4                                           # one LayerNorm weight, or one bias
    # after backward, the partial gradients: both LayerNorms' weights and biases, and the two row-parallel
    # biases from scratch; DTensor computes those biases' gradients whole, and reduces only the LayerNorms'
    assert logs["block", "scratch", True] == passes + [("all-reduce", vector, "gradient sync")] * 6
    assert logs["block", "dtensor", True] == passes + [("all-reduce", vector, "gradient sync")] * 4
    activations = lambda log: [c for c in log if c[2] != "gradient sync"]  # noqa: E731
    for kind in ("mlp", "block"):
        for sp in (False, True):
            assert activations(logs[kind, "dtensor", sp]) == activations(logs[kind, "scratch", sp]), (kind, sp)
    # without the PrepareModuleInput, q, k and v each reduce their input's gradient: three all-reduces, not one
    assert logs["attention", "dtensor-unprepared", False] == [("all-reduce", act, "forward")] + \
        [("all-reduce", act, "backward")] * 3
    # the all-gather and the reduce-scatter together send what the all-reduce did
    ar = ring_steps_and_bytes("all-reduce", act, 4)[1]
    assert ring_steps_and_bytes("all-gather", act, 4)[1] + ring_steps_and_bytes("reduce-scatter", act, 4)[1] == ar


def test_dtensor_leaves_sequence_parallel_layernorm_gradients_partial_and_clipping_still_sees_the_right_norm():
    results = run(grad_placements_worker, 2, SMALL, backend="gloo", show_output=False)
    for r in results:
        placements = r["placements"]
        for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"):
            assert placements[name] == ("(Replicate(),)", "(Partial(sum),)"), name
        for name in ("attn.out.bias", "mlp.down.bias"):   # from scratch: partial sums, all-reduced by hand
            assert placements[name] == ("(Replicate(),)", "(Replicate(),)"), name
        assert placements["mlp.up.weight"] == ("(Shard(dim=0),)", "(Shard(dim=0),)")
        assert r["norm"] == pytest.approx(r["unsplit norm"], rel=1e-5)
        assert r["norm collectives"] and set(r["norm collectives"]) == {"all-reduce"}   # reduced inside the norm


TRAIN = LMTrainConfig(model=SMALL.with_(seq_len=16, dim=32, hidden=64), steps=4, batch_size=8, n=64,
                      optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("layout, world_size", [("tp", 2), ("dtensor", 2), ("2d", 4)])
def test_training_split_equals_one_process(layout, world_size, no_leftovers):
    reference = train_reference(TRAIN)
    results = run(train_worker, world_size, TRAIN, layout, 2, reference["state"], backend="gloo",
                  show_output=False)
    for r in results:
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    if layout == "tp":
        assert all(r["max_diff"] < 1e-6 for r in results)
    else:
        state = results[0]["state"]
        assert state.keys() == reference["state"].keys()
        for k, v in state.items():
            torch.testing.assert_close(v, reference["state"][k], rtol=1e-5, atol=1e-6, msg=k)
    if layout == "2d":   # TP halves the split weights' rows, FSDP2 halves them again; the rest is halved once
        up = (TRAIN.model.hidden, TRAIN.model.dim)
        assert all(r["shapes"]["blocks.0.mlp.up.weight"] == (up[0] // 4, up[1]) for r in results)
        assert all(r["shapes"]["tok_emb.weight"] == (TRAIN.model.vocab // 2, TRAIN.model.dim) for r in results)
    if layout != "tp":   # the first step's gradients, gathered whole
        for k, grad in results[0]["first_grads"].items():
            torch.testing.assert_close(grad, reference["first_grads"][k], rtol=1e-5, atol=1e-7, msg=k)


def test_2d_run_with_adamw_gives_the_same_losses_and_learns():
    cfg = TRAIN.with_(optimizer="adamw", lr=1e-2, steps=10, batch_size=16, n=128)
    reference = train_reference(cfg)
    results = run(train_worker, 4, cfg, "2d", backend="gloo", show_output=False)
    assert results[0]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert sum(reference["losses"][-3:]) < sum(reference["losses"][:3]) - 0.15
    # Adam turns rounding noise in near-zero gradients into visible steps: equal to ~1e-5, not ~1e-8
    assert max((results[0]["state"][k] - v).abs().max().item() for k, v in reference["state"].items()) < 1e-4
    # the first step's gradients agree to float32 rounding; Adam's first step, lr·g/(|g|+eps), magnifies it
    ref, got = reference["first_grads"], results[0]["first_grads"]
    assert max((got[k] - g).abs().max().item() for k, g in ref.items()) < 1e-7
    adam = lambda g: cfg.lr * g / (g.abs() + 1e-8)  # noqa: E731
    adam_gap = max((adam(got[k]) - adam(g)).abs().max().item() for k, g in ref.items())
    sgd_gap = max(cfg.lr * (got[k] - g).abs().max().item() for k, g in ref.items())
    assert adam_gap >= 100 * sgd_gap


DROPOUT_CASES = [(layout, sp, True, True) for layout in ("scratch", "dtensor") for sp in (False, True)]


def test_dropout_rule_replicated_masks_agree_sharded_masks_differ_and_none_repeats(no_leftovers):
    broken = [("scratch", False, False, True), ("dtensor", False, False, True), ("dtensor", True, False, True),
              ("scratch", False, True, False)]
    results = run(dropout_worker, 2, DROPOUT_CASES + broken, backend="gloo", show_output=False)
    same = lambda case, key, step, block, i=None: torch.equal(  # noqa: E731  rank 0's mask against rank 1's
        *[(r[case][key][step][block] if i is None else r[case][key][step][block][i]) for r in results])
    for case in DROPOUT_CASES:
        sp, r0 = case[1], results[0][case]
        for step in range(2):
            for block in range(2):
                assert not same(case, "attention", step, block), case   # each rank's heads: masks of their own
                for i in range(2):   # whole activations: one mask on every rank; sequence slices: their own
                    assert same(case, "residual", step, block, i) != sp, (case, step, block, i)
        # one stream per rank, advancing: block 1 does not repeat block 0, step 1 does not repeat step 0
        assert not torch.equal(r0["attention"][0][0], r0["attention"][0][1]), case
        assert not torch.equal(r0["attention"][0][0], r0["attention"][1][0]), case
        assert not torch.equal(r0["residual"][0][0][0], r0["residual"][0][1][0]), case
        assert not torch.equal(r0["residual"][0][0][0], r0["residual"][1][0][0]), case
        if not sp:   # every rank holds the same block output
            assert all(torch.equal(a, b) for a, b in zip(r0["output"], results[1][case]["output"])), case
        kept = torch.cat([r[case]["attention"][0][0].float().flatten() for r in results]).mean().item()
        assert 0.4 < kept < 0.8   # about half dropped (plus the causal zeros, which count as kept)
    # one generator for everything (from scratch, or parallelize_module as it is): rank 1's heads copy rank 0's
    for case in broken[:3]:
        assert same(case, "attention", 0, 0) and same(case, "attention", 1, 1), case
    assert same(broken[2], "residual", 0, 0, 0)   # ...and sequence parallelism's slices share their masks
    # different global seeds: the replicated output drifts apart
    assert not torch.equal(results[0][broken[3]]["output"][0], results[1][broken[3]]["output"][0])


def stream_worker(rank, world_size):
    """Which dropouts the from-scratch model and the DTensor build use, and how many streams they share."""
    from course_lib.tensor_parallel import ShardedDropout, tensor_parallel_transformer
    from course_lib.tensor_parallel.training import build
    cfg = LMTrainConfig(model=SMALL.with_(dropout=0.1))
    out = {}
    for layout, model in (("tp", tensor_parallel_transformer(transformer(cfg.model))),
                          ("dtensor", build(cfg, "dtensor", world_size)[0])):
        sharded = [m for m in model.modules() if isinstance(m, ShardedDropout)]
        out[layout] = (len(sharded), len({id(m.rng) for m in sharded}), {m.rng.seed for m in sharded},
                       type(model.blocks[0].attn.resid_dropout).__name__, type(model.dropout).__name__)
    return out


def test_a_model_shares_one_stream_per_rank():
    results = run(stream_worker, 2, backend="gloo", show_output=False)
    for rank, r in enumerate(results):
        for layout in ("tp", "dtensor"):   # one attention dropout per block, all drawing from one generator
            assert r[layout] == (SMALL.layers, 1, {2718 + rank}, "Dropout", "Dropout"), (layout, r[layout])


def test_sharded_dropout_alone():
    from course_lib.tensor_parallel import RankGenerator, ShardedDropout, use_sharded_dropout
    model = use_sharded_dropout(transformer(SMALL.with_(dropout=0.5)), RankGenerator(0, 1), True)
    assert type(model.dropout) is nn.Dropout   # the embeddings' dropout acts on whole activations
    assert all(isinstance(m, ShardedDropout) for b in model.blocks
               for m in (b.attn.attn_dropout, b.attn.resid_dropout, b.mlp.dropout))
    rng = RankGenerator(0, 0)
    a, b = ShardedDropout(0.5, rng), ShardedDropout(0.5, rng)
    x = torch.ones(64)
    assert not torch.equal(a(x), b(x))                                   # one stream: the second draws further on
    assert set(a(x).unique().tolist()) <= {0.0, 2.0} and torch.equal(a.eval()(x), x)
    again = ShardedDropout(0.5, RankGenerator(0, 0))
    assert torch.equal(again(x), ShardedDropout(0.5, RankGenerator(0, 0))(x))   # a seed, its masks: reproducible
    with pytest.raises(TypeError, match="RankGenerator"):
        ShardedDropout(0.5, 0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ShardedDropout(1.0, rng)


def test_sequence_parallelism_shards_the_layernorm_and_dropout_activations():
    from course_lib.memory.activations import split_block_worker
    b, s, d, n = 2, SMALL.seq_len, SMALL.dim, 2
    kept, with_dropout = run(split_block_worker, n, [SMALL, SMALL.with_(dropout=0.1)], backend="gloo",
                             show_output=False)[0]
    stats = lambda saved, seq: [x for x in saved if x.shape == (b, seq, 1)]  # noqa: E731  LayerNorm mean, 1/std
    assert len(stats(kept[False], s)) == 4 and stats(kept[True], s) == [] and len(stats(kept[True], s // n)) == 4
    total = {sp: sum(x.nbytes for x in saved) for sp, saved in kept.items()}
    # the two LayerNorms' inputs (b, s, d) and statistics (4 of (b, s)) shrink to s/N positions; nothing else changes
    assert total[False] - total[True] == (n - 1) / n * (2 * b * s * d + 4 * b * s) * 4
    masks = [x for x in with_dropout[True] if x.dtype == "bool" and x.shape == (b, s // n, d)]
    assert len(masks) == 2   # the residual dropouts' masks: a sequence slice each...
    count = lambda saved, shape: sum(1 for x in saved if x.shape == shape)  # noqa: E731
    assert count(with_dropout[False], (b, s, d)) - count(kept[False], (b, s, d)) == 2   # ...whole without SP


def test_saved_tensors_counts_each_storage_once_and_skips_parameters():
    from course_lib.memory import saved_bytes, saved_tensors
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    _, saved = saved_tensors(lambda t: torch.tanh(lin(t)), x, exclude=list(lin.parameters()))
    assert sorted(s.nbytes for s in saved) == [4 * 8 * 4] * 2   # the input (for the weight grad), tanh output
    assert saved_bytes(lambda t: (t * t).sum(), x) == 4 * 8 * 4           # x saved twice, one storage


def test_pictures_show_who_holds_what():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.tensor_parallel.dtensor import placements_worker
    from course_lib.tensor_parallel.training import holdings_worker
    from course_lib.viz.tensor_parallel import draw_holdings, draw_local_parts, draw_matmul_split, holders

    for kind in ("column", "row"):
        texts = [t.get_text() for t in draw_matmul_split(kind, 2).axes[0].texts]
        assert "r0" in texts and "r1" in texts
    with pytest.raises(ValueError, match="column"):
        draw_matmul_split("diagonal")
    parts = run(placements_worker, 2, backend="gloo", show_output=False)
    whole = torch.arange(16.0).view(4, 4)
    assert torch.equal(torch.cat([p["placements"]["Shard(0)"] for p in parts]), whole)
    assert torch.equal(torch.cat([p["placements"]["Shard(1)"] for p in parts], 1), whole)
    assert torch.equal(sum(p["placements"]["Partial()"] for p in parts), whole)
    moves = parts[0]["redistribute"]
    assert [moves[k][1] for k in moves] == [["all-gather"], ["all-reduce"], ["reduce-scatter"], []]
    assert torch.equal(moves["Partial() → Replicate()"][0], whole)
    fig = draw_local_parts({"Shard(0)": ("Shard", [p["placements"]["Shard(0)"] for p in parts])})
    assert [t.get_text() for t in fig.axes[1].texts][:4] == ["8", "9", "10", "11"]

    cfg = LMTrainConfig(model=TransformerConfig(vocab=8, seq_len=8, dim=4, heads=2, layers=1, hidden=8))
    names = ["blocks.0.mlp.up.weight", "blocks.0.mlp.down.weight", "tok_emb.weight"]
    held = run(holdings_worker, 4, cfg, names, backend="gloo", show_output=False)
    weights = {n: (held[0][n][0], [h[n][1] for h in held]) for n in names}
    up = holders(weights[names[0]][1], 32)               # (8, 4): TP splits the rows, FSDP2 each half again
    assert [up[4 * row][0] for row in range(8)] == [0, 0, 2, 2, 1, 1, 3, 3]
    down = holders(weights[names[1]][1], 32)             # (4, 8): TP splits the columns, FSDP2 the rows
    assert [down[i] for i in (0, 4, 16, 20)] == [[0], [1], [2], [3]]
    assert all(h in ([0, 1], [2, 3]) for h in holders(weights[names[2]][1], 32))   # FSDP2 only: pairs share
    # FSDP2 cut each tp half, so dp's shard of the whole weight is interleaved: a strided shard
    assert held[0][names[0]][2].startswith("(_StridedShard(dim=0") and held[0][names[0]][2].endswith(", Shard(dim=0))")
    assert held[0][names[1]][2] == "(Shard(dim=0), Shard(dim=1))" and held[0][names[2]][2] == "(Shard(dim=0),)"
    assert len(draw_holdings(weights).axes) == 4


def test_the_benchmark_worker_times_both_versions():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "tp_vs_dtensor.py")
    spec = importlib.util.spec_from_file_location("tp_vs_dtensor", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = run(bench.worker, 2, 32, 256, 2, 1, backend="gloo", show_output=False)[0]
    assert set(times) == {"from scratch", "parallelize_module"} and all(t > 0 for t in times.values())


def test_korthikanti_activation_formulas():
    from course_lib.tensor_parallel.sequence import korthikanti_activation_bytes as act
    s, b, h, a = 2048, 1, 12288, 96               # GPT-3: 5as/h = 80
    sbh = s * b * h
    assert act(s, b, h, a) == pytest.approx(sbh * (34 + 80)) == act(s, b, h, a, 1, True)   # t=1: SP changes nothing
    assert act(s, b, h, a, 8) == pytest.approx(sbh * (10 + 24 / 8 + 80 / 8))
    assert act(s, b, h, a, 8, True) == pytest.approx(sbh * (34 / 8 + 80 / 8))
    assert act(s, b, h, a, 8, True, attention_scores=False) == pytest.approx(sbh * 34 / 8)
    assert act(s, b, h, a, 8, False, attention_scores=False) == pytest.approx(sbh * (10 + 24 / 8))


def test_the_cost_model_counts_what_the_layers_send_and_prices_nodes_with_two_levels():
    from course_lib.comm import costmodel
    from course_lib.tensor_parallel import cost
    # what section 4 of notebook 11 counts on real ranks, in bf16 at GPT-3 size
    assert cost.layer_collectives(1, 2048, 12288) == [("all-reduce", 2048 * 12288 * 2, p)
                                                      for p in ("forward", "forward", "backward", "backward")]
    # forward: 2 FLOPs per multiply-add, 4h² (q, k, v, out) + 8h² (MLP) per token, 4·s·h for the attention
    h, s = 64, 32
    assert cost.layer_flops(1, s, h) == 3 * (2 * s * 12 * h * h + 4 * s * s * h)
    act = 2048 * 12288 * 2
    assert cost.allreduce_seconds(act, 8) == pytest.approx(costmodel.predict("ring", act, 8, *cost.NVLINK))
    assert cost.allreduce_seconds(act, 16) == pytest.approx(
        costmodel.predict_two_level(act, 8, 2, cost.NVLINK, cost.INFINIBAND))
    with pytest.raises(ValueError, match="multiple of 8"):
        cost.allreduce_seconds(act, 12)
    one, eight = cost.layer_time(1, 2048, 12288, 1), cost.layer_time(1, 2048, 12288, 8)
    assert one["comm"] == 0 and one["efficiency"] == 1
    assert eight["compute"] == pytest.approx(one["compute"] / 8)
    assert eight["efficiency"] == pytest.approx(eight["compute"] / (eight["compute"] + eight["comm"]))


def test_comm_over_compute_is_the_cost_model_without_alpha_and_attention_scores():
    from course_lib.tensor_parallel import cost
    h, s = 12288, 2048
    for t in (2, 4, 8):
        full = cost.layer_time(1, s, h, t, intra=(0.0, cost.NVLINK[1]))
        matmuls = 72 * s * h * h / t / cost.H100_BF16_DENSE_FLOPS         # layer_flops without the scores
        assert full["comm"] / matmuls == pytest.approx(cost.comm_over_compute(t, h), rel=1e-9)
    assert cost.comm_over_compute(8, h) == pytest.approx(2 / 9 * 7 * 989e12 / (h * 450e9))


def test_the_efficiency_at_40_percent_of_peak():
    from course_lib.tensor_parallel import cost
    slow = {t: cost.layer_time(1, 2048, 12288, t, flops_per_s=0.4 * cost.H100_BF16_DENSE_FLOPS)["efficiency"]
            for t in (8, 16)}
    assert round(slow[8], 2) == 0.89 and round(slow[16], 2) == 0.72


def test_recomputation_repeats_the_forward_all_reduces():
    from course_lib.models import TransformerConfig
    from course_lib.tensor_parallel import comm
    logs = run(comm.collectives_worker, 2, [("block", "scratch", False)], TransformerConfig(), 2, 0,
               [("block", "scratch", False, "full"), ("block", "scratch", False, "early stop")],
               backend="gloo", show_output=False)[0]
    phases = {k: [p for _, _, p in v] for k, v in logs.items()}
    assert phases["block", "scratch", False].count("backward") == 2
    assert phases["block", "scratch", False, "full"].count("backward") == 4        # 2 recomputed + f's 2
    assert phases["block", "scratch", False, "early stop"].count("backward") == 3  # the last g is skipped


def test_the_notebook_11_pictures_name_what_they_draw():
    from course_lib.viz import megatron
    texts = [t.get_text() for t in megatron.draw_megatron_block(2).axes[0].texts]
    assert texts.count("f") == 2 and texts.count("g") == 2 and "fwd: identity\nbwd: all-reduce" in texts
    fig = megatron.draw_tp_efficiency({"peak": {1: 1.0, 8: 0.76, 16: 0.5}}, 8)
    assert any("across nodes" in t.get_text() for t in fig.axes[0].texts)
    assert [line.get_label() for line in fig.axes[0].get_lines()][0] == "peak"


def embedding_dropout_worker(rank, world_size):
    """Under 2d-sp the embedding dropout's input is this rank's sequence slice: its mask, per tp rank."""
    from course_lib.tensor_parallel import ShardedDropout
    from course_lib.tensor_parallel.training import build
    cfg = LMTrainConfig(model=SMALL.with_(dropout=0.5), steps=1, batch_size=4, n=8)
    model, *_ = build(cfg, "2d-sp", world_size)
    seen = {}
    model.dropout.register_forward_hook(lambda m, i, o: seen.update(x=i[0], y=o))
    model(torch.zeros(2, SMALL.seq_len, dtype=torch.long))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t   # noqa: E731
    x, y = local(seen["x"]), local(seen["y"])
    return type(model.dropout) is ShardedDropout, tuple(x.shape), (y == 0).cpu()


def test_the_embedding_dropout_of_the_sp_plan_draws_a_mask_per_rank():
    r = run(embedding_dropout_worker, 4, backend="gloo", show_output=False)
    assert all(sharded for sharded, _, _ in r)
    assert r[0][1] == (2, SMALL.seq_len // 2, SMALL.dim)        # a sequence slice
    assert not torch.equal(r[0][2], r[1][2])                     # the tp pair: different masks
