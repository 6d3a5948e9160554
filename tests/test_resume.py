"""Resuming FSDP2 training with DCP (course_lib.zero.resume): with the scheduler, every rank's generator and the
data position saved, a resumed run ends with the uninterrupted run's weights, bit for bit; without them it does not."""
import pytest

from course_lib.launch import run
from course_lib.zero import resume, training

ALL = ("model", "scheduler", "rng", "data")


@pytest.mark.parametrize("parts, asynchronous, equal", [
    (ALL, False, True), (ALL, True, True), (("model",), False, False), (("model", "scheduler", "data"), False, False),
    (("model", "rng", "data"), False, False)])
def test_resumed_equals_uninterrupted_only_with_everything(tmp_path, parts, asynchronous, equal):
    results = run(resume.resume_worker, 2, str(tmp_path / "checkpoint"), parts, asynchronous, backend="gloo",
                  show_output=False)
    gaps = [training.max_difference(r["straight"], r["resumed"]) for r in results]
    assert all(g == 0.0 for g in gaps) if equal else all(g > 1e-4 for g in gaps), gaps
    if asynchronous:
        assert results[0]["async"]                       # torch 2.13 has dcp.async_save, on CPU and Gloo too
