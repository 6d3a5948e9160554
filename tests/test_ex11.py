"""Notebook 11's exercise checks: each passes its reference and a hand-written answer, says 'not attempted yet' for
the stub, and names each usual mistake with its own message."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import tensor_parallel as tp
from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex11


def make_f(forward_reduce=False, backward_reduces=1, average=False, use_group=True, extra_forward=None,
           broadcast=False, in_place=False, undefined_name=False, odd_ranks_double=False):
    """An f with the all-reduce in the forward or not, 0, 1 or 2 all-reduces in the backward, with or without the
    group; a broadcast forward; an in-place all-reduce of the gradient; a name never imported."""
    class MyF(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group if use_group else None
            if forward_reduce:
                x = x.clone()
                dist.all_reduce(x, group=ctx.group)
            if broadcast:
                x = x.clone()
                dist.broadcast(x, src=dist.get_process_group_ranks(ctx.group or dist.group.WORLD)[0], group=ctx.group)
            if odd_ranks_double and dist.get_rank() % 2 == 1:
                x = x * 2
            if extra_forward:
                dist.barrier(group=ctx.group)
                dist.all_reduce(torch.zeros(1, dtype=x.dtype), group=ctx.group)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if undefined_name:
                eval("distt").all_reduce(grad)        # a NameError, as from a module never imported in the kernel
            grad = grad if in_place else grad.clone()
            for _ in range(backward_reduces):
                dist.all_reduce(grad, group=ctx.group)
            return (grad / dist.get_world_size(ctx.group) if average else grad), None

    return MyF.apply


def stub(x, group=None):
    raise NotImplementedError


def test_the_reference_passes():
    fb = ex11.check_f(tp.f)
    assert fb.status == PASSED and fb, fb
    assert ex11.check_f(make_f()).status == PASSED   # written by hand, as the learner would


def test_the_stub_is_not_attempted():
    fb = ex11.check_f(stub)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


@pytest.mark.parametrize("fn, phrase", [
    (make_f(backward_reduces=0), "all-reduce forgotten in backward"),
    (make_f(forward_reduce=True), "summed x over the ranks"),
    (make_f(backward_reduces=2), "all-reduce done twice in backward"),
    (make_f(forward_reduce=True, backward_reduces=0), "that is g, not f"),
    (make_f(average=True), "averaged"),
    (make_f(use_group=False), "not over the group of 2"),
    (make_f(extra_forward=True), "your forward ran collectives"),
    (make_f(odd_ranks_double=True), "the forward changed x (rank 1 got"),   # the first rank whose y differs
    (make_f(in_place=True), "changed the gradient it was handed, in place"),
    (make_f(undefined_name=True), "never imported in this kernel"),
    (lambda x, group: x.detach() + 0, "no gradient reached x"),
    (lambda x, group: x * 2, "the forward changed x"),
    (lambda x, group: [x], "returned a list"),
    (lambda x: x, "f takes (x, group)"),
])
def test_known_mistakes_are_named(fn, phrase):
    fb = ex11.check_f(fn)
    assert fb.status == WRONG and phrase in fb.message, fb


def test_a_broadcast_forward_is_named():
    fb = ex11.check_f(make_f(broadcast=True))   # counted by CollectiveLog, or else seen in y (rank 1 changed)
    assert fb.status == WRONG and ("your forward ran collectives ['broadcast']" in fb.message
                                   or "the forward changed x (rank 1 got" in fb.message), fb


def test_a_deadlock_is_an_error_not_a_hang():
    class OnlyRankZero(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if dist.get_rank() == 0:
                dist.all_reduce(grad)
            return grad, None

    fb = ex11.check_f(OnlyRankZero.apply)
    assert fb.status == WRONG and ("did not finish" in fb.message or "raised" in fb.message), fb


# --- exercise 2: the column- and row-parallel layers ---------------------------------------------------------

def make_layers(column_dim=0, row_dim=1, f_entry=True, g_exit=True, bias_before=False, global_rank=False,
                split_row_bias=False, world_size_of_world=False, row_bias_divided=False, interleaved=False,
                column_bias=True, column_whole_bias=False):
    """A column- and a row-parallel layer as a learner writes them, with one mistake or none."""
    def rank_and_size(group):
        rank = dist.get_rank() if global_rank else dist.get_rank(group)
        return rank, dist.get_world_size() if world_size_of_world else dist.get_world_size(group)

    class Column(nn.Module):
        def __init__(self, linear, group):
            super().__init__()
            self.group = group
            rank, n = rank_and_size(group)
            size = linear.weight.shape[column_dim] // n
            mine = slice(rank, None, n) if interleaved else slice(rank * size, (rank + 1) * size)
            weight = linear.weight.detach()
            self.weight = nn.Parameter((weight[mine] if column_dim == 0 else weight[:, mine]).clone())
            bias = linear.bias.detach()
            if column_bias:
                self.bias = nn.Parameter((bias if column_whole_bias else bias[mine]).clone())
            else:
                self.b = nn.Parameter(bias[mine].clone())    # the bias under another name

        def forward(self, x):
            if f_entry:
                x = tp.f(x, self.group)
            return F.linear(x, self.weight, self.bias if column_bias else self.b)

    class Row(nn.Module):
        def __init__(self, linear, group):
            super().__init__()
            self.group = group
            rank, n = rank_and_size(group)
            size = linear.weight.shape[row_dim] // n
            mine = slice(rank, None, n) if interleaved else slice(rank * size, (rank + 1) * size)
            weight = linear.weight.detach()
            self.weight = nn.Parameter((weight[:, mine] if row_dim == 1 else weight[mine]).clone())
            bias = linear.bias.detach()
            self.bias = nn.Parameter((bias.chunk(n)[rank] if split_row_bias else bias / n if row_bias_divided
                                      else bias).clone())

        def forward(self, x):
            before = bias_before or row_bias_divided
            partial = F.linear(x, self.weight, self.bias if before else None)
            y = tp.g(partial, self.group) if g_exit else partial
            return y if before else y + self.bias

    return Column, Row


def test_the_parallel_mlp_passes_the_reference_and_a_hand_written_answer():
    fb = ex11.check_parallel_mlp(tp.ColumnParallelLinear, tp.RowParallelLinear)
    assert fb.status == WRONG and "switched off" in fb.message, fb   # the library's own layers are refused
    fb = ex11.check_parallel_mlp(*make_layers())
    assert fb.status == PASSED and fb, fb


def test_the_parallel_mlp_stub_is_not_attempted():
    class Stub(nn.Module):
        def __init__(self, linear, group):
            raise NotImplementedError

    assert ex11.check_parallel_mlp(Stub, Stub).status == NOT_ATTEMPTED


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(column_dim=1), "the column-parallel layer kept columns of W"),
    (dict(row_dim=0), "the row-parallel layer kept rows of W"),
    (dict(f_entry=False), "no collective in the backward"),
    (dict(g_exit=False), "no collective in the forward"),
    (dict(bias_before=True), "the bias is counted 2 times"),
    (dict(global_rank=True), "not the global rank"),
    (dict(split_row_bias=True), "split its bias"),
    (dict(world_size_of_world=True), "the group's size, not the world's"),
    (dict(row_bias_divided=True), "The row layer's bias must be the whole bias, added once after g"),
    (dict(interleaved=True), "interleaved split"),
    (dict(column_bias=False), "up.bias is missing"),
    (dict(column_whole_bias=True), "the column-parallel layer kept the whole bias"),
])
def test_parallel_mlp_mistakes_are_named(kwargs, phrase):
    fb = ex11.check_parallel_mlp(*make_layers(**kwargs))
    assert fb.status == WRONG and phrase in fb.message, fb


class SolutionG(torch.autograd.Function):
    """A right g, written by hand (the course's g without its helper)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GReducingTwice(SolutionG):
    """End exercise 1's MyG, as the notebook's solution prints it: g's backward all-reduces too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return SolutionG.forward(ctx, x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _row_with(g_apply):
    _, Row = make_layers()

    class RowWithG(Row):
        def forward(self, x):
            return g_apply(F.linear(x, self.weight), self.group) + self.bias

    return RowWithG


def test_end_exercise_1_the_solutions_g_passes_and_a_g_reducing_backward_fails():
    Column, _ = make_layers()
    assert ex11.check_parallel_mlp(Column, _row_with(SolutionG.apply)).status == PASSED
    fb = ex11.check_parallel_mlp(Column, _row_with(GReducingTwice.apply))
    assert fb.status == WRONG and "g's backward is the identity" in fb.message, fb


def _g_reducing_twice_worker(rank, world_size):
    """End exercise 1's claim: with MyG, every gradient before g is t times too large, down.bias's is right."""
    from course_lib.models.transformer import MLP
    torch.manual_seed(0)
    full = MLP(8, 16).double()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_full, x_part = x.clone().requires_grad_(), x.clone().requires_grad_()
    full(x_full).pow(2).sum().backward()
    Column, _ = make_layers()
    up, down = Column(full.up, dist.group.WORLD), _row_with(GReducingTwice.apply)(full.down, dist.group.WORLD)
    down(F.gelu(up(x_part))).pow(2).sum().backward()
    mine = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
    return {"input": torch.allclose(x_part.grad, world_size * x_full.grad),
            "up.weight": torch.allclose(up.weight.grad, world_size * full.up.weight.grad[mine]),
            "down.weight": torch.allclose(down.weight.grad, world_size * full.down.weight.grad[:, mine]),
            "down.bias": torch.allclose(down.bias.grad, full.down.bias.grad)}


def test_end_exercise_1_every_gradient_before_g_is_t_times_too_large():
    from course_lib.launch import run
    for result in run(_g_reducing_twice_worker, 2, backend="gloo", show_output=False):
        assert all(result.values()), result
