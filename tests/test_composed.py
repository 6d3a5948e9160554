"""Data × tensor × pipeline parallelism on 8 Gloo ranks (``course_lib.composed``): equal to one process.

One launch of 8 ranks (:func:`train_3d_runs`, about 35 s on 2 busy cores) trains four variants of the course's
small transformer (4 blocks, width 32, sequences of 16, a global batch of 16, 4 micro-batches, 3 steps, float64):
SGD, AdamW, and known mistakes. Every test below reads that one result.
"""
import pytest
import torch

from course_lib.composed import (
    MISTAKES,
    SMALL,
    TOLERANCE,
    check_layout,
    coords,
    groups,
    peers,
    rank_at,
    reference,
    stage_blocks,
    train_3d_runs,
    train_3d_worker,
)
from course_lib.launch import RankError, run
from course_lib.models.transformer import train_reference

ADAMW = SMALL.with_(optimizer="adamw", lr=1e-2)
VARIANTS = {"sgd": {}, "adamw": {"cfg": ADAMW}, "no_microbatch_scaling": {"mistake": "no_microbatch_scaling"},
            "dp_sum": {"mistake": "dp_sum"}, "adamw_dp_sum": {"cfg": ADAMW, "mistake": "dp_sum"}}


@pytest.fixture(scope="module")
def runs():
    """``{variant: [rank 0's result, ..., rank 7's]}``."""
    results = run(train_3d_runs, 8, *VARIANTS.values(), backend="gloo", timeout=240, show_output=False)
    return {name: [per_rank[i] for per_rank in results] for i, name in enumerate(VARIANTS)}


def test_coordinates_are_row_major_with_tp_fastest():
    assert coords(5, 2, 2, 2) == {"pp": 1, "dp": 0, "tp": 1}       # 5 = 0b101
    assert coords(6, 2, 2, 2) == {"pp": 1, "dp": 1, "tp": 0}
    assert coords(0, 2, 2, 2) == {"pp": 0, "dp": 0, "tp": 0}
    assert coords(7, 2, 2, 2) == {"pp": 1, "dp": 1, "tp": 1}
    assert coords(5, 3, 2, 1) == {"pp": 2, "dp": 1, "tp": 0}       # 6 ranks, 3 stages of 2 replicas
    assert coords(9, 2, 3, 2) == {"pp": 1, "dp": 1, "tp": 1}       # 9 = (1*3 + 1)*2 + 1
    assert all(rank_at(coords(r, 2, 3, 2), 2, 3, 2) == r for r in range(12))
    with pytest.raises(ValueError, match="rank 8 is not on a mesh of 8 ranks"):
        coords(8, 2, 2, 2)


def test_groups_are_the_ranks_that_differ_along_one_dimension():
    assert groups(2, 2, 2) == {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                               "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                               "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert peers(5, 2, 2, 2) == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
    assert groups(1, 2, 4) == {"pp": [[r] for r in range(8)], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                               "tp": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    assert groups(2, 4, 1)["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sizes_that_do_not_divide_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="needs 4 ranks, not 8"):
        check_layout(8, SMALL, 2, 2, 1, 4)
    with pytest.raises(ValueError, match="3 equal pipeline stages"):
        check_layout(12, SMALL, 3, 2, 2, 4)
    with pytest.raises(ValueError, match="at least 1 rank"):
        check_layout(8, SMALL, 0, 2, 2, 4)
    with pytest.raises(ValueError, match="divides by 24"):
        check_layout(8, SMALL, 2, 2, 2, 12)
    with pytest.raises(ValueError, match="heads"):
        check_layout(8, SMALL.with_(model=SMALL.model.with_(heads=1)), 2, 2, 2, 4)
    with pytest.raises(ValueError, match="dropout=0"):
        check_layout(8, SMALL.with_(model=SMALL.model.with_(dropout=0.1)), 2, 2, 2, 4)
    assert stage_blocks(4, 2, 1) == range(2, 4)
    with pytest.raises(RankError, match="needs 8 ranks, not 4"):     # the worker checks first, on every rank
        run(train_3d_worker, 4, backend="gloo", show_output=False)


def test_the_reference_is_train_reference_in_another_precision():
    ours, theirs = reference(SMALL, torch.float32), train_reference(SMALL)
    assert ours["losses"] == theirs["losses"]
    assert all(torch.equal(v, theirs["state"][k]) for k, v in ours["state"].items())
    assert reference(SMALL)["state"]["head.weight"].dtype == torch.float64


@pytest.mark.parametrize("variant", ["sgd", "adamw"])
def test_three_dimensions_end_with_the_weights_of_one_process(runs, variant):
    """Every rank compares its stage's gathered weights with one process's: within TOLERANCE (1e-10, float64).

    Measured: SGD ~3e-17 (a few float64 roundings); AdamW ~2e-14, larger because Adam divides by the gradient's
    own size: its first step is lr·g/(|g| + eps), whose slope lr/eps = 1e6 at g = 0 turns a rounding difference of
    ~1e-19 in a near-zero gradient into ~1e-13 of weight. Both far below the tolerance.
    """
    results = runs[variant]
    assert [r["coords"] for r in results] == [coords(r, 2, 2, 2) for r in range(8)]
    for r in results:
        assert r["max_diff"] < TOLERANCE, (r["coords"], r["worst"], r["max_diff"])
        assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-12)
    if variant == "sgd":
        assert max(r["max_diff"] for r in results) < 1e-14
    first, last = results[0]["names"], results[4]["names"]       # stage 0 and stage 1 hold the whole model
    assert sorted(first + last) == sorted(reference(SMALL)["state"])
    assert first[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert last[-3:] == ["ln_f.weight", "ln_f.bias", "head.weight"]


def test_each_rank_holds_an_eighth_of_a_split_weight_and_a_quarter_of_the_rest(runs):
    m = SMALL.model
    for r in runs["sgd"]:
        shapes = r["shapes"]
        if r["coords"]["pp"] == 0:
            assert shapes["blocks.0.mlp.up.weight"] == (m.hidden // 4, m.dim)    # tp halves the rows, dp again
            assert shapes["blocks.1.attn.out.weight"] == (m.dim // 2, m.dim // 2)   # tp: columns, dp: rows
            assert shapes["tok_emb.weight"] == (m.vocab // 2, m.dim)               # dp only
            assert r["placements"]["tok_emb.weight"] == "(Shard(dim=0),)"
            assert r["placements"]["blocks.1.mlp.down.weight"] == "(Shard(dim=0), Shard(dim=1))"
            assert r["placements"]["blocks.0.ln2.bias"] == "(Shard(dim=0), Replicate())"
        else:
            assert shapes["head.weight"] == (m.vocab // 2, m.dim)


@pytest.mark.parametrize("mistake", [m for m in MISTAKES if m])
def test_the_comparison_catches_a_known_mistake(runs, mistake):
    """Without the 1/m of the micro-batches, or with the dp sum left undivided, the gradients are 4 or 2 times too
    large: the weights end ~1e-1 away, 1e9 times the tolerance, and the losses of steps 2 and 3 differ."""
    for r in runs[mistake]:
        assert r["max_diff"] > 1e6 * TOLERANCE
        assert r["losses"][0] == pytest.approx(r["reference_losses"][0], rel=1e-12)   # the same start
        assert abs(r["losses"][-1] - r["reference_losses"][-1]) > 1e-3


def test_adam_nearly_hides_a_gradient_twice_too_large_but_float64_still_sees_it(runs):
    """Adam divides each gradient by its running size, so doubling every gradient changes its step only through
    eps: the weights end ~1e-3 away (SGD's: ~1e-1). AdamW's own rounding in float32 (~3e-5) would come within a
    factor of 50 of that; in float64 (~1e-14) the mistake stands out by 1e10."""
    wrong = max(r["max_diff"] for r in runs["adamw_dp_sum"])
    assert 1e-4 < wrong < 1e-2 and wrong < max(r["max_diff"] for r in runs["dp_sum"]) / 10
    assert min(r["max_diff"] for r in runs["adamw_dp_sum"]) > 1e6 * max(r["max_diff"] for r in runs["adamw"])


def expected_counts(stage: int, pp: int = 2, blocks: int = 2, m: int = 4) -> dict:
    """This rank's messages in one step (after the first), per group, derived by hand:

    * dp (FSDP2): one unit per block plus the stage's own (embeddings or head): ``blocks + 1`` units. With
      ``reshard_after_forward=False`` a unit is all-gathered once, in the first micro-batch's forward, and kept
      for the step; its gradients are reduce-scattered once, when the schedule ends the step.
    * tp (sequence parallelism), per block and micro-batch: forward, an all-gather before attention and before
      the MLP, a reduce-scatter after each; backward, the mirror image (a reduce-scatter for each all-gather and
      the reverse): 2 + 2 each way. Stage 0 adds an all-gather backward (the gradient of the embeddings' output,
      which it cut into slices); the last stage an all-gather forward (the whole sequence for the final LayerNorm).
      At the end of the step, the LayerNorms' gradients, left Partial (each tp rank saw its positions only), are
      all-reduced: weight and bias of ln1 and ln2, 4 per block.
    * pp (point-to-point), per micro-batch: a stage sends its activations forward and receives their gradient
      (the first stage), or receives and sends back (the last); a middle stage does both.
    """
    first, last = stage == 0, stage == pp - 1
    tp_gathers = m * (2 * blocks + 2 * blocks + first + last)
    neighbours = (stage > 0) + (stage < pp - 1)
    return {"dp": {"all-gather": blocks + 1, "reduce-scatter": blocks + 1},
            "pp": {"recv": m * neighbours, "send": m * neighbours},
            "tp": {"all-gather": tp_gathers, "all-reduce": 4 * blocks, "reduce-scatter": m * 4 * blocks}}


@pytest.mark.parametrize("variant", ["sgd", "adamw"])
def test_each_group_runs_the_messages_derived_by_hand(runs, variant):
    for r in runs[variant]:
        assert r["counts"] == expected_counts(r["coords"]["pp"]), r["coords"]
    phases = runs[variant][0]["phases"]        # stage 0: where in the step they run
    assert phases["tp"]["forward"] == {"all-gather": 8 * 2, "reduce-scatter": 8 * 2}
    assert phases["tp"]["backward"] == {"all-gather": 8 * 2 + 4, "reduce-scatter": 8 * 2}
    assert phases["dp"]["forward"] == {"all-gather": 3}      # the reduce-scatters: when the schedule ends the step
    assert sum(p.get("reduce-scatter", 0) for p in phases["dp"].values()) == 3   # ("between" in torch 2.13)


def test_sequence_parallelism_makes_the_pipeline_messages_a_slice_of_the_sequence(runs):
    m = SMALL.model
    micro = SMALL.batch_size // 2 // 4                    # a dp replica's slice in 4 micro-batches
    one = micro * (m.seq_len // 2) * m.dim * 8            # (micro, seq/tp, dim) in float64
    for r in runs["sgd"]:
        assert r["bytes"]["pp"] == {"recv": 4 * one, "send": 4 * one}
