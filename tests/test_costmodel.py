"""Bandwidth definitions and the α-β fit, on numbers whose answer is known; the timing worker on real ranks."""
import math

import numpy as np
import pytest

from course_lib.comm import allreduce, costmodel
from course_lib.launch import run


def test_bus_bandwidth_is_nccl_tests_definition():
    assert costmodel.algbw(1e9, 0.5) == 2e9
    assert costmodel.busbw(1e9, 0.5, 8) == pytest.approx(2e9 * 2 * 7 / 8)
    assert costmodel.busbw(1e9, 0.5, 2) == pytest.approx(2e9)


def test_cost_model_steps():
    assert costmodel.steps_and_volume("ring", 4) == (6, 1.5)
    assert costmodel.steps_and_volume("recursive doubling", 8) == (3, 3)
    assert costmodel.steps_and_volume("recursive doubling", 6) == (4, 4)  # 2 fold steps + log2(4)
    assert costmodel.steps_and_volume("naive", 3) == (4, 4)
    assert costmodel.steps_and_volume("ring", 1) == (0.0, 0.0)
    with pytest.raises(ValueError, match="no cost model"):
        costmodel.steps_and_volume("butterfly", 4)


@pytest.mark.parametrize("algorithm", ["ring", "recursive doubling", "naive"])
def test_fit_recovers_known_alpha_and_beta(algorithm):
    alpha, beta, n = 50e-6, 1 / 5e9, 4
    sizes = np.logspace(10, 27, 12, base=2)
    times = costmodel.predict(algorithm, sizes, n, alpha, beta)
    fit = costmodel.fit_alpha_beta(sizes, times, algorithm, n)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6) and fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_error"] < 1e-6


def test_fit_on_noisy_data_keeps_alpha_non_negative_and_reports_quality():
    rng = np.random.default_rng(0)
    sizes = np.logspace(12, 26, 8, base=2)
    times = costmodel.predict("ring", sizes, 4, 0.0, 1e-9) * rng.uniform(0.8, 1.2, len(sizes))
    fit = costmodel.fit_alpha_beta(sizes, times, "ring", 4)
    assert fit["alpha"] >= 0 and 0.9 < fit["r2"] <= 1 and fit["max_rel_error"] > 0.01
    with pytest.raises(ValueError, match="at least 3"):
        costmodel.fit_alpha_beta(sizes[:2], times[:2], "ring", 4)
    with pytest.raises(ValueError, match="2 or more ranks"):
        costmodel.fit_alpha_beta(sizes, times, "ring", 1)


def test_prediction_for_a_billion_parameters():
    # 4 GB of fp32 gradients over 8 ranks at 100 GB/s, no latency: 2*(7/8)*4e9/1e11 = 70 ms
    assert costmodel.predict("ring", 4e9, 8, 0.0, 1 / 100e9) == pytest.approx(0.07)
    # the ring's bandwidth term hardly grows with N; its latency term grows linearly
    big = costmodel.predict("ring", 4e9, 1024, 10e-6, 1 / 100e9)
    assert big == pytest.approx(2 * 1023 * 10e-6 + 2 * 1023 / 1024 * 0.04)
    assert math.isclose(costmodel.predict("ring", 0, 64, 1e-5, 0), 2 * 63 * 1e-5)


def test_reduce_scatter_and_all_gather_are_half_a_ring():
    assert costmodel.steps_and_volume("reduce-scatter", 8) == (7, 7 / 8) == costmodel.steps_and_volume("all-gather", 8)
    rs = costmodel.predict("reduce-scatter", 1e9, 8, 1e-6, 1e-10)
    assert 2 * rs == pytest.approx(costmodel.predict("ring", 1e9, 8, 1e-6, 1e-10))


def test_two_level_all_reduce_by_hand():
    nvlink, ib = (2e-6, 1 / 450e9), (5e-6, 1 / 50e9)
    n, g, nodes = 4e9, 8, 8
    inside = 2 * (7 * 2e-6 + 7 / 8 * n / 450e9)                     # reduce-scatter + all-gather over NVLink
    across = 2 * 7 * 5e-6 + 2 * 7 / 8 * (n / 8) / 50e9               # ring all-reduce of 1/8 of the data
    assert costmodel.predict_two_level(n, g, nodes, nvlink, ib) == pytest.approx(inside + across)
    # one node: only the inside phases; the network carries 1/8 of a flat ring's bytes
    assert costmodel.predict_two_level(n, g, 1, nvlink, ib) == pytest.approx(inside)
    flat = costmodel.predict("ring", n, g * nodes, *ib)
    assert costmodel.predict_two_level(n, g, nodes, nvlink, ib) < 0.3 * flat


def test_timing_worker_measures_every_implementation_and_size():
    sizes = [1024, 65536]
    out = run(costmodel.time_all_reduce, 2, allreduce.IMPLEMENTATIONS, sizes, 2, backend="gloo", show_output=False)
    assert out[1] is None
    assert set(out[0]) == set(allreduce.IMPLEMENTATIONS)
    assert all(len(t) == 2 and all(0 < s < 5 for s in t) for t in out[0].values())


def test_relative_fit_lets_the_small_messages_set_alpha():
    # 20 µs of latency under times whose largest are milliseconds; the largest time measured 10 % high
    sizes = np.array([2**14, 2**17, 2**20, 2**22], dtype=float)
    noisy = costmodel.predict("ring", sizes, 2, 20e-6, 1e-9) * np.array([1, 1, 1, 1.1])
    ols = costmodel.fit_alpha_beta(sizes, noisy, "ring", 2)
    rel = costmodel.fit_alpha_beta(sizes, noisy, "ring", 2, relative=True)
    assert ols["alpha"] < 5e-6                                   # OLS: α is lost in the largest message's error
    assert rel["alpha"] == pytest.approx(20e-6, rel=0.1)         # relative: set by the small messages
    assert rel["max_rel_error"] < ols["max_rel_error"]


def test_a_best_sample_needs_a_second_to_confirm_it():
    assert costmodel._confirmed([1.0, 1.2, 3.0], 0.25) and not costmodel._confirmed([1.0, 2.0, 3.0], 0.25)


def test_notebook_02_exercise_1_crossover_solution():
    """The folded solution's n*: the ring and recursive doubling predictions are equal there, and swap order."""
    a, b = 1e-3, 1 / 1e9                                    # a laptop-like fit: 1 ms, 1 GB/s
    steps = {name: costmodel.steps_and_volume(name, 8) for name in ("ring", "recursive doubling")}
    (s_ring, v_ring), (s_rd, v_rd) = steps["ring"], steps["recursive doubling"]
    n_star = (s_ring - s_rd) * a / ((v_rd - v_ring) * b)
    assert math.isclose(n_star, 11 * a / (1.25 * b))         # 14α + 1.75nβ = 3α + 3nβ
    ring, rd = (costmodel.predict(name, [n_star / 2, n_star, 2 * n_star], 8, a, b) for name in steps)
    assert math.isclose(ring[1], rd[1]) and rd[0] < ring[0] and ring[2] < rd[2]


@pytest.mark.parametrize("n, names", [(4, ("ring", "recursive doubling")), (3, ("ring", "dist.all_reduce"))])
def test_algorithms_in_alternation(n, names):
    out = run(costmodel.algorithms_side_by_side, n, names, 4096, 3, backend="gloo", show_output=False)
    assert all(o == out[0] for o in out)                      # every rank returns the same all-reduced medians
    assert set(out[0]) == set(names) and all(t > 0 for t in out[0].values())
