"""Notebook 04's exercise check: global batch statistics pass the reference, say 'not attempted yet' for a stub and
explain known wrong answers."""
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex04


def test_global_batch_stats_check():
    assert ex04.check_global_batch_stats(ex04.global_batch_stats).status == PASSED

    def stub(x):
        raise NotImplementedError
    assert ex04.check_global_batch_stats(stub).status == NOT_ATTEMPTED

    def local_only(x):
        return x.mean(0), x.var(0, unbiased=False)

    def mean_of_means(x):
        mean, var = x.mean(0), x.var(0, unbiased=False)
        dist.all_reduce(mean)
        dist.all_reduce(var)
        return mean / dist.get_world_size(), var / dist.get_world_size()

    def weighted_mean_averaged_variances(x):
        sums = torch.cat([x.sum(0), torch.tensor([float(len(x))], dtype=x.dtype)])
        var = x.var(0, unbiased=False)
        dist.all_reduce(sums)
        dist.all_reduce(var)
        return sums[:-1] / sums[-1], var / dist.get_world_size()

    def unbiased(x):
        mean, var = ex04.global_batch_stats(x)
        count = torch.tensor([float(len(x))], dtype=x.dtype)
        dist.all_reduce(count)
        return mean, var * count / (count - 1)

    for fn, phrase in ((local_only, "its own batch"), (mean_of_means, "averaged the ranks' means"),
                       (weighted_mean_averaged_variances, "not the average of the ranks' variances"),
                       (unbiased, "biased variance")):
        fb = ex04.check_global_batch_stats(fn)
        assert fb.status == WRONG and phrase in fb.message, fb


# ---- notebook 04's end exercise: a BatchNorm over all ranks, differentiable (its folded solution) -------------
import torch.distributed.nn.functional as dist_fn  # noqa: E402

from course_lib.launch import run  # noqa: E402


class GlobalBatchNorm1d(torch.nn.Module):
    def __init__(self, differentiable=True):
        super().__init__()
        self.differentiable = differentiable

    def forward(self, x):
        count = torch.tensor([float(len(x))], dtype=x.dtype)
        packed = torch.cat([x.sum(0), (x * x).sum(0), count])
        if self.differentiable:
            sums = dist_fn.all_reduce(packed)
        else:
            sums = packed.clone()
            dist.all_reduce(sums)                       # invisible to autograd
        c = x.shape[1]
        mean = sums[:c] / sums[-1]
        var = sums[c:2 * c] / sums[-1] - mean ** 2
        return (x - mean) / torch.sqrt(var + 1e-5)


def compare(rank, world_size, differentiable):
    x = (torch.randn(4 + rank, 6, generator=torch.Generator().manual_seed(rank)) + rank).requires_grad_()
    y = GlobalBatchNorm1d(differentiable)(x)
    (y * torch.arange(6.0)).sum().backward()
    return x.detach(), y.detach(), x.grad


def test_notebook_04_solution_global_batchnorm_equals_one_process_only_when_differentiable():
    for differentiable in (True, False):
        out = run(compare, 3, differentiable, backend="gloo", show_output=False)
        union = torch.cat([x for x, _, _ in out]).requires_grad_()
        one = torch.nn.functional.batch_norm(union, None, None, training=True, eps=1e-5)
        (one * torch.arange(6.0)).sum().backward()
        assert torch.allclose(torch.cat([y for _, y, _ in out]), one, atol=1e-5)
        same_grads = torch.allclose(torch.cat([g for _, _, g in out]), union.grad, atol=1e-5)
        assert same_grads == differentiable
