"""The small transformer: shapes, causality, its blocks alone, built from a seed, and its loss falls."""
import pytest
import torch
import torch.nn as nn

from course_lib.data import make_token_dataset
from course_lib.models import (
    MLP,
    CausalSelfAttention,
    LMTrainConfig,
    TransformerConfig,
    lm_loss,
    train_reference,
    transformer,
)

CFG = TransformerConfig(vocab=16, seq_len=12, dim=32, heads=4, layers=2, hidden=64)


def test_shapes_and_parameter_count():
    model = transformer(CFG)
    logits = model(torch.randint(16, (3, 12)))
    assert logits.shape == (3, 12, 16)
    assert model(torch.randint(16, (2, 5))).shape == (2, 5, 16)   # shorter sequences work too
    per_block = 4 * 32 * 32 + 3 * 32 + (32 * 64 + 64) + (64 * 32 + 32) + 2 * (2 * 32)
    expected = 16 * 32 + 12 * 32 + 2 * per_block + 2 * 32 + 32 * 16
    assert sum(p.numel() for p in model.parameters()) == expected


def test_attention_is_causal():
    """Changing a later token changes no earlier position's output."""
    model = transformer(CFG).eval()
    a = torch.randint(16, (1, 12))
    b = a.clone()
    b[0, 7] = (a[0, 7] + 1) % 16
    la, lb = model(a), model(b)
    assert torch.equal(la[:, :7], lb[:, :7])
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


def test_blocks_work_alone_and_attention_equals_pytorchs():
    mlp = MLP(8, 32)
    assert mlp(torch.randn(2, 5, 8)).shape == (2, 5, 8)
    attn = CausalSelfAttention(8, 2).eval()
    x = torch.randn(3, 6, 8)
    ref = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():  # the same weights in PyTorch's own attention: the same result
        ref.in_proj_weight.copy_(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]))
        ref.in_proj_bias.copy_(torch.cat([attn.q.bias, torch.zeros(8), attn.v.bias]))  # k has no bias
        ref.out_proj.weight.copy_(attn.out.weight)
        ref.out_proj.bias.copy_(attn.out.bias)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected, _ = ref(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(attn(x), expected)
    without_bias = CausalSelfAttention(8, 2, bias=False)
    assert all(m.bias is None for m in (without_bias.q, without_bias.k, without_bias.v, without_bias.out))
    assert CausalSelfAttention(8, 2).k.bias is None   # always: a key bias would get a zero gradient


def test_built_from_a_seed_without_touching_the_callers_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = transformer(CFG, seed=1), transformer(CFG, seed=1), transformer(CFG, seed=2)
    assert torch.equal(torch.rand(3), expected)          # the global generator did not move
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.q.weight"], sc["blocks.0.attn.q.weight"])


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="does not divide into heads"):
        TransformerConfig(dim=30, heads=4)
    with pytest.raises(ValueError, match="dropout"):
        TransformerConfig(dropout=1.0)
    with pytest.raises(ValueError, match="seq <= 12"):
        transformer(CFG)(torch.randint(16, (1, 13)))


def test_token_data_repeats_a_pattern_and_targets_are_shifted_inputs():
    inputs, targets = make_token_dataset(n=50, seq_len=20, vocab=10, periods=(2, 5), seed=3).tensors
    assert inputs.shape == targets.shape == (50, 20) and inputs.max() < 10
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in torch.cat([inputs, targets[:, -1:]], dim=1):
        assert any(torch.equal(row[p:], row[:-p]) for p in range(2, 6))
    again, _ = make_token_dataset(n=50, seq_len=20, vocab=10, periods=(2, 5), seed=3).tensors
    assert torch.equal(inputs, again)
    with pytest.raises(ValueError, match="periods"):
        make_token_dataset(periods=(3, 2))


def test_training_is_deterministic_and_the_loss_falls():
    cfg = LMTrainConfig(model=CFG, steps=40, batch_size=16, n=256)
    first, second = train_reference(cfg), train_reference(cfg)
    assert first["losses"] == second["losses"]
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
    start, end = sum(first["losses"][:5]) / 5, sum(first["losses"][-5:]) / 5
    assert start == pytest.approx(torch.log(torch.tensor(16.0)).item(), abs=0.15)  # ln(vocab): a uniform guess
    assert end < start - 0.3, first["losses"]


def test_dropout_training_is_deterministic_too():
    cfg = LMTrainConfig(model=CFG.with_(dropout=0.1), steps=3, n=64)
    assert train_reference(cfg)["losses"] == train_reference(cfg)["losses"]
    model = transformer(CFG)
    x, y = make_token_dataset(8, 12, 16).tensors
    assert lm_loss(model(x), y).shape == ()
