"""The concurrency a machine gives right now, and the speed-up claims made relative to it."""
import pytest

from course_lib.parallelism import SHOWABLE, concurrency, expected_speedup


def test_concurrency_is_between_one_and_the_number_of_processes():
    for n in (1, 2, 3):
        c = concurrency(n, size=64, reps=5, rounds=1)
        assert 1.0 <= c <= n
    assert concurrency(1, size=64, reps=5, rounds=1) == 1.0


def test_expected_speedup_scales_with_what_the_machine_gives():
    assert expected_speedup(1.0, 2.0) is None and expected_speedup(SHOWABLE - 0.01, 2.0) is None
    free, busy = expected_speedup(2.0, 2.0), expected_speedup(1.33, 2.0)
    assert free == pytest.approx(1.6) and 1.0 < busy < free
    assert expected_speedup(4.0, 2.0) == pytest.approx(1.6)          # more cores than processes: capped
    assert expected_speedup(2.0, 3.0, processes=3) == pytest.approx(1 + 0.6 * 1.0)
    with pytest.raises(ValueError, match="2 or more processes"):
        expected_speedup(2.0, 2.0, processes=1)
