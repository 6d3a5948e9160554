"""Notebook 09's ZeRO-3 layer exercise: the check passes the reference and names each usual mistake."""
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG
from course_lib.exercises import ex09_zero3 as ex


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_y):
        raise NotImplementedError


def variant(keep_weight=False, regather=True, all_reduce=False, divide=True, grad_x=True, whole_grad=False):
    """The reference with one usual mistake switched on."""
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            weight, bias = ex.unflatten(ex.gather(shard))
            ctx.save_for_backward(x, shard, weight) if keep_weight else ctx.save_for_backward(x, shard)
            return x @ weight.T + bias

        @staticmethod
        def backward(ctx, grad_y):
            x, shard, *kept = ctx.saved_tensors
            weight = ex.unflatten(ex.gather(shard))[0] if regather else kept[0]
            grad_flat = torch.cat([(grad_y.T @ x).reshape(-1), grad_y.sum(0)])
            n = dist.get_world_size()
            if whole_grad:
                return grad_y @ weight, grad_flat
            if all_reduce:
                dist.all_reduce(grad_flat)
                grad_shard = grad_flat.chunk(n)[dist.get_rank()].clone()
            else:
                grad_shard = torch.empty_like(shard)
                ex.reduce_scatter_single(grad_shard, grad_flat)
            return (grad_y @ weight if grad_x else None), (grad_shard / n if divide else grad_shard)
    return Wrong


def test_the_reference_passes_and_the_stub_is_not_attempted(no_leftovers):
    assert ex.check_zero3(ex.Zero3Linear).status == PASSED
    fb = ex.check_zero3(Stub)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


def test_each_usual_mistake_is_named(no_leftovers):
    cases = [(variant(keep_weight=True, regather=False), "backward issued no all-gather"),
             (variant(keep_weight=True), "never freed: after forward, 3 layers' whole parameters"),
             (variant(all_reduce=True), "backward all-reduces the whole gradient"),
             (variant(divide=False), "times too large"),
             (variant(grad_x=False), "got no gradient"),
             (variant(whole_grad=True), "grad_shard has the shard's size")]
    for fn, phrase in cases:
        fb = ex.check_zero3(fn)
        assert fb.status == WRONG and phrase in fb.message, (phrase, fb)


class ListForm(torch.autograd.Function):
    """Notebook 02's list forms: dist.all_gather into parts + torch.cat, dist.reduce_scatter of the chunks. Right."""

    @staticmethod
    def forward(ctx, x, shard):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        weight, bias = ex.unflatten(torch.cat(parts))
        ctx.save_for_backward(x, shard)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        n = dist.get_world_size()
        parts = [torch.empty_like(shard) for _ in range(n)]
        dist.all_gather(parts, shard)
        weight, _ = ex.unflatten(torch.cat(parts))
        grad_flat = torch.cat([(grad_y.T @ x).reshape(-1), grad_y.sum(0)])
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter(grad_shard, list(grad_flat.chunk(n)))
        return grad_y @ weight, grad_shard / n


BUFFER = {}


class ReusedBuffer(torch.autograd.Function):
    """Every layer gathered into the same buffer (as FSDP's pools do): one layer whole at a time. Right."""

    @staticmethod
    def forward(ctx, x, shard):
        buffer = BUFFER.setdefault("whole", torch.empty(ex.NUMEL))
        ex.all_gather_single(buffer, shard)
        weight, bias = ex.unflatten(buffer)
        ctx.save_for_backward(x, shard)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        ex.all_gather_single(BUFFER["whole"], shard)
        weight, _ = ex.unflatten(BUFFER["whole"])
        grad_flat = torch.cat([(grad_y.T @ x).reshape(-1), grad_y.sum(0)])
        grad_shard = torch.empty_like(shard)
        ex.reduce_scatter_single(grad_shard, grad_flat)
        return grad_y @ weight, grad_shard / dist.get_world_size()


class KeptOnCtx(ex.Zero3Linear):
    """Keeps the whole weight on ctx (not through save_for_backward), and gathers again in backward anyway."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.kept = ex.gather(shard)
        weight, bias = ex.unflatten(ctx.kept)
        ctx.save_for_backward(x, shard)
        return x @ weight.T + bias


def test_right_answers_in_other_forms_pass_every_time(no_leftovers):
    """The list forms and a reused buffer hold one layer whole at a time: they pass, run after run."""
    for fn in (ListForm, ReusedBuffer, ListForm):
        BUFFER.clear()
        fb = ex.check_zero3(fn)
        assert fb.status == PASSED, (fn.__name__, fb)


def test_a_weight_kept_on_ctx_is_named(no_leftovers):
    fb = ex.check_zero3(KeptOnCtx)
    assert fb.status == WRONG and "never freed: after forward, 3 layers' whole parameters" in fb.message, fb


def test_a_function_that_is_not_an_autograd_function_is_explained():
    fb = ex.check_zero3(lambda x, shard: x)
    assert fb.status == WRONG and "autograd Function class" in fb.message


def test_without_division_the_weights_really_differ():
    right, too_big = ex.reference(2), ex.reference(2, gradient_scale=2)
    assert max((a - b).abs().max().item() for a, b in zip(right, too_big)) > 1e-3


def teaching_and_library_worker(rank, world_size):
    """The reference Function and the library's fully_shard train the same stack the same way."""
    import torch.nn as nn

    from course_lib.zero import full_state_dict, fully_shard
    taught = ex.trial(rank, world_size, ex.Zero3Linear)["final"]
    layers, x, y = ex._problem(world_size)
    model = nn.Sequential(*[m for _ in range(ex.DEPTH) for m in (nn.Linear(ex.WIDTH, ex.WIDTH), nn.ReLU())][:-1])
    with torch.no_grad():
        for k, flat in enumerate(layers):
            weight, bias = ex.unflatten(flat)
            model[2 * k].weight.copy_(weight)
            model[2 * k].bias.copy_(bias)
    model = fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=ex.LR, momentum=ex.MOMENTUM)
    mine = slice(rank * ex.BATCH, (rank + 1) * ex.BATCH)
    for t in range(ex.STEPS):
        optimizer.zero_grad()
        (model(x[t, mine]) - y[t, mine]).pow(2).mean().backward()
        optimizer.step()
    state = full_state_dict(model)
    library = [torch.cat([state[f"{2 * k}.weight"].reshape(-1), state[f"{2 * k}.bias"]]) for k in range(ex.DEPTH)]
    return max((a - b).abs().max().item() for a, b in zip(taught, library))


def test_the_teaching_layer_equals_the_librarys_fully_shard(no_leftovers):
    from course_lib.launch import run
    assert max(run(teaching_and_library_worker, 2, backend="gloo", show_output=False)) < 1e-6
