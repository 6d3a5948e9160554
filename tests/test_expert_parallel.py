"""course_lib.expert_parallel: routing, the differentiable all-to-all, and the expert-parallel MoE equal to the
one-process reference on 2 and 4 ranks (uneven token counts, a rank without tokens, dropped slots), alone and
composed with data parallelism."""
import math

import pytest
import torch
import torch.distributed as dist

from course_lib import expert_parallel as ep
from course_lib.launch import RankError, run

TOL = 1e-10   # float64: the only difference left is the order of additions


def test_capacity_is_the_formula_from_this_ranks_tokens():
    assert ep.capacity(12, 4, 2, 1.25) == math.ceil(1.25 * 12 * 2 / 4) == 8
    assert ep.capacity(0, 4, 2, 1.25) == 0
    assert 1.1 * 100 * 1 / 11 > 10 and ep.capacity(100, 11, 1, 1.1) == 10    # exact, not float rounding's 11


def test_first_choices_come_before_second_choices_and_drops_are_counted():
    # 3 tokens, 2 experts, top-2: every token picks both experts; capacity 2 keeps 2 slots per expert
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    r = ep.route(probs, 2, 2)
    assert r.dropped == 2 and r.load.tolist() == [3, 3]
    kept = sorted(zip(r.token.tolist(), r.expert.tolist()))
    # first choices: (0→0), (1→1), (2→0); second choices in token order: (0→1) fits, (1→0) and (2→1) are dropped
    assert kept == [(0, 0), (0, 1), (1, 1), (2, 0)]
    assert torch.allclose(r.gate, probs[r.token, r.expert])          # gates: the probabilities, not renormalised


def test_the_balance_loss_is_one_when_uniform_and_grows_with_concentration():
    uniform = torch.full((8, 4), 0.25)
    assert ep.route(uniform, 1, 8).aux_loss.item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    r = ep.route(skewed, 2, 16)
    f = r.load.double() / 16
    assert r.aux_loss.item() == pytest.approx(4 * float((f * skewed.double().mean(0)).sum()))
    assert r.aux_loss.item() > 1.0
    assert ep.imbalance([4, 4, 4, 4]) == 1.0 and ep.imbalance([16, 0, 0, 0]) == 4.0
    assert ep.imbalance(ep.route(skewed, 2, 16).load) == 4 / 2                # top-2 collapse: E / k


@pytest.mark.parametrize("seed", range(8))
def test_the_balancing_loss_evens_the_load_for_every_seed(seed):
    """Notebook 16's asserts on its seed 0, here on 8 seeds: both runs start collapsed (close to E/k, never above),
    the balancing loss ends with imbalance under 1.5 and below the plain run's, far fewer drops, a lower task loss.
    (A ratio, balanced < plain / 2, fails for seeds 1 and 4: the plain run's final imbalance ranges 1.6 to 3.5.)"""
    plain, balanced = ep.balance.train(aux_coef=0.0, seed=seed), ep.balance.train(aux_coef=0.1, seed=seed)
    assert plain["imbalance"][0] == balanced["imbalance"][0] > 3.8
    assert max(plain["imbalance"] + balanced["imbalance"]) <= 8 / 2
    assert balanced["imbalance"][-1] < min(plain["imbalance"][-1], 1.5)
    assert balanced["dropped"][-1] < plain["dropped"][-1] / 10
    assert balanced["task"][-1] < plain["task"][-1]


def test_exercise_2s_solution_numbers():
    plain = ep.balance.train(aux_coef=0.0, capacity_factor=2.0)
    balanced = ep.balance.train(aux_coef=0.1, capacity_factor=2.0)
    assert plain["dropped"][-1] == 20 and round(plain["imbalance"][-1], 2) == 2.17
    assert balanced["dropped"][-1] == 0 and round(balanced["imbalance"][-1], 2) == 1.19


def test_the_same_seed_builds_the_same_weights():
    a, b, c = ep.MoE(6, 10, 4, seed=3), ep.MoE(6, 10, 4, seed=3), ep.MoE(6, 10, 4, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.router.weight, c.router.weight)


def test_the_reference_computes_the_mixture_by_its_definition():
    torch.manual_seed(0)
    moe = ep.MoE(5, 7, 4, top_k=2, capacity_factor=10.0).double()     # room for every slot
    x = torch.randn(9, 5, dtype=torch.float64)
    probs = moe.router(x).softmax(-1)
    top_p, top_e = probs.topk(2, dim=-1)
    expected = torch.stack([sum(p * moe.experts.mlps[e](x[t]) for p, e in zip(top_p[t], top_e[t].tolist()))
                            for t in range(9)])
    assert torch.allclose(moe(x), expected) and moe.dropped == 0


def test_value_errors_say_what_to_do():
    with pytest.raises(ValueError, match="do not split evenly over 4 ranks: use a number of experts that 4 divides"):
        ep.owned_block(6, 4, 0)
    assert ep.owned_block(8, 4, 2) == range(4, 6)
    with pytest.raises(ValueError, match="top_k"):
        ep.MoE(4, 8, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        ep.MoE(4, 8, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="does not divide"):
        ep.check.ep_dp_groups(4, 3)
    assert ep.check.ep_dp_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def six_experts_on_four_ranks(rank, world_size):
    ep.MoE(4, 8, 6, group=dist.group.WORLD)


def test_a_group_that_does_not_divide_the_experts_is_a_value_error():
    with pytest.raises(RankError, match="do not split evenly"):
        run(six_experts_on_four_ranks, 4, backend="gloo", show_output=False)


@pytest.mark.parametrize("tokens, case", [
    ([7, 12], {}),
    ([5, 9, 0, 13], {}),                                        # rank 2 holds no tokens
    ([6, 11, 3, 8], {"num_experts": 8, "top_k": 1}),
    ([10, 4], {"num_experts": 6, "top_k": 3, "capacity_factor": 0.5}),
], ids=["2 ranks", "4 ranks, one without tokens", "4 ranks, top-1, 8 experts", "2 ranks, top-3, many drops"])
def test_expert_parallel_equals_the_reference_on_each_ranks_tokens(tokens, case):
    results = run(ep.check.compare_worker, len(tokens), tokens, case, backend="gloo", show_output=False)
    for r in results:
        assert r["dropped"][0] == r["dropped"][1]
        for key in ("output", "input grad", "aux loss", "router grad", "expert grads"):
            assert r[key] < TOL, (key, r[key])
    assert sum(r["dropped"][0] for r in results) > 0                   # some slots over capacity
    assert sorted(e for r in results for e in r["owned"]) == list(range(case.get("num_experts", 4)))


def test_within_expert_parallel_subgroups_it_equals_the_reference():
    results = run(ep.check.compare_worker, 4, [4, 11, 0, 7], {"num_experts": 4}, None, 2, backend="gloo",
                  show_output=False)
    assert [r["owned"] for r in results] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    for r in results:
        for key in ("output", "input grad", "aux loss", "router grad", "expert grads"):
            assert r[key] < TOL, (key, r[key])


def test_with_data_parallelism_every_gradient_equals_accumulation_over_the_ranks_micro_batches():
    results = run(ep.check.ep_dp_worker, 4, 2, [5, 9, 3, 13], backend="gloo", show_output=False)
    assert [r["owned"] for r in results] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [r["dp group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert max(max(r["router grad"], r["expert grads"]) for r in results) < TOL
    # the DDP habit (each rank's loss averaged over its DP group): router right, experts exactly EP = 2× too large
    assert max(r["DDP habit: router grad"] for r in results) < TOL
    assert max(r["DDP habit: expert grads - EP x reference"] for r in results) < TOL
    assert all(abs(r["DDP habit: expert grads / reference"] - 2) < 1e-12 for r in results)


def test_the_all_to_alls_of_a_step_and_their_bytes():
    results = run(ep.check.traffic_worker, 2, 16, backend="gloo", show_output=False)
    for rank, r in enumerate(results):
        phases = [(c["phase"], c["what"]) for c in r["calls"]]
        assert phases == [("forward", "counts"), ("forward", "tokens"), ("forward", "tokens"),
                          ("backward", "tokens"), ("backward", "tokens")]
        dispatch = r["calls"][1]
        assert dispatch["sent"] == r["sent_to"] and sum(r["sent_to"]) == r["slots"] == 32 - r["dropped"]
        assert dispatch["bytes to others"] == r["sent_to"][1 - rank] * 6 * 4      # dim 6, float32
        backward = [c["bytes to others"] for c in r["calls"][3:]]
        assert backward == [r["calls"][1]["bytes to others"], r["calls"][2]["bytes to others"]]   # reversed
    away = sum(r["sent_to"][1 - rank] for rank, r in enumerate(results))
    assert sum(c["bytes to others"] for r in results for c in r["calls"][1:]) == 4 * away * 6 * 4
    # what rank 0 sends back in the combine is what rank 1 sent it in the dispatch
    assert results[0]["calls"][2]["sent"][1] == results[1]["calls"][1]["sent"][0]


def reverse_all_to_all(rank, world_size):
    send = [rank + 1 + d for d in range(world_size)]              # uneven: rank r sends r+1+d rows to rank d
    recv = [s + 1 + rank for s in range(world_size)]
    x = torch.arange(sum(send), dtype=torch.float64).add(100 * rank).unsqueeze(1).requires_grad_()
    y = ep.all_to_all(x, recv, send)
    (y * torch.arange(len(y), dtype=torch.float64).unsqueeze(1)).sum().backward()
    return x.grad.squeeze(1).tolist(), y.detach().squeeze(1).tolist(), send, recv


def test_the_all_to_all_backward_is_the_reverse_all_to_all():
    results = run(reverse_all_to_all, 3, backend="gloo", show_output=False)
    for d, (_, y, _, recv) in enumerate(results):      # what d received from s is s's block for d
        offset = 0
        for s, (_, _, send_s, _) in enumerate(results):
            start = sum(send_s[:d])
            assert y[offset:offset + recv[s]] == [100 * s + i for i in range(start, start + send_s[d])]
            offset += recv[s]
    for s, (grad, _, send, _) in enumerate(results):   # x's gradient: the position each row landed at on d
        offset = 0
        for d, (_, _, _, recv_d) in enumerate(results):
            landed = sum(recv_d[:s])
            assert grad[offset:offset + send[d]] == [float(landed + i) for i in range(send[d])]
            offset += send[d]


def mismatched_splits(rank, world_size):
    x = torch.zeros(3, 2)
    with ep.AllToAllLog(check=True):
        dist.all_to_all_single(torch.empty(3, 2), x, [2, 1], [1, 2] if rank == 0 else [2, 1])


def test_the_log_names_splits_that_do_not_match_instead_of_aborting():
    with pytest.raises(RankError, match="split sizes do not match: rank 0 sends 1 rows to rank 0, which expects 2"):
        run(mismatched_splits, 2, backend="gloo", show_output=False)


def test_the_pictures_show_what_they_are_given():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.viz import experts as epviz
    fig = epviz.draw_all_to_all([[3, 1], [0, 5]])
    assert [t.get_text() for t in fig.axes[0].texts] == ["3", "1", "0", "5"]
    fig2 = epviz.draw_moe_layer(4, 2)
    texts = [t.get_text() for t in fig2.axes[0].texts]
    assert "expert 3 (rank 1)" in texts and any("dispatch" in t for t in texts)
    fig3 = epviz.draw_expert_load({"a": [4, 1, 2], "b": [2, 2, 3]}, cap=3)
    assert len(fig3.axes) == 2 and len(fig3.axes[0].patches) == 3
    plt.close("all")


def test_the_expert_gradients_compared_include_the_biases():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    b.bias.grad += 0.5                                                # only a bias differs
    assert ep.check._param_diff(a, b) == 0.5
