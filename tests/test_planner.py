"""The bytes-only calculator (``course_lib.memory.planner``, which ``memory.verify`` measures against): its
predictions equal the bytes measured on the course's small transformer (ZeRO stages, DDP, tensor parallelism,
recomputation) and its arithmetic behaves; and the layout planner's widget (notebook 17, over ``course_lib.layout``,
ranked by time) is driven in code."""
import pytest
import torch

from course_lib.launch import run
from course_lib.memory import fits, training_memory
from course_lib.memory.planner import PRESETS, block_params, collectives, param_count, plan, predict
from course_lib.memory.verify import compare, measure_worker
from course_lib.models import TransformerConfig, transformer

CFG = TransformerConfig()


def test_parameter_count_is_the_models():
    for cfg in (CFG, TransformerConfig(vocab=50, seq_len=16, dim=48, heads=3, layers=3, hidden=96),
                TransformerConfig(bias=False)):
        assert param_count(cfg) == sum(p.numel() for p in transformer(cfg).parameters())
    assert block_params(CFG, 2) < block_params(CFG) / 2 + 4 * CFG.dim + 2 * CFG.dim   # LayerNorms, row biases whole


@pytest.mark.parametrize("world_size", [2, 4])
def test_calculator_equals_the_bytes_measured_on_the_course_transformer(world_size):
    measured = run(measure_worker, world_size, CFG, 2, backend="gloo", show_output=False)
    for rank in (0, world_size - 1):
        rows = compare(measured[rank], CFG, 2, world_size)
        assert len(rows) == 20
        for row in rows:
            assert row["predicted"] == row["measured"], row


def test_predictions_behave_as_the_notebooks_measured():
    cfg = PRESETS["6.7 B (32 x 4096)"]
    ddp = predict(cfg, 2048, 1, dp=8)
    assert ddp["memory"]["total"] - ddp["memory"]["activations"] == training_memory(param_count(cfg), "bf16")["total"]
    z = {stage: predict(cfg, 2048, 1, dp=8, zero=stage) for stage in (0, 1, 2, 3)}
    assert z[0]["memory"]["total"] > z[1]["memory"]["total"] > z[2]["memory"]["total"] > z[3]["memory"]["total"]
    assert z[0]["sent"]["data"] == z[1]["sent"]["data"] == z[2]["sent"]["data"] == z[3]["sent"]["data"] / 1.5
    full = predict(cfg, 2048, 1, dp=8, recompute="full")
    assert full["memory"]["activations"] < ddp["memory"]["activations"] / 10
    assert 0.2 < full["extra_compute"] < 1 / 3                  # a forward again, less its last matmul
    tp = predict(cfg, 2048, 1, tp=8)
    assert tp["sent"]["data"] == 0 and tp["sent"]["tensor"] > 0 and tp["memory"]["weights"] < ddp["memory"]["weights"]
    per_layer = collectives(cfg, 2048, 1, tp=2, recompute="full")
    assert [c[1:] for c in per_layer] == [("all-reduce", 2048 * 4096 * 2, 32)] * 5       # 4, +1 recomputed
    with pytest.raises(ValueError, match="recompute must be"):
        predict(cfg, 2048, 1, recompute="selective")


def test_plan_orders_layouts_by_memory_and_says_what_fits():
    cfg = PRESETS["6.7 B (32 x 4096)"]
    rows = plan(cfg, 2048, 1, 8, 80)
    fitting = [r for r in rows if r["fits"]]
    assert rows[:len(fitting)] == fitting and [r["gib"] for r in fitting] == sorted(r["gib"] for r in fitting)
    ddp = next(r for r in rows if r["tp"] == 1 and r["zero"] == 0 and r["recompute"] == "none")
    assert not ddp["fits"] and ddp["gib"] > 80                          # 16 bytes x 6.9 B params alone: 110 GB
    assert {r["tp"] for r in rows} == {1, 2, 4, 8}
    assert not any(r["fits"] for r in plan(PRESETS["70 B (80 x 8192)"], 4096, 1, 1, 80))
    with pytest.raises(ValueError, match="positions"):
        plan(cfg, 4096, 1, 8, 80)


def test_the_calculator_does_not_rank_by_cost_the_layout_planner_ranks_by_seconds():
    """The bytes-only order is by memory; a cost ranking needs seconds: course_lib.layout ranks by predicted step
    time (notebook 17), with fused attention for its presets."""
    import course_lib.memory.planner as planner
    assert "not a cost ranking" in planner.plan.__doc__ and "course_lib.layout.rank" in planner.plan.__doc__
    from course_lib.layout import PRESETS as LAYOUT_PRESETS
    from course_lib.layout import h100_cluster, rank
    assert all(m.attention == "fused" for m in LAYOUT_PRESETS.values())
    ranked = rank(LAYOUT_PRESETS["llama-3-70b"], h100_cluster(8), 512, micro_batches=(1, 2))
    steps = [r["time"]["step"] for r in ranked]
    assert steps == sorted(steps) and len(steps) > 3


def test_attention_option_fused_by_default_eager_keeps_the_scores():
    """70 B on 64 GPUs, TP 8 x DP 8, ZeRO-2: with the eager s² scores 80.4 GiB, over 90% of 80 GiB; fused 59.2 GiB."""
    cfg = PRESETS["70 B (80 x 8192)"]
    fused, eager = (predict(cfg, 4096, 1, tp=8, dp=8, zero=2, attention=a) for a in ("fused", "eager"))
    assert predict(cfg, 4096, 1, tp=8, dp=8, zero=2) == fused
    assert 55 < fused["memory"]["total"] / 2**30 < 62 < 72 < eager["memory"]["total"] / 2**30
    assert fits(fused["memory"], 80) and not fits(eager["memory"], 80)
    s, b, a = 4096, 1, cfg.heads
    scores = eager["memory"]["activations"] - fused["memory"]["activations"]
    per_layer = b * a * s * s * 2 // 8 + s * s - b * a * s * 4 // 8    # out's input: a view in fused
    assert scores == cfg.layers * per_layer          # softmax (split 8 ways) and mask, less the logsumexp
    with pytest.raises(ValueError, match="attention must be"):
        predict(cfg, 4096, 1, attention="flash")


def test_layout_planner_widget_is_driven_in_code():
    """The widget (notebook 17) shows course_lib.layout's ranking by time: its winner, and nothing when nothing fits."""
    from course_lib.layout import PRESETS, h100_cluster, rank
    from course_lib.viz.widgets import LayoutPlanner, layout_state
    state = layout_state("llama-3-70b", 8, 512)
    ranked = rank(PRESETS["llama-3-70b"], h100_cluster(8), 512, micro_batches=(1, 2, 4))
    assert state["best"] == ranked[0]["name"] and state["fitting"] == len(ranked)
    assert [r["name"] for r in state["rows"]] == [r["name"] for r in ranked[:8]]
    assert state["why"].startswith(ranked[0]["name"])
    p = LayoutPlanner()
    assert p.state["best"] == state["best"] and state["best"] in p.out.value and "MFU" in p.out.value
    p.nodes.value = 1                                       # 70 B on one node of 8 H100s: nothing fits
    assert p.state["best"] is None and "nothing fits" in p.out.value and "leanest needs" in p.out.value
    p.preset.value = "llama-3-8b"
    assert p.state["best"] is not None and p.state["rows"][0]["gib"] <= p.state["rows"][0]["limit_gib"]
    p.micro.value = 1
    assert all(r["layout"].micro_batch == 1 for r in p.state["rows"]) and "up to 1" in p.out.value
    p.preset.value = "tiny"
    assert "M parameters" in p.out.value
    with pytest.raises(ValueError, match="unknown model"):
        layout_state("GPT-5", 1, 1)
    with pytest.raises(ValueError, match="at least one node"):
        layout_state("tiny", 0, 8)


def test_fp32_figures_of_the_calculator_use_four_bytes():
    p = predict(CFG, 32, 2, dtype="fp32", device="cpu", attention="eager")
    assert p["memory"]["fp32 master weights"] == 0 and p["memory"]["weights"] == 4 * param_count(CFG)
    assert torch.finfo(torch.float32).bits == 32
