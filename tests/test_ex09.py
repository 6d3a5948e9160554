"""Notebook 09's exercise check: passes the reference, 'not attempted yet' for the stub, names known wrong answers."""
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex09


def stub(flat_param, make_optimizer):
    raise NotImplementedError


def variant(divide=True, gather=True, whole=False, optimizer_per_step=False, all_reduce=False, no_step=False,
            list_scatter=False, list_gather=False, gather_by_all_reduce=False, broadcast=False, gather_first=False):
    """ZeRO-1 with one known mistake switched on."""
    def zero1(flat_param, make_optimizer):
        rank, n = dist.get_rank(), dist.get_world_size()
        shard = flat_param.chunk(n)[rank].clone()
        optimizer = make_optimizer([flat_param if whole else shard])

        def step(flat_grad):
            nonlocal optimizer
            if whole:                                    # every rank steps every parameter
                dist.all_reduce(flat_grad)
                flat_param.grad = flat_grad / n
                optimizer.step()
                return
            if optimizer_per_step:
                optimizer = make_optimizer([shard])
            if all_reduce:                               # the whole average on every rank, then a slice of it
                whole_grad = flat_grad.clone()
                dist.all_reduce(whole_grad)
                grad = whole_grad.chunk(n)[rank]
            elif list_scatter:                           # notebook 02's list form: one chunk per rank
                grad = torch.empty_like(shard)
                dist.reduce_scatter(grad, list(flat_grad.chunk(n)))
            else:
                grad = torch.empty_like(shard)
                ex09.reduce_scatter_single(grad, flat_grad)
            shard.grad = grad / n if divide else grad
            if gather_first:
                ex09.all_gather_single(flat_param, shard)
            if not no_step:
                optimizer.step()
            if not gather or gather_first:
                return
            if list_scatter:                             # the list all-gather straight into views of flat_param
                dist.all_gather(list(flat_param.chunk(n)), shard)
            elif list_gather:                            # into separate tensors, then one torch.cat
                parts = [torch.empty_like(shard) for _ in range(n)]
                dist.all_gather(parts, shard)
                flat_param.copy_(torch.cat(parts))
            elif gather_by_all_reduce:                   # zero-padded parameters, all-reduced
                padded = torch.zeros_like(flat_param)
                padded.chunk(n)[rank].copy_(shard)
                dist.all_reduce(padded)
                flat_param.copy_(padded)
            elif broadcast:                              # one broadcast per rank
                for r, part in enumerate(flat_param.chunk(n)):
                    if r == rank:
                        part.copy_(shard)
                    dist.broadcast(part, src=r)
            else:
                ex09.all_gather_single(flat_param, shard)
        return step
    return zero1


def test_the_reference_passes_and_the_stub_is_not_attempted(no_leftovers):
    assert ex09.check_zero1(ex09.zero1).status == PASSED
    fb = ex09.check_zero1(stub)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


def test_the_list_form_collectives_of_notebooks_01_and_02_pass(no_leftovers):
    """dist.reduce_scatter(out, chunks) and dist.all_gather(parts, shard) count the whole buffer, not one chunk."""
    for fn in (variant(list_scatter=True), variant(list_gather=True)):
        fb = ex09.check_zero1(fn)
        assert fb.status == PASSED, fb


def test_known_wrong_answers_are_named(no_leftovers):
    cases = {variant(divide=False): "times too large",
             variant(gather=False): "all-gather is missing",
             variant(whole=True): "every rank steps every parameter",
             variant(optimizer_per_step=True): "build the optimizer once",
             variant(all_reduce=True): "all-reduces the whole gradient and keeps its slice",
             variant(no_step=True): "optimizer.step() is missing",
             variant(gather_by_all_reduce=True): "all-reduces the zero-padded parameters instead of all-gathering",
             variant(broadcast=True): "'reduce-scatter', 'broadcast', 'broadcast'",
             variant(gather_first=True): "only then all-gather"}
    for fn, phrase in cases.items():
        fb = ex09.check_zero1(fn)
        assert fb.status == WRONG and phrase in fb.message, fb


def test_a_step_that_is_not_returned_is_explained():
    fb = ex09.check_zero1(lambda flat_param, make_optimizer: None)
    assert fb.status == WRONG and "must return the function step" in fb.message


def test_the_reference_without_division_really_differs():
    """The check can only name a missing division if SGD makes it visible (Adam would not)."""
    right, too_big = ex09.reference(2), ex09.reference(2, gradient_scale=2)
    assert (right - too_big).abs().max() > 1e-3
