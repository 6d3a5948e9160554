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
