"""Notebook 06's exercise check: passes the reference, 'not attempted yet' for the stub, names each known mistake."""
import copy

import pytest
import torch.nn as nn

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex06


class Parts(nn.Module):
    """A learner's split model: parts run in order (or reversed), moving the activation (or not)."""

    def __init__(self, parts, devices, move=True, reverse=False):
        super().__init__()
        self.parts, self.devices, self.move, self.reverse = nn.ModuleList(parts), devices, move, reverse

    def forward(self, x):
        pairs = list(zip(self.parts, self.devices))
        for part, device in reversed(pairs) if self.reverse else pairs:
            x = part(x.to(device) if self.move else x)
        return x


def learner(cut=lambda a, b: (a, b), move=True, reverse=False, copy_layers=False, place="each"):
    """A split function as a learner might write it; the keywords put one known mistake in."""
    def my_split(model, points, devices):
        bounds = [0, *points, len(model)]
        parts = []
        for a, b, device in zip(bounds, bounds[1:], devices):
            lo, hi = cut(a, b)
            part = nn.Sequential(*list(model)[lo:hi])
            part = copy.deepcopy(part) if copy_layers else part
            parts.append(part.to(device) if place == "each" else part.to(devices[0]) if place == "first" else part)
        return Parts(parts, devices, move, reverse)
    return my_split


def test_the_reference_and_a_learners_right_answer_pass():
    assert ex06.check_split(ex06.reference_split).status == PASSED
    assert ex06.check_split(learner()).status == PASSED


def test_the_stub_is_not_attempted():
    def my_split(model, points, devices):
        raise NotImplementedError
    fb = ex06.check_split(my_split)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


@pytest.mark.parametrize("mistake, phrase", [
    (learner(cut=lambda a, b: (a, b - 1)), "layer(s) [3, 7] never ran: an off-by-one"),
    (learner(cut=lambda a, b: (a + 1, b)), "layer(s) [0, 4] never ran: an off-by-one"),
    (learner(cut=lambda a, b: (a, b + 1)), "layer(s) [4] ran twice: the parts overlap"),
    (learner(move=False), "at split point 4 (between layer 3 and layer 4) the activation was not moved"),
    (learner(reverse=True), "ran in the order [4, 5, 6, 7, 0, 1, 2, 3]: the parts run in the wrong order"),
    (learner(place="never"), "part 0 (layers 0 to 3) was never put on its device: call .to(devices[0])"),
    (learner(place="first"), "part 1 (layers 4 to 7) went to devices[0], not devices[1]"),
    (learner(copy_layers=True), "the model's own layers got no gradient: did you copy them"),
    (lambda model, points, devices: model, "returned the model itself"),
    (lambda model, points, devices: None, "returned NoneType, which cannot be called"),
    (lambda model, points, devices: 1 / 0, "ZeroDivisionError"),
])
def test_known_mistakes_are_named(mistake, phrase):
    fb = ex06.check_split(mistake)
    assert fb.status == WRONG and phrase in fb.message, fb


def test_a_move_only_at_the_start_is_not_enough():
    """Moving the input to the first part's device, then never again: the second split point is reported."""
    def my_split(model, points, devices):
        parts = learner()(model, points, devices).parts

        def forward(x):
            x = x.to(devices[0])
            for part in parts:
                x = part(x)
            return x
        return forward
    fb = ex06.check_split(my_split)
    assert fb.status == WRONG and "at split point 4" in fb.message and "not moved" in fb.message


def test_a_device_error_from_real_gpus_is_explained():
    def my_split(model, points, devices):
        def forward(x):
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        return forward
    fb = ex06.check_split(my_split)
    assert fb.status == WRONG and "Hint: the activation was not moved" in fb.message


def test_a_wrong_computation_is_caught_by_the_numbers():
    def my_split(model, points, devices):
        split = ex06.reference_split(model, points, devices)
        return lambda x: split(x) * 2
    fb = ex06.check_split(my_split)
    assert fb.status == WRONG and "the output differs from the unsplit model's" in fb.message
    assert "pass your function itself" in ex06.check_split(None).message
