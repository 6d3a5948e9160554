"""Notebook 02's sweep helpers (comm.sweep, viz.costs) and notebook 07's comparison helpers
(pipeline_parallel.torch_compare), on data whose answer is known."""
import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from course_lib import pipeline_parallel as P  # noqa: E402
from course_lib.comm import costmodel, sweep  # noqa: E402
from course_lib.pipeline_parallel import torch_compare as TC  # noqa: E402
from course_lib.viz.costs import plot_model_fit  # noqa: E402


def test_sweep_sizes_short_and_full(monkeypatch):
    monkeypatch.delenv("COURSE_FULL_SWEEP", raising=False)
    sizes, repeats = sweep.sweep_sizes()
    assert (sizes[0], sizes[-1], repeats) == (4 * 2**10, 64 * 2**20, 3)
    monkeypatch.setenv("COURSE_FULL_SWEEP", "1")
    sizes, repeats = sweep.sweep_sizes()
    assert (sizes[0], sizes[-1], repeats) == (2**10, 256 * 2**20, 5)


def test_fit_ring_recovers_alpha_and_beta_of_noise_free_times():
    sizes = [2**k for k in range(12, 27, 2)]
    alpha, beta = 1e-3, 1 / 2e9
    times = list(costmodel.predict("ring", sizes, 8, alpha, beta))
    fit = sweep.fit_ring(sizes, times, 8)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6) and fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["bandwidth"] == pytest.approx(2e9, rel=1e-6)


def test_fit_ring_takes_alpha_from_the_small_messages():
    # the large messages' noise (2% on the last one) swamps α in an ordinary fit; the relative fit keeps it
    sizes = [2**k for k in range(12, 27, 2)]
    alpha, beta = 1e-3, 1 / 2e9
    times = list(costmodel.predict("ring", sizes, 8, alpha, beta))
    times[-1] *= 0.98
    ols = costmodel.fit_alpha_beta(sizes, times, "ring", 8)
    fit = sweep.fit_ring(sizes, times, 8)
    assert abs(fit["alpha"] - alpha) < abs(ols["alpha"] - alpha)
    assert fit["alpha"] == pytest.approx(alpha, rel=0.05) and fit["beta"] == ols["beta"]


def test_print_ratios_divides_by_the_ring(capsys):
    times = {8: {"ring": [1.0, 10.0], "naive": [0.5, 7.0]}}
    assert sweep.print_ratios(times, [4096, 64 * 2**20], 8) == {"naive": (0.5, 0.7)}
    assert "naive / ring: 0.50 at 4 KiB, 0.70 at 64 MiB" in capsys.readouterr().out


def test_plot_model_fit_draws_points_and_lines():
    sizes = [2**k for k in range(12, 27, 4)]
    fit = {"alpha": 1e-3, "beta": 1e-9}
    measured = {name: list(costmodel.predict(name, sizes, 4, 1e-3, 1e-9)) for name in ("ring", "recursive doubling")}
    fig = plot_model_fit(sizes, measured, 4, fit)
    assert len(fig.axes[0].lines) == 4


def test_overhead_converts_the_bubble():
    for p, m in ((2, 4), (4, 8), (3, 1)):
        assert TC.overhead(P.bubble_formula(p, m)) == pytest.approx(P.bubble_overhead(p, m))


@pytest.mark.parametrize(("ranks", "v", "expected"), [(2, 1, 1), (2, 2, 3), (4, 2, 7), (2, 4, 7)])
def test_crossings_are_v_p_minus_1(ranks, v, expected):
    assert TC.crossings(ranks, v) == expected


def _timed(kind, p, m, f=1.0, b=2.0):
    """Results shaped like torch_pipeline_worker's: each rank's (op, i, stage, cpu, start, end), simulated."""
    sim = P.simulate(kind, p, m)
    return [{"timeline": [(op, i, s, f if op == "F" else b, a, e) for op, i, a, e in rank]}
            for s, rank in enumerate(sim["times"])]


def test_idle_over_compute_of_a_1f1b_timeline_is_the_formula():
    got = TC.idle_over_compute(_timed("1f1b", 2, 4), 1)
    assert got["equal ops"] == pytest.approx(P.bubble_overhead(2, 4))
    assert got["replayed"] == pytest.approx(P.bubble_overhead(2, 4))
    res = _timed("1f1b", 2, 4)
    assert TC.order(res[0]) == P.schedule("1f1b", 2, 4)[0]


def test_in_stage_order_and_equal():
    a, b = torch.ones(2), torch.zeros(3)
    results = [{"grads": {0: [a], 2: [b]}}, {"grads": {1: [a * 2]}}]
    ordered = TC.in_stage_order(results)
    assert [t.shape[0] for t in ordered] == [2, 2, 3] and torch.equal(ordered[1], a * 2)
    assert TC.equal(ordered, ordered) and TC.equal([a * 4], [a], scale=4) and not TC.equal([a], [a * 2])
    assert not TC.equal([a], [a, a])


def test_timeline_rows_mark_the_second_stage():
    res = [{"timeline": [("F", 0, 0, 1.0, 0.0, 1.0), ("F", 0, 2, 1.0, 1.0, 2.0)]}]
    assert TC.timeline_rows(res) == [[("F", 0, 0.0, 1.0), ("F", "0'", 1.0, 2.0)]]


def test_run_torch_schedules_measures_unbalanced_timed_runs_again(monkeypatch):
    balanced = {n: _timed("1f1b", 2, 4) for n in TC.CONFIGS}
    skewed = {n: [balanced[n][0], {"timeline": [(*op[:3], op[3] * 2, *op[4:]) for op in balanced[n][1]["timeline"]]}]
              for n in TC.CONFIGS}                               # rank 1's ops take twice the CPU time
    assert P.rank_imbalance(skewed["1f1b, timed"]) == pytest.approx(1.0)
    calls = []

    def fake(names, ranks, timeout):
        calls.append(tuple(names))
        return {n: (skewed if len(calls) == 1 else balanced)[n] for n in names}

    monkeypatch.setattr(TC, "_run", fake)
    runs = TC.run_torch_schedules()
    assert calls == [tuple(TC.CONFIGS), TC.TIMED]               # one more launch, of the timed pair only
    assert runs["1f1b, timed"] is balanced["1f1b, timed"] and runs["gpipe"] is skewed["gpipe"]
    calls.clear()
    monkeypatch.setattr(TC, "_run", lambda names, ranks, timeout: calls.append(1) or {n: balanced[n] for n in names})
    TC.run_torch_schedules()
    assert calls == [1]                                          # balanced at once: no second launch


def test_course_vs_unsplit_on_an_uneven_batch():
    same, held = TC.course_vs_unsplit("1f1b", 2, 3, 7)              # 7 samples in 3 micro-batches
    assert same and held == P.peak_in_flight("1f1b", 2, 3) == [2, 1]
