"""Each check passes its reference, says 'not attempted yet' for a stub and explains known wrong answers."""
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex01


def stub(rank, world_size):
    raise NotImplementedError


def test_references_pass():
    assert ex01.check_ring_shift(ex01.ring_shift).status == PASSED
    assert ex01.check_global_mean(ex01.global_mean).status == PASSED


def test_stubs_are_not_attempted():
    for check in (ex01.check_ring_shift, ex01.check_global_mean):
        fb = check(stub)
        assert fb.status == NOT_ATTEMPTED and not fb
        assert "not attempted yet" in repr(fb)


def ring(direction, returned="received"):
    def shift(rank, world_size):
        mine, received = torch.tensor([100.0 + rank]), torch.empty(1)
        reqs = [dist.isend(mine, dst=(rank + direction) % world_size),
                dist.irecv(received, src=(rank - direction) % world_size)]
        for r in reqs:
            r.wait()
        return {"received": received, "mine": mine, "none": None}[returned]
    return shift


def test_ring_wrong_answers_are_explained():
    fb = ex01.check_ring_shift(ring(-1))
    assert fb.status == WRONG and "wrong way round" in fb.message
    fb = ex01.check_ring_shift(ring(+1, returned="mine"))
    assert fb.status == WRONG and "its own value" in fb.message
    fb = ex01.check_ring_shift(ring(+1, returned="none"))
    assert fb.status == WRONG and "returned None" in fb.message


def test_ring_deadlock_is_explained_not_hung():
    def blocking_recv_first(rank, world_size):
        received = torch.empty(1)
        dist.recv(received, src=(rank - 1) % world_size)  # everyone waits: nobody sends
        dist.send(torch.tensor([100.0 + rank]), dst=(rank + 1) % world_size)
        return received
    fb = ex01.check_ring_shift(blocking_recv_first)
    assert fb.status == WRONG and "deadlock" in fb.message


def test_global_mean_wrong_answers_are_explained():
    def local_mean(rank, world_size):
        return ex01.shard(rank).mean().item()

    def mean_of_means(rank, world_size):
        m = ex01.shard(rank).mean().reshape(1)
        dist.all_reduce(m)
        return m / world_size

    def forgot_to_divide(rank, world_size):
        m = ex01.shard(rank).mean().reshape(1)
        dist.all_reduce(m)
        return m

    def used_reduce(rank, world_size):
        d = ex01.shard(rank)
        t = torch.tensor([d.sum(), d.numel()], dtype=torch.float64)
        dist.reduce(t, dst=0)
        return (t[0] / t[1]).item()

    expectations = {local_mean: "its own shard", mean_of_means: "averaged the per-rank means",
                    forgot_to_divide: "world_size times too big", used_reduce: "only rank 0"}
    for fn, phrase in expectations.items():
        fb = ex01.check_global_mean(fn)
        assert fb.status == WRONG and phrase in fb.message, (fn.__name__, fb)


def test_a_non_function_is_explained():
    fb = ex01.check_global_mean(3.0)  # a value, not a function
    assert fb.status == WRONG and "pass your function itself" in fb.message
