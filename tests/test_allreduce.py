"""Hand-written all-reduces equal dist.all_reduce; the ring stepper's picture is what the ring really does."""
import pytest
import torch
import torch.distributed as dist

from course_lib.comm import allreduce
from course_lib.launch import run

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
HAND_WRITTEN = ("naive", "ring", "recursive doubling")


def compare_with_library(rank, world_size):
    """Every implementation, dtype, op and awkward size against dist.all_reduce (sum) / world_size (avg)."""
    failures = []
    sizes = (1, max(1, world_size - 1), world_size, 7, 1001, (3, 5))  # smaller than, equal to, not divisible by N
    for dtype in DTYPES:
        for size in sizes:
            g = torch.Generator().manual_seed(17 * rank + 1)
            x = (torch.randn(size, generator=g) * 1000).to(dtype)
            total = x.clone()
            dist.all_reduce(total)
            mean = (total / world_size if dtype.is_floating_point
                    else torch.div(total, world_size, rounding_mode="floor"))
            for name in HAND_WRITTEN:
                for op, want in (("sum", total), ("avg", mean)):
                    got = allreduce.IMPLEMENTATIONS[name](x.clone(), op=op)
                    ok = (torch.allclose(got, want, rtol=1e-5, atol=1e-3) if dtype.is_floating_point
                          else torch.equal(got, want))
                    if not ok or got.shape != x.shape:
                        failures.append((name, op, str(dtype), size))
    return failures


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_implementation_equals_dist_all_reduce(world_size):
    assert run(compare_with_library, world_size, backend="gloo", show_output=False, timeout=300) == [[]] * world_size


def test_results_are_identical_on_every_rank_and_non_contiguous_tensors_work():
    def worker(rank, world_size):
        out = {}
        for name in HAND_WRITTEN:
            x = (torch.arange(12.0).reshape(3, 4) * (rank + 0.1)).t()  # a transposed, non-contiguous view
            out[name] = allreduce.IMPLEMENTATIONS[name](x).clone()
        return out
    res = run(worker, 3, backend="gloo", show_output=False)
    expected = torch.arange(12.0).reshape(3, 4).t() * (0.1 + 1.1 + 2.1)
    for name in HAND_WRITTEN:
        assert all(torch.equal(r[name], res[0][name]) for r in res)  # bitwise the same on every rank
        torch.testing.assert_close(res[0][name], expected)


def test_bad_op_is_a_clear_error():
    def worker(rank, world_size):
        allreduce.ring_all_reduce(torch.ones(2), op="max")
    with pytest.raises(Exception, match=r"op must be one of \('sum', 'avg'\)"):
        run(worker, 2, backend="gloo", show_output=False)


def decode(t: torch.Tensor) -> frozenset:
    """Each rank contributes the bit 2**rank: a sum's bits name the ranks it contains."""
    v = int(t.item())
    return frozenset(r for r in range(v.bit_length()) if v >> r & 1)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_ring_stepper_state_is_what_the_real_ring_holds_after_every_step(world_size):
    def traced(rank, n):
        x = torch.full((n,), 2 ** rank, dtype=torch.int64)  # one element per chunk
        snapshots = []
        allreduce.ring_all_reduce(x, on_step=lambda step, chunks: snapshots.append([c.clone() for c in chunks]))
        return snapshots

    per_rank = run(traced, world_size, backend="gloo", show_output=False)
    for step in range(1, 2 * (world_size - 1) + 1):
        picture = allreduce.ring_state(world_size, step)
        real = [[decode(c) for c in per_rank[r][step - 1]] for r in range(world_size)]
        assert real == picture, f"step {step}"
    assert allreduce.ring_state(world_size, 0) == [[frozenset({r})] * world_size for r in range(world_size)]


def test_ring_state_rejects_steps_outside_the_algorithm():
    with pytest.raises(ValueError, match="between 0 and 2"):
        allreduce.ring_state(4, 7)
    with pytest.raises(ValueError, match="between 0 and 2"):
        allreduce.ring_state(4, -1)


def test_ring_sends_are_each_ranks_chunk_for_the_next_step():
    assert allreduce.ring_sends(4, 0) == [0, 1, 2, 3]
    assert allreduce.ring_sends(4, 3) == [1, 2, 3, 0]  # all-gather starts with each rank's finished chunk


@pytest.mark.parametrize("world_size", [2, 4, 6])
def test_traffic_per_rank_matches_the_text(world_size):
    numel, n = 1200, world_size
    S = numel * 4
    count = {name: run(allreduce.bytes_sent, n, name, numel, backend="gloo", show_output=False)
             for name in HAND_WRITTEN}
    assert count["ring"] == [2 * (n - 1) / n * S] * n              # bandwidth-optimal, the same on every rank
    assert count["naive"] == [(n - 1) * S] + [S] * (n - 1)         # rank 0 is the bottleneck
    p = 1 << (n.bit_length() - 1)
    folded = [S * (p.bit_length() - 1 + (r + p < n)) if r < p else S for r in range(n)]
    assert count["recursive doubling"] == folded


def test_ring_stepper_widget_follows_its_sliders():
    from course_lib.viz.widgets import RingStepper
    st = RingStepper(world_size=3, step=2)
    assert st.state == allreduce.ring_state(3, 2)
    st.world_size.value = 6
    assert st.step.max == 10
    st.step.value = 10
    assert st.state == allreduce.ring_state(6, 10)
    st.world_size.value = 2  # the step is clamped to the new maximum
    assert st.step.value == 2 and st.state == allreduce.ring_state(2, 2)
