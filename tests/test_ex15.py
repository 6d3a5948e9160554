"""Notebook 15's checks: each passes its reference and fails each named wrong answer with its own message."""
import pytest
import torch

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex15


def stub(*args):
    raise NotImplementedError


# --- the merge ---------------------------------------------------------------------------------------------

def merge_by_hand(out_a, lse_a, out_b, lse_b):            # as a learner writes it
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def summed(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def averaged(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def swapped(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_b - lse)[..., None] + out_b * torch.exp(lse_a - lse)[..., None], lse


def with_exp(out_a, lse_a, out_b, lse_b):                 # exact on paper, overflows at lse ≈ 1000
    a, b = torch.exp(lse_a)[..., None], torch.exp(lse_b)[..., None]
    return (out_a * a + out_b * b) / (a + b), torch.log(torch.exp(lse_a) + torch.exp(lse_b))


def lse_max(out_a, lse_a, out_b, lse_b):
    return merge_by_hand(out_a, lse_a, out_b, lse_b)[0], torch.maximum(lse_a, lse_b)


def lse_added(out_a, lse_a, out_b, lse_b):
    return merge_by_hand(out_a, lse_a, out_b, lse_b)[0], lse_a + lse_b


def one_sided(out_a, lse_a, out_b, lse_b):                # stable only while lse_b - lse_a stays small
    lse = lse_a + torch.log1p(torch.exp(lse_b - lse_a))
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def keeps_the_empty_state(out_a, lse_a, out_b, lse_b):    # right, except that an empty side wins
    if torch.isinf(lse_a).any() or torch.isinf(lse_b).any():
        return (out_a, lse_a) if torch.isinf(lse_a).any() else (out_b, lse_b)
    return merge_by_hand(out_a, lse_a, out_b, lse_b)


def in_place(out_a, lse_a, out_b, lse_b):                 # right, and changes its arguments
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a.mul_(torch.exp(lse_a - lse)[..., None]).add_(out_b * torch.exp(lse_b - lse)[..., None]), lse


def test_the_merge_check_passes_the_reference_and_a_hand_written_merge():
    assert ex15.check_merge(ex15.reference_merge).status == PASSED
    assert ex15.check_merge(merge_by_hand).status == PASSED
    assert ex15.check_merge(in_place).status == PASSED
    assert ex15.check_merge(stub).status == NOT_ATTEMPTED


@pytest.mark.parametrize("answer, says", [
    (summed, "out is out_a + out_b"), (averaged, "plain mean"), (swapped, "weights are swapped"),
    (with_exp, "an exp overflowed"), (one_sided, "an exp overflowed"), (lse_max, "lse is max(lse_a, lse_b)"),
    (lse_added, "lse is lse_a + lse_b"),
    (keeps_the_empty_state, "with the empty state"), (lambda *a: a[0], "return a pair"),
    (lambda out_a, lse_a, out_b, lse_b: (out_a * torch.exp(lse_a), lse_a), "unsqueeze(-1)")])
def test_the_merge_check_names_each_mistake(answer, says):
    fb = ex15.check_merge(answer)
    assert fb.status == WRONG and says in fb.message, fb.message


# --- the ring ----------------------------------------------------------------------------------------------

def make_ring(mistake=None):
    """A learner's ring, right or with one mistake."""
    def ring(q, k, v, causal):
        import torch
        import torch.distributed as dist

        from course_lib import context_parallel as cp
        rank, world = dist.get_rank(), dist.get_world_size()
        diagonal = causal and mistake != "no mask"
        out, lse = cp.block_attention(q, k, v, diagonal=diagonal and mistake != "own block unmasked")
        mine = kv = torch.stack([k, v])
        steps = 1 if mistake == "own" else world
        for step in range(1, steps):
            incoming = torch.empty_like(kv)
            if mistake == "blocking send":
                dist.send(kv, (rank + 1) % world)
                dist.recv(incoming, (rank - 1) % world)
            else:
                sending = mine if mistake == "not passed on" else kv
                ops = [dist.P2POp(dist.isend, sending, (rank + 1) % world),
                       dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            kv = incoming
            source = (rank + step) % world if mistake == "wrong way round" else (rank - step) % world
            if causal and source > rank and mistake not in ("future kept", "no mask"):
                continue
            block = cp.block_attention(q, kv[0], kv[1], diagonal=causal and mistake == "every block masked")
            out, lse = cp.merge(out, lse, *block)
        return out
    return ring


def test_the_ring_check_passes_the_references_and_a_hand_written_ring():
    assert ex15.check_ring(ex15.reference_ring).status == PASSED
    assert ex15.check_ring(make_ring()).status == PASSED
    assert ex15.check_ring(stub).status == NOT_ATTEMPTED


@pytest.mark.parametrize("mistake, says", [
    ("own", "only the rank's own block"), ("not passed on", "pass on the block you just received"),
    ("every block masked", "applied to every block"), ("future kept", "in the future"),
    ("no mask", "no mask was applied"), ("own block unmasked", "without the causal triangle"),
    ("wrong way round", "attributed to the wrong ranks"),
    ("blocking send", "blocking dist.send")])
def test_the_ring_check_names_each_mistake(mistake, says):
    fb = ex15.check_ring(make_ring(mistake))
    assert fb.status == WRONG and says in fb.message, fb.message


def test_blocking_sends_on_every_rank_hang_and_the_timeout_names_them():
    fb = ex15.check_ring(make_ring("blocking send"))
    assert fb.status == WRONG and "did not finish" in fb.message and "blocking dist.send" in fb.message


def library(q, k, v, causal):
    from course_lib import context_parallel as cp
    return cp.ring_attention(q, k, v, causal=causal)


def gathered(q, k, v, causal):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    world, rank = dist.get_world_size(), dist.get_rank()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    s = q.shape[2]
    mask = torch.arange(s * world)[None, :] <= torch.arange(rank * s, (rank + 1) * s)[:, None] if causal else None
    return F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)


@pytest.mark.parametrize("answer, says", [(library, "write the ring yourself"), (gathered, "calls dist.all_gather")])
def test_answers_that_are_not_a_ring_are_told_so(answer, says):
    fb = ex15.check_ring(answer)
    assert fb.status == WRONG and says in fb.message, fb.message


def test_a_ring_that_returns_the_wrong_shape_is_told_so():
    fb = ex15.check_ring(lambda q, k, v, causal: torch.cat([q, q], dim=2))
    assert fb.status == WRONG and "shape" in fb.message
