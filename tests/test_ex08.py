"""Notebook 08's exercise check: a hang made an error, within seconds, and the right mean when all ranks arrive."""
from datetime import timedelta

import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex08


def test_the_reference_passes_and_names_the_missing_rank(no_leftovers):
    fb = ex08.check_mean_loss(ex08.mean_loss)
    assert fb.status == PASSED and "naming the missing rank" in fb.message, fb


def test_a_process_group_timeout_passes_too(no_leftovers):
    def with_a_group_timeout(loss):
        group = dist.new_group(timeout=timedelta(seconds=3))
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total.item() / dist.get_world_size()
    assert ex08.check_mean_loss(with_a_group_timeout).status == PASSED


def test_the_stub_and_the_wrong_answers(no_leftovers):
    def stub(loss):
        raise NotImplementedError
    assert ex08.check_mean_loss(stub).status == NOT_ATTEMPTED

    def plain_all_reduce(loss):                       # the hang itself
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()

    def forgot_to_divide(loss):
        dist.monitored_barrier(timeout=timedelta(seconds=5))
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()

    def no_collective(loss):
        return float(loss)

    for fn, phrase in ((plain_all_reduce, "nothing turned the wait into an error"),
                       (forgot_to_divide, "the mean loss 2"), (no_collective, "the mean loss 2")):
        fb = ex08.check_mean_loss(fn)
        assert fb.status == WRONG and phrase in fb.message, fb


def test_a_0_d_tensor_answer_passes(no_leftovers):
    def as_a_tensor(loss):
        dist.monitored_barrier(timeout=timedelta(seconds=5))
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / dist.get_world_size()          # a 0-d tensor, not .item()
    assert ex08.check_mean_loss(as_a_tensor).status == PASSED
