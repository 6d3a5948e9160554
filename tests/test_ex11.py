"""Notebook 11's exercise check: passes the reference f, says 'not attempted yet' for the stub, names mistakes."""
import pytest
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex11
from course_lib.tensor_parallel import f as reference_f


def make_f(forward_reduce: bool, backward_reduces: int, average: bool = False):
    """An f with the all-reduce in the forward or not, and 0, 1 or 2 all-reduces in the backward."""
    class MyF(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if forward_reduce:
                x = x.clone()
                dist.all_reduce(x)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            for _ in range(backward_reduces):
                dist.all_reduce(grad)
            return grad / dist.get_world_size() if average else grad

    return MyF.apply


def stub(x):
    raise NotImplementedError


def test_the_reference_passes():
    fb = ex11.check_f(reference_f)
    assert fb.status == PASSED and fb, fb
    assert ex11.check_f(make_f(False, 1)).status == PASSED   # written by hand, as the learner would


def test_the_mlp_check_runs_in_float64_with_a_wide_margin():
    from course_lib.launch import run
    for r in run(ex11.in_an_mlp, 2, reference_f, backend="gloo", show_output=False):
        assert r["grad"].dtype == torch.float64
        # a correct f agrees to float64 rounding: a million times inside the check's rtol of 1e-6
        assert torch.allclose(r["grad"], r["expected"], rtol=1e-12, atol=1e-15)


def test_the_stub_is_not_attempted():
    fb = ex11.check_f(stub)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


@pytest.mark.parametrize("fn, phrase", [
    (make_f(False, 0), "all-reduce forgotten in backward"),
    (make_f(True, 1), "all-reduce done twice"),
    (make_f(False, 2), "all-reduce done twice in backward"),
    (make_f(True, 0), "that is g, not f"),
    (make_f(False, 1, average=True), "averaged"),
    (lambda x: x.detach() + 0, "no gradient reached x"),
    (lambda x: x * 2, "the forward changed x"),
    (lambda x: [x], "returned a list"),
])
def test_known_mistakes_are_named(fn, phrase):
    fb = ex11.check_f(fn)
    assert fb.status == WRONG and phrase in fb.message, fb


def test_a_deadlock_is_an_error_not_a_hang():
    class OnlyRankZero(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if dist.get_rank() == 0:
                dist.all_reduce(grad)
            return grad

    fb = ex11.check_f(OnlyRankZero.apply)
    assert fb.status == WRONG and ("did not finish" in fb.message or "raised" in fb.message), fb
