"""Activation memory (measured = derived), recomputation (identical gradients, less memory), gradient
accumulation (same gradients, less memory, all-reduced once with no_sync), and the recompute benchmark's worker."""
import importlib.util
import os

import pytest
import torch

from course_lib.launch import run
from course_lib.memory import saved_bytes
from course_lib.memory.activations import (
    block_activation_bytes,
    compare_with_megatron,
    held_bytes,
    megatron_layer_bytes,
    model_activation_bytes,
)
from course_lib.memory.recompute import compare_policies, forward_ops, resolve, with_recomputation
from course_lib.models import Block, TransformerConfig, lm_loss, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = [  # batch, seq, dim, heads, hidden, dropout, dtype
    (3, 32, 64, 4, 256, 0.0, torch.float32),
    (1, 8, 16, 1, 40, 0.0, torch.float32),        # one head, batch 1: the attention matmuls take views, not copies
    (2, 17, 48, 3, 100, 0.1, torch.float32),      # odd sequence, dropout masks
    (4, 16, 32, 8, 128, 0.0, torch.bfloat16),
    (2, 16, 32, 2, 64, 0.2, torch.bfloat16),
]


@pytest.mark.parametrize("b, s, h, a, f, dropout, dtype", SHAPES)
def test_measured_block_bytes_equal_the_derived_formula(b, s, h, a, f, dropout, dtype):
    block = Block(TransformerConfig(dim=h, heads=a, hidden=f, seq_len=s, dropout=dropout)).to(dtype)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    measured = saved_bytes(block, x, exclude=list(block.parameters()))
    derived = block_activation_bytes(b, s, h, a, f, dtype_bytes=x.element_size(), dropout=dropout > 0)
    assert measured == derived["total"]
    assert derived["total"] == sum(v for k, v in derived.items() if k != "total")


@pytest.mark.parametrize("cfg, batch", [(TransformerConfig(seq_len=24, layers=3), 5),
                                        (TransformerConfig(vocab=50, seq_len=16, dim=32, heads=2, hidden=96,
                                                           layers=2, dropout=0.1), 3)])
def test_measured_model_bytes_equal_the_derived_formula(cfg, batch):
    model = transformer(cfg)
    tokens, targets = torch.randint(cfg.vocab, (batch, cfg.seq_len)), torch.randint(cfg.vocab, (batch, cfg.seq_len))
    measured = saved_bytes(lambda: lm_loss(model(tokens), targets), exclude=list(model.parameters()))
    assert measured == model_activation_bytes(cfg, batch)["total"]


def test_held_bytes_are_the_saved_bytes_less_the_input_plus_the_output():
    block = Block(TransformerConfig())
    x = torch.randn(3, 32, 64, requires_grad=True)
    y, held = held_bytes(block, x)
    saved = saved_bytes(block, x, exclude=list(block.parameters()))
    assert held.total == saved - x.numel() * 4 + y.numel() * 4   # the input existed before; the output is new
    assert held.parameter_copies == 0
    _, nothing = held_bytes(lambda: x.transpose(0, 1)[1:])     # views of existing memory allocate nothing
    assert nothing.total == 0


def test_autocast_weight_copies_are_two_bytes_per_linear_weight():
    model = transformer(TransformerConfig())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear_all = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    tokens = torch.randint(32, (2, 32))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_loss(model(tokens), tokens)
    _, held = held_bytes(forward, params=list(model.parameters()))
    assert held.parameter_copies == 2 * linear        # saved by autograd for backward: the weights' copies
    with torch.autocast("cpu", dtype=torch.bfloat16):  # inside the autocast region its cache holds the biases too
        _, inside = held_bytes(lambda: lm_loss(model(tokens), tokens), params=list(model.parameters()))
    assert inside.parameter_copies == 2 * linear_all > 2 * linear


def test_course_formula_differs_from_megatron_by_layernorm_statistics_and_mask():
    for s, b, h, a in [(2048, 1, 4096, 32), (512, 8, 1024, 16), (128, 2, 64, 4)]:
        c = compare_with_megatron(s, b, h, a)
        assert c["difference"] == c["LayerNorm statistics + causal mask"] == 4 * b * s * 4 + s * s
        assert c["megatron"] == s * b * h * (34 + 5 * a * s / h)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        block_activation_bytes(2, 8, 30, 4)
    with pytest.raises(ValueError, match="unknown recomputation policy"):
        resolve("everything")
    with pytest.raises(TypeError, match="Recomputed"):
        with_recomputation(torch.nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="divisible by tp"):
        block_activation_bytes(2, 8, 64, 4, tp=3)
    assert megatron_layer_bytes(1, 1, 1, 1) == 39


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointed_gradients_equal_plain_ones_with_less_memory(dropout):
    cfg = TransformerConfig(seq_len=64, layers=2, dropout=dropout)
    model = transformer(cfg)
    tokens, targets = torch.randint(32, (4, 64)), torch.randint(32, (4, 64))
    r = compare_policies(model, tokens, targets, ("none", "matmuls", "full", lambda op: op in ("mm", "addmm")))
    assert all(v["grads_identical"] for v in r.values())
    assert r["full"]["held_fraction"] < 0.2 < r["matmuls"]["held_fraction"] < 1.0
    assert r["matmuls"]["recomputed_flops"] == 0 < r["full"]["recomputed_flops"]   # matmuls kept: none redone
    assert r["none"]["recomputed_fraction"] == 0.0
    assert r["<lambda>"]["held"] < r["matmuls"]["held"]                            # scores recomputed too


def test_whole_layer_checkpointing_holds_one_input_per_block():
    cfg = TransformerConfig(seq_len=32, layers=3)
    model = with_recomputation(transformer(cfg), "full")
    tokens = torch.randint(32, (2, 32))
    _, held = held_bytes(lambda: lm_loss(model(tokens), tokens))
    outside = model_activation_bytes(cfg, 2, layers=0)["total"] - 2 * 8 * 2 * 32   # less tokens and targets
    assert held.total == outside + 4 + 3 * 2 * 32 * 64 * 4     # + the loss, + each block's input (b s h fp32)


def test_forward_ops_table_counts_matmuls_and_their_flops():
    cfg = TransformerConfig()
    table = forward_ops(Block(cfg), torch.randn(2, 32, 64))
    tokens = 2 * 32
    assert table["addmm"]["calls"] == 5 and table["mm"]["calls"] == 1       # k has no bias: a plain mm
    assert table["addmm"]["flops"] + table["mm"]["flops"] == 2 * tokens * (4 * 64 * 64 + 2 * 64 * 256)
    assert table["bmm"]["flops"] == 2 * 2 * 4 * 32 * 32 * 16 * 2
    assert table["view"]["new_bytes"] == 0 and table["_softmax"]["new_bytes"] == 2 * 4 * 32 * 32 * 4


def test_accumulation_same_gradients_less_memory_one_all_reduce_with_no_sync():
    cfg = TransformerConfig(seq_len=16, layers=1)
    r = run(_accumulation, 2, cfg, backend="gloo", show_output=False)
    params = sum(p.numel() for p in transformer(cfg).parameters())
    for rank in r:
        assert rank[1]["bytes_all_reduced"] == {"no_sync": 4 * params, "every micro-batch": 4 * params}
        assert rank[4]["bytes_all_reduced"] == {"no_sync": 4 * params, "every micro-batch": 16 * params}
        assert rank[4]["max_grad_difference"] < 1e-6
        assert rank[4]["activation_bytes"] < rank[1]["activation_bytes"] / 3.5
        assert rank[4]["median_seconds"] > 0


def _accumulation(rank, world_size, cfg):
    from course_lib.memory.accumulation import accumulation_worker
    return accumulation_worker(rank, world_size, cfg, batch=16, splits=(1, 4), rounds=1)


def test_recompute_benchmark_worker_times_and_measures_each_policy():
    spec = importlib.util.spec_from_file_location("recompute_cost", os.path.join(ROOT, "benchmarks",
                                                                                 "recompute_cost.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = TransformerConfig(seq_len=16, layers=2)
    r = run(bench.step_time_worker, 1, cfg, 4, ("none", "full"), 2, 1, backend="gloo", show_output=False)[0]
    assert set(r) == {"none", "full"} and all(v["seconds"] > 0 for v in r.values())
    assert r["full"]["held"] < 0.6 * r["none"]["held"]


@pytest.mark.parametrize("b, s, h, a, f, dropout, dtype", [SHAPES[0], SHAPES[2], SHAPES[3]])
def test_fused_attention_saves_no_scores_and_equals_its_formula(b, s, h, a, f, dropout, dtype):
    """SDPA saves its output and a (b, a, s) fp32 logsumexp; the outputs equal eager attention's."""
    from course_lib.memory.fused import with_fused_attention
    block = Block(TransformerConfig(dim=h, heads=a, hidden=f, seq_len=s)).to(dtype)
    fused = with_fused_attention(block)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    measured = saved_bytes(fused, x, exclude=list(fused.parameters()))
    assert measured == block_activation_bytes(b, s, h, a, f, x.element_size(), attention="fused")["total"]
    eager = block_activation_bytes(b, s, h, a, f, x.element_size())["total"]
    assert eager - measured == b * a * s * s * x.element_size() + s * s - b * a * s * 4
    if dtype == torch.float32:
        torch.testing.assert_close(fused(x), block(x))
    with pytest.raises(ValueError, match="attention must be"):
        block_activation_bytes(b, s, h, a, f, attention="flash")


def test_fused_attention_with_dropout_on_the_cpu_stores_the_probabilities():
    """On the CPU, SDPA with dropout runs its math path: it saves s² tensors (fp32: eager's bytes less the causal
    mask), so the fused formula, which prices the GPU kernels, refuses the CPU with dropout."""
    from course_lib.memory import saved_tensors
    from course_lib.memory.fused import with_fused_attention
    b, s = 2, 64
    block = with_fused_attention(Block(TransformerConfig(seq_len=s, dropout=0.1)))
    x = torch.randn(b, s, 64, requires_grad=True)
    saved = saved_tensors(block, x, exclude=list(block.parameters()))[1]
    assert any(t.shape[-2:] == (s, s) and t.nbytes >= b * 4 * s * s * 4 for t in saved)
    eager = block_activation_bytes(b, s, 64, 4, 256, dropout=True)["total"]
    assert sum(t.nbytes for t in saved) == eager - s * s
    with pytest.raises(ValueError, match="math path"):
        block_activation_bytes(b, s, 64, 4, 256, dropout=True, attention="fused")
    assert block_activation_bytes(b, s, 64, 4, 256, dropout=True, device="cuda", attention="fused")["total"] < eager


def test_memory_curve_rises_through_forward_falls_through_backward_and_ends_with_the_gradients():
    from course_lib.memory.recompute import loss_fn
    from course_lib.memory.timeline import memory_curve
    cfg = TransformerConfig(seq_len=32, layers=2)
    model, tokens = transformer(cfg), torch.randint(32, (2, 32))
    c = memory_curve(loss_fn, model, tokens, tokens)
    _, held = held_bytes(loss_fn, model, tokens, tokens)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert held.total == c["at_turn"] <= c["peak"]
    assert params <= c["after"] < params + 64                  # gradients, and the loss scalar
    full = memory_curve(loss_fn, with_recomputation(model, "full"), tokens, tokens)
    assert full["at_turn"] < c["at_turn"] / 4 and full["peak"] < c["peak"] and full["peak_phase"] == "backward"
    assert full["at_turn"] == held_bytes(loss_fn, with_recomputation(model, "full"), tokens, tokens)[1].total


def test_chunked_cross_entropy_equals_the_full_loss_and_never_holds_all_logits():
    from course_lib.memory.timeline import chunked_cross_entropy, memory_curve
    tokens, h, vocab = 256, 16, 2048
    hidden = torch.randn(tokens, h, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, h)).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    logits_bytes = tokens * vocab * 4
    full = memory_curve(lambda: torch.nn.functional.cross_entropy(hidden @ weight.t(), targets))
    g = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    chunked = memory_curve(lambda: chunked_cross_entropy(hidden, weight, targets, chunks=8))
    assert logits_bytes <= full["at_turn"] < logits_bytes + 64     # the log-probabilities (the logits are freed)
    assert chunked["at_turn"] < 64                                  # only the loss scalar and the target count
    assert chunked["peak"] < full["peak"] / 4
    torch.testing.assert_close((hidden.grad, weight.grad), g)
    with pytest.raises(ValueError, match="chunks"):
        chunked_cross_entropy(hidden, weight, targets, chunks=0)


def test_chunked_cross_entropy_divides_by_the_targets_not_ignored():
    """A quarter of the labels set to -100: the mean is over the other three quarters, as F.cross_entropy's; the
    gradients agree too. num_targets gives the global count across micro-batches."""
    from course_lib.memory.timeline import chunked_cross_entropy
    hidden = torch.randn(128, 16, requires_grad=True)
    weight = (0.1 * torch.randn(512, 16)).requires_grad_()
    targets = torch.randint(512, (128,))
    targets[::4] = -100
    want = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets)
    g = torch.autograd.grad(want, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, chunks=4)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, (hidden, weight)), g)
    halves = [chunked_cross_entropy(hidden[i:i + 64], weight, targets[i:i + 64], chunks=2, num_targets=96)
              for i in (0, 64)]
    torch.testing.assert_close(sum(halves), want)


def test_korthikanti_with_fused_attention_is_34_sbh_plus_the_logsumexp():
    """Notebook 13's second end exercise: in the paper's setting, fused attention replaces 5as/h by 4a/h (the
    logsumexp), less the LayerNorm statistics the paper leaves out."""
    for s, b, h, a in [(2048, 1, 4096, 32), (512, 2, 1024, 16)]:
        fused = block_activation_bytes(b, s, h, a, 4 * h, dtype_bytes=2, dropout=True, device="cuda",
                                       attention="fused")
        assert fused["total"] - fused["LayerNorm mean and 1/std"] == s * b * h * 34 + 4 * a * s * b


def test_end_exercise_1_the_gpu_conventions_change_the_masks_and_in_bf16_the_statistics():
    """Notebook 13's first end exercise: section 1's dropout shape, priced on the CPU and on CUDA."""
    cpu, gpu = (block_activation_bytes(3, 32, 64, 4, 256, dropout=True, device=d) for d in ("cpu", "cuda"))
    assert (cpu["total"], gpu["total"]) == (592384, 518656)
    assert {k for k in cpu if cpu[k] != gpu[k]} == {"dropout masks and outputs", "total"}
    cpu, gpu = (block_activation_bytes(3, 32, 64, 4, 256, 2, dropout=True, device=d) for d in ("cpu", "cuda"))
    assert (cpu["total"], gpu["total"]) == (296704, 272896)
    assert (cpu["LayerNorm mean and 1/std"], gpu["LayerNorm mean and 1/std"]) == (768, 1536)
