"""Context parallelism (course_lib.context_parallel): every variant equals full attention, and the counts hold.

Each worker computes full attention in float64 on every rank (the same generator, so the same tensors), takes its
own part of the sequence, runs the variant, and returns the largest difference of the output and of the three
gradients from the matching slices of full attention's.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from course_lib import context_parallel as cp
from course_lib.context_parallel import traffic
from course_lib.launch import RankError, run

CASES = [(name, causal, layout) for name in ("ring_attention", "allgather_attention", "ulysses_attention")
         for causal in (False, True) for layout in ("contiguous", "zigzag")
         if not (name == "ulysses_attention" and layout == "zigzag")]


def equal_to_full_attention(rank, world_size, cases, batch=2, heads=4, head_dim=5):
    from course_lib import context_parallel as cp
    results = {}
    for name, causal, layout in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(batch, heads, 4 * world_size, head_dim, generator=g, dtype=torch.float64,
                               requires_grad=True) for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out_grad = torch.randn(full.shape, generator=g, dtype=torch.float64)
        full.backward(out_grad)
        part = functools.partial(cp.shard, dim=2, rank=rank, world_size=world_size, layout=layout)
        mine = [part(t.detach()).requires_grad_() for t in (q, k, v)]
        options = {"causal": causal} | ({} if name == "ulysses_attention" else {"layout": layout})
        with cp.count() as counted:
            out = getattr(cp, name)(*mine, **options)
        out.backward(part(out_grad))
        gaps = [(out - part(full.detach())).abs().max()] + [(m.grad - part(t.grad)).abs().max()
                                                              for m, t in zip(mine, (q, k, v))]
        results[name, causal, layout] = (max(float(x) for x in gaps), counted)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    n = request.param
    return n, run(equal_to_full_attention, n, CASES, backend="gloo", show_output=False)


def test_every_variant_equals_full_attention_outputs_and_gradients(runs):
    n, results = runs
    for case in CASES:
        worst = max(r[case][0] for r in results)
        assert worst < 1e-12, f"{case} on {n} ranks: {worst:.1e} from full attention"


def test_the_counted_bytes_are_the_formulas(runs):
    n, results = runs
    element = 8                                           # float64
    for name, variant in (("ring_attention", "ring"), ("allgather_attention", "all-gather"),
                          ("ulysses_attention", "ulysses")):
        expected = traffic.forward_bytes(variant, 2, 4, 4 * n, 5, n, element)
        for r in results:
            counted = r[name, False, "contiguous"][1]
            assert {key: counted[key] for key in expected} == expected, (name, n)


def test_zigzag_evens_the_causal_work_and_contiguous_does_not(runs):
    n, results = runs
    for layout in ("contiguous", "zigzag"):
        counted = [r["ring_attention", True, layout][1]["scores"] for r in results]
        assert counted == [2 * 4 * s for s in traffic.causal_scores(layout, 4 * n, n)]   # batch 2 x 4 heads
    contiguous = traffic.causal_scores("contiguous", 4096, n)
    assert len(set(traffic.causal_scores("zigzag", 4096, n))) == 1
    assert 2 * n - 1.01 < contiguous[-1] / contiguous[0] < 2 * n - 1     # the last rank: about 2W - 1 x the first


def test_zigzag_shard_and_unshard_are_inverse_and_hold_the_named_chunks():
    x = torch.arange(16)
    parts = [cp.zigzag_shard(x, 0, r, 4) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(cp.zigzag_unshard(parts, 0), x)
    assert torch.equal(cp.unshard([cp.shard(x, 0, r, 4) for r in range(4)], 0), x)


def test_merge_of_two_blocks_is_attention_over_both():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k2, v2 = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = cp.merge(*cp.block_attention(q, k, v), *cp.block_attention(q, k2, v2))
    both, both_lse = cp.block_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    assert torch.allclose(out, both, atol=1e-14) and torch.allclose(lse, both_lse, atol=1e-14)
    assert torch.allclose(both, F.scaled_dot_product_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2)))


def test_shapes_the_world_size_does_not_divide_are_clear_errors():
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        cp.zigzag_shard(torch.zeros(12), 0, 0, 4)
    with pytest.raises(ValueError, match="does not split into 3"):
        cp.shard(torch.zeros(10), 0, 0, 3)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(torch.zeros(8), 0, 0, 2, "zig-zag")
    with pytest.raises(ValueError, match="Ulysses needs"):
        traffic.forward_bytes("ulysses", 1, 6, 8, 4, 4)


def wrong_shapes(rank, world_size, what):
    from course_lib import context_parallel as cp
    if what == "heads":
        x = torch.zeros(1, 3, 4, 2)                         # 3 heads on 2 ranks
        return cp.ulysses_attention(x, x, x)
    x = torch.zeros(1, 2, 3, 2)                             # an odd part cannot hold two zig-zag chunks
    return cp.ring_attention(x, x, x, layout="zigzag")


@pytest.mark.parametrize("what, message", [("heads", "3 heads do not split over 2 ranks"),
                                           ("zigzag", "s_local must be even")])
def test_variants_refuse_what_they_cannot_split_with_a_clear_error_on_every_rank(what, message):
    with pytest.raises(RankError, match=message):
        run(wrong_shapes, 2, what, backend="gloo", show_output=False, timeout=30)


def test_notebook_15s_exercise_solution_states_the_formula_s_numbers():
    assert traffic.causal_scores("zigzag", 6000, 3) == [6_001_000] * 3     # (2W - 1) c² + c (c + 1), c = 1000


def test_the_pictures_draw_what_the_ring_and_the_layouts_do():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from course_lib.viz import context as cpviz
    cells = [p for p in cpviz.draw_ring_steps(4, causal=True).axes[0].patches if isinstance(p, Rectangle)]
    assert len(cells) == 16 and sum(bool(p.get_hatch()) for p in cells) == 6   # 3 + 2 + 1 + 0 future blocks skipped
    bars = cpviz.draw_causal_work(4).axes[2].patches
    zigzag = [b.get_height() for b in bars[4:]]
    assert all(abs(h - 1) < 1e-9 for h in zigzag) and bars[3].get_height() > 1.7    # contiguous: the last rank 1.75x
    plt.close("all")


def bf16_and_one_rank(rank, world_size, seq=64):
    from course_lib import context_parallel as cp
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, seq, 16, generator=g, dtype=torch.float64) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    part = lambda t: cp.zigzag_shard(t, 2, rank, world_size)
    sdpa = (F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True).double()
            - exact).abs().max()
    mine = [part(t).bfloat16().requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*mine, causal=True, layout="zigzag")
    out.sum().backward()                                   # one rank: no exchange to make, forward or backward
    return float((out.double() - part(exact)).abs().max()), float(sdpa), out.dtype, mine[1].grad.dtype


@pytest.mark.parametrize("n", [1, 4])
def test_ring_attention_in_bf16_is_as_accurate_as_sdpa_and_runs_on_one_rank(n):
    for err, sdpa, dtype, grad_dtype in run(bf16_and_one_rank, n, backend="gloo", show_output=False):
        assert dtype == grad_dtype == torch.bfloat16
        assert err < 2 * sdpa, (err, sdpa)                  # merged in float32: bf16 rounds the output only


def in_subgroups(rank, world_size):
    import torch.distributed as dist

    from course_lib import context_parallel as cp
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    me = rank // 2
    g = torch.Generator().manual_seed(rank % 2)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gaps = []
    for name in ("ring_attention", "allgather_attention", "ulysses_attention"):
        parts = [cp.shard(t, 2, me, 2) for t in (q, k, v)]
        gaps.append(float((getattr(cp, name)(*parts, causal=True, group=group) - cp.shard(full, 2, me, 2)).abs().max()))
    return max(gaps)


def test_every_variant_runs_in_a_subgroup():
    assert max(run(in_subgroups, 4, backend="gloo", show_output=False)) < 1e-12


def test_pytorchs_context_parallel_has_no_rule_for_the_cpu_attention_kernel():
    """Notebook 15 says why it builds its own ring: PyTorch's context_parallel shards only the GPU kernels."""
    import importlib
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "custom_ops"):
            break
    else:
        pytest.fail("torch moved context_parallel's table of sharded attention kernels: find it and update this test")
    kernels = {str(op) for op in module.custom_ops}
    assert any("flash_attention" in k for k in kernels)                       # the GPU kernels are there...
    assert not any("for_cpu" in k for k in kernels)                           # ...the CPU one is not


def in_float32(rank, world_size):
    from course_lib import context_parallel as cp
    gaps = {}
    for name, layout in (("ring_attention", "zigzag"), ("allgather_attention", "zigzag"),
                         ("ulysses_attention", "contiguous")):
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(2, 4, 8 * world_size, 6, generator=g, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn(full.shape, generator=g, dtype=torch.float64)
        full.backward(grad)
        part = functools.partial(cp.shard, dim=2, rank=rank, world_size=world_size, layout=layout)
        mine = [part(t.detach()).float().requires_grad_() for t in (q, k, v)]
        options = {"causal": True} | ({} if name == "ulysses_attention" else {"layout": layout})
        out = getattr(cp, name)(*mine, **options)
        out.backward(part(grad).float())
        gaps[name] = max(float((a.double() - part(b)).abs().max())
                         for a, b in [(out, full.detach())] + [(m.grad, t.grad) for m, t in zip(mine, (q, k, v))])
    return gaps


@pytest.mark.parametrize("n", [2, 4])
def test_every_variant_in_float32_is_within_1e_5_of_full_attention(n):
    for gaps in run(in_float32, n, backend="gloo", show_output=False):
        assert max(gaps.values()) < 1e-5, gaps


def bad_calls(rank, world_size):
    from course_lib import context_parallel as cp
    x, y = torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 3)
    said = {}
    for name, call in (("ring shapes", lambda: cp.ring_attention(x, y, y)),
                       ("ulysses shapes", lambda: cp.ulysses_attention(x, y, y)),
                       ("ring layout", lambda: cp.ring_attention(x, x, x, layout="stripes")),
                       ("all-gather layout", lambda: cp.allgather_attention(x, x, x, layout="stripes"))):
        try:
            call()
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def test_bad_shapes_and_layouts_are_clear_errors():
    said = run(bad_calls, 2, backend="gloo", show_output=False)[0]
    assert "must have the same shape" in said["ring shapes"] and "must have the same shape" in said["ulysses shapes"]
    assert "layout must be one of" in said["ring layout"] and "layout must be one of" in said["all-gather layout"]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        traffic.forward_bytes("ring", 1, 4, 10, 8, 3)
    with pytest.raises(ValueError, match="variant must be one of"):
        traffic.forward_bytes("tree", 1, 4, 8, 8, 2)
