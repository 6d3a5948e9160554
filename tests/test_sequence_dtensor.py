"""Notebook 12's library: this course's sequence parallelism's activation formula, DTensor's Partial gradients
reduced on every read (and the remedy), and the per-rank dropout stream under activation recomputation."""
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from course_lib.launch import run
from course_lib.tensor_parallel import dtensor
from course_lib.tensor_parallel.random import RankGenerator, ShardedDropout, checkpoint
from course_lib.tensor_parallel.sequence import korthikanti_activation_bytes as act


def test_the_formula_of_this_courses_sequence_parallelism_keeps_the_gathered_inputs_whole():
    sbh = 2048 * 12288
    for t in (1, 2, 8):
        megatron = act(2048, 1, 12288, 96, t, True, regather=True)
        ours = act(2048, 1, 12288, 96, t, True, regather=False)
        assert ours - megatron == pytest.approx(4 * sbh * (1 - 1 / t))   # the two gathered inputs, 2 B × sbh each
    cut = lambda t, scores, regather: 1 - act(2048, 1, 12288, 96, t, True, scores, regather) / act(  # noqa: E731
        2048, 1, 12288, 96, t, False, scores)
    assert round(cut(8, True, True), 2) == 0.38 and round(cut(8, False, True), 2) == 0.67   # the paper's
    assert round(cut(8, True, False), 2) == 0.23 and round(cut(8, False, False), 2) == 0.40  # without the re-gather


def test_partial_gradients_are_reduced_on_every_read_unless_reduced_once():
    plain = run(dtensor.partial_grad_reads_worker, 2, None, False, show_output=False)
    fixed = run(dtensor.partial_grad_reads_worker, 2, None, True, show_output=False)
    assert plain[0]["counts"] == [{"remedy": 0, "clip": 5, "step": 12}] * 2   # 4 Partial grads × 3 reads, + clip
    assert fixed[0]["counts"] == [{"remedy": 4, "clip": 1, "step": 0}] * 2
    for a, b in zip(plain, fixed):   # the same training either way
        assert all(torch.allclose(a["weights"][k], b["weights"][k], atol=1e-6) for k in a["weights"])
    parts = [r["local"] for r in plain]   # grad.to_local() of a Partial gradient: a partial sum
    assert not torch.allclose(parts[0], plain[0]["unsplit"], atol=1e-4)
    assert torch.allclose(parts[0] + parts[1], plain[0]["unsplit"], atol=1e-4)


class Dropped(nn.Module):
    def __init__(self, rng):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 8), ShardedDropout(0.5, rng)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def grad_and_next_mask(how):
    rng = RankGenerator(0, 1)
    model = Dropped(rng)
    x = torch.linspace(-1, 1, 32).view(4, 8).requires_grad_()
    if how == "plain":
        out = model(x)
    elif how == "torch":
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    else:
        out = checkpoint(model, x, rng=rng)
    out.square().sum().backward()
    return x.grad, torch.rand(4, generator=rng.generator("cpu"))


def test_recomputation_replays_the_rank_streams_masks_only_with_its_checkpoint():
    plain, torchs, ours = (grad_and_next_mask(h) for h in ("plain", "torch", "ours"))
    assert not torch.allclose(torchs[0], plain[0])   # torch's checkpoint: a new mask in the recomputation
    assert torch.equal(ours[0], plain[0])            # ours: the same mask, the right input gradient...
    assert torch.equal(ours[1], plain[1])            # ...and the stream goes on where the forward left it


def test_rank_generator_state_round_trip():
    rng = RankGenerator(3, 0)
    state = rng.get_state()                          # before the stream exists: restoring re-seeds it
    first = torch.rand(3, generator=rng.generator("cpu"))
    rng.set_state(state)
    assert torch.equal(torch.rand(3, generator=rng.generator("cpu")), first)
    mid = rng.get_state()
    second = torch.rand(3, generator=rng.generator("cpu"))
    rng.set_state(mid)
    assert torch.equal(torch.rand(3, generator=rng.generator("cpu")), second)


def test_the_production_plan_equals_one_process_and_never_gathers_the_logits():
    from course_lib.tensor_parallel import production
    for r in run(production.production_worker, 2, show_output=False):
        assert r["loss"] < 1e-6 and max(r["grads"].values()) < 1e-5
        assert r["logits"] == ("(Shard(dim=2),)", (2, 8, 32))          # vocabulary-sharded, never whole
        assert all(nbytes < r["logits bytes"] for _, nbytes, _ in r["collectives"])
        forward = [(k, n) for k, n, phase in r["collectives"] if phase == "forward"]
        assert forward[:2] == [("reduce-scatter", 2048), ("reduce-scatter", 1024)]   # tok_emb, pos_emb
        assert forward[-3:] == [("all-reduce", 2 * 8 * 4)] * 3                      # loss_parallel: per position


@pytest.mark.parametrize("n", [2, 4])
def test_megatrons_regather_keeps_a_slice_for_one_more_all_gather(n):
    from course_lib.tensor_parallel.sequence import regather_worker
    for r in run(regather_worker, n, show_output=False):
        whole = 2 * 8 * 16 * 4                          # the (batch, seq, dim) float32 input
        assert r["gather, then F.linear"]["kept bytes"] == whole
        assert r["re-gather"]["kept bytes"] == whole // n   # the gap to the paper's row, closed
        assert r["gather, then F.linear"]["collectives"] == [("all-gather", "forward"), ("reduce-scatter", "backward")]
        assert r["re-gather"]["collectives"] == [("all-gather", "forward"), ("all-gather", "backward"),
                                                 ("reduce-scatter", "backward")]
        assert r["largest difference"] < 1e-6


def test_two_d_with_sequence_parallelism_and_the_production_plan_trains_like_one_process():
    from course_lib.models import LMTrainConfig, TransformerConfig, train_reference
    from course_lib.tensor_parallel import training
    cfg = LMTrainConfig(model=TransformerConfig(vocab=16, seq_len=16, dim=32, heads=4, layers=2, hidden=64),
                        steps=4, batch_size=16, n=128, optimizer="sgd", lr=0.1)
    reference = train_reference(cfg)
    mesh_run = run(training.train_worker, 4, cfg, "2d-sp", show_output=False)[0]
    assert all(abs(a - b) < 1e-5 for a, b in zip(mesh_run["losses"], reference["losses"]))
    assert max((mesh_run["first_grads"][k] - g).abs().max().item() for k, g in reference["first_grads"].items()) < 2e-7
    assert max((mesh_run["state"][k] - w).abs().max().item() for k, w in reference["state"].items()) < 1e-6
