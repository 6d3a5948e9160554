"""Notebook 16's exercise check: passes the reference dispatch/combine, says 'not attempted yet' for the stub, and
names each usual mistake with its own message (each wrong answer below is what a learner might write)."""
import pytest
import torch
import torch.distributed as dist

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex16
from course_lib.expert_parallel import all_to_all, dispatch_combine


def stub(x, expert, gate, num_experts, local_experts, group=None):
    raise NotImplementedError


def counts(expert, num_experts, group=None):
    """The counts exchange, right: (per expert received, rows to each rank, rows from each rank)."""
    world = dist.get_world_size(group)
    send_counts = torch.bincount(expert, minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    per_rank = num_experts // world
    return recv_counts, send_counts.view(world, -1).sum(1).tolist(), recv_counts.view(world, per_rank).sum(1).tolist()


def by_hand(x, expert, gate, num_experts, local_experts, group=None):
    """Right, written as a learner would (the library's all_to_all, its own counts exchange)."""
    world = dist.get_world_size(group)
    per_rank = num_experts // world
    order = torch.argsort(expert, stable=True)
    recv_counts, send, recv = counts(expert, num_experts, group)
    received = all_to_all(x[order], recv, send, group)
    local = torch.arange(per_rank).repeat(world).repeat_interleave(recv_counts)
    back = all_to_all(local_experts(received, local), send, recv, group)
    out = torch.zeros_like(back)
    out[order] = back
    return out * gate[:, None]


def ignores_group(x, expert, gate, num_experts, local_experts, group=None):
    """by_hand with every collective on the default group and the world's size: right when the group is the world."""
    return by_hand(x, expert, gate, num_experts, local_experts)


def sorted_local(x, expert, gate, num_experts, local_experts, group=None):
    """Local indices built as if the received rows were sorted by expert across all senders."""
    world, per_rank = dist.get_world_size(group), num_experts // dist.get_world_size(group)
    order = torch.argsort(expert, stable=True)
    recv_counts, send, recv = counts(expert, num_experts, group)
    received = all_to_all(x[order], recv, send, group)
    local = torch.arange(per_rank).repeat_interleave(recv_counts.view(world, per_rank).sum(0))
    back = all_to_all(local_experts(received, local), send, recv, group)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def own_twice(x, expert, gate, num_experts, local_experts, group=None):
    """Sends every slot, and also computes the own rank's slots locally and adds them: a rank sending to itself
    twice."""
    rank, per_rank = dist.get_rank(group), num_experts // dist.get_world_size(group)
    out = dispatch_combine(x, expert, gate, num_experts, local_experts, group)
    mine = (expert // per_rank == rank).nonzero().squeeze(1)
    extra = local_experts(x[mine], expert[mine] - rank * per_rank) * gate[mine, None]
    return out.index_add(0, mine, extra)


def gate_before(x, expert, gate, num_experts, local_experts, group=None):
    """expert(gate · x) instead of gate · expert(x)."""
    return dispatch_combine(x * gate[:, None], expert, torch.ones_like(gate), num_experts, local_experts, group)


def detached_gate(x, expert, gate, num_experts, local_experts, group=None):
    return dispatch_combine(x, expert, gate.detach(), num_experts, local_experts, group)


def swapped_splits(x, expert, gate, num_experts, local_experts, group=None):
    """ep.all_to_all's two split lists swapped in the dispatch."""
    world, per_rank = dist.get_world_size(group), num_experts // dist.get_world_size(group)
    order = torch.argsort(expert, stable=True)
    recv_counts, send, recv = counts(expert, num_experts, group)
    received = all_to_all(x[order], send, recv, group)
    local = torch.arange(per_rank).repeat(world).repeat_interleave(recv_counts)
    back = all_to_all(local_experts(received, local), recv, send, group)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def global_ids_as_local(x, expert, gate, num_experts, local_experts, group=None):
    """Sends the expert ids along with the rows and uses them, global, as local."""
    order = torch.argsort(expert, stable=True)
    _, send, recv = counts(expert, num_experts, group)
    received = all_to_all(x[order], recv, send, group)
    ids = torch.empty(sum(recv), dtype=torch.long)
    dist.all_to_all_single(ids, expert[order], recv, send, group=group)
    back = all_to_all(local_experts(received, ids), send, recv, group)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def no_split_sizes(x, expert, gate, num_experts, local_experts, group=None):
    """Assumes equal splits: all_to_all_single without sizes."""
    order = torch.argsort(expert, stable=True)
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x[order])
    return received * gate[:, None]


def counts_not_exchanged(x, expert, gate, num_experts, local_experts, group=None):
    """Knows what it sends, and assumes it receives as much from each rank."""
    world, per_rank = dist.get_world_size(), num_experts // dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert, minlength=num_experts).view(world, per_rank).sum(1).tolist()
    received = all_to_all(x[order], send, send)
    back = all_to_all(local_experts(received, torch.zeros(len(received), dtype=torch.long)), send, send)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def round_robin(x, expert, gate, num_experts, local_experts, group=None):
    """Places expert e on rank e % world (the layout is contiguous blocks): slots reach the wrong rank."""
    world = dist.get_world_size()
    dest = expert % world
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    received = all_to_all(x[order], recv, send)
    recv_expert = torch.empty(sum(recv), dtype=torch.long)
    dist.all_to_all_single(recv_expert, expert[order], recv, send)
    back = all_to_all(local_experts(received, recv_expert // world), send, recv)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def kept_at_home(x, expert, gate, num_experts, local_experts, group=None):
    """Every slot computed by the sending rank's own experts: the rows never travel (sent to itself)."""
    per_rank = num_experts // dist.get_world_size()
    return local_experts(x, expert % per_rank) * gate[:, None]


def no_gates(x, expert, gate, num_experts, local_experts, group=None):
    return dispatch_combine(x, expert, torch.ones_like(gate), num_experts, local_experts)


def not_unsorted(x, expert, gate, num_experts, local_experts, group=None):
    """The combine's rows left in the order they were sent (sorted by expert)."""
    world, per_rank = dist.get_world_size(), num_experts // dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    recv_counts, send, recv = counts(expert, num_experts)
    received = all_to_all(x[order], recv, send)
    local = torch.arange(per_rank).repeat(world).repeat_interleave(recv_counts)
    back = all_to_all(local_experts(received, local), send, recv)
    return back * gate[order, None]


def plain_all_to_all(x, expert, gate, num_experts, local_experts, group=None):
    """dist.all_to_all_single into buffers: right values, but autograd does not see the exchange."""
    world, per_rank = dist.get_world_size(), num_experts // dist.get_world_size()
    order = torch.argsort(expert, stable=True)
    recv_counts, send, recv = counts(expert, num_experts)
    received = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(received, x[order].detach(), recv, send)
    local = torch.arange(per_rank).repeat(world).repeat_interleave(recv_counts)
    done = local_experts(received, local)
    back = x.new_empty(len(x), x.shape[1])
    dist.all_to_all_single(back, done.detach(), send, recv)
    return torch.empty_like(back).index_copy(0, order, back) * gate[:, None]


def detached(x, expert, gate, num_experts, local_experts, group=None):
    return dispatch_combine(x.detach(), expert, gate, num_experts, local_experts)


def calls_the_library(x, expert, gate, num_experts, local_experts, group=None):
    from course_lib import expert_parallel as ep
    return ep.dispatch_combine(x, expert, gate, num_experts, local_experts, group)


def test_the_reference_passes():
    fb = ex16.check_dispatch_combine(dispatch_combine)
    assert fb.status == PASSED and fb, fb
    assert ex16.check_dispatch_combine(by_hand).status == PASSED


def test_the_stub_is_not_attempted():
    fb = ex16.check_dispatch_combine(stub)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


def test_the_probe_has_what_the_check_promises():
    """Different slot counts per rank, uneven routing, every rank with slots sending to another; on 4 ranks, one
    rank with no slots and one rank receiving nothing; in the MoE stages, a rank without tokens."""
    assert 0 in ex16.CASES[4] and 0 in ex16.MOE_TOKENS
    for n in (2, 4):
        inputs = [ex16.probe_inputs(rank, n) for rank in range(n)]
        assert len({len(x) for _, x, _, _ in inputs}) > 1
        per_rank = inputs[0][0] // n
        dest = [e // per_rank for _, _, e, _ in inputs]
        assert all((d != rank).any() for rank, d in enumerate(dest) if len(d))
        assert n == 2 or not any((d == n - 1).any() for d in dest)            # the last rank receives nothing
        load = torch.bincount(torch.cat([e for _, _, e, _ in inputs]), minlength=2 * n)
        assert load.max() >= 2 * load.min()                                   # uneven


MISTAKES = [
    (no_split_sizes, "split sizes"),
    (counts_not_exchanged, "split sizes do not match"),
    (round_robin, "wrong rank"),
    (kept_at_home, "sent them to itself"),
    (not_unsorted, "wrong order"),
    (no_gates, "not weighted by the gates"),
    (plain_all_to_all, "no gradient reached"),
    (sorted_local, "right rank, wrong local expert"),
    (own_twice, "count twice"),
    (gate_before, "applied before the expert"),
    (detached_gate, "gates never travel"),
    (swapped_splits, "swapped"),
    (global_ids_as_local, "not its global id"),
    (ignores_group, "ignores `group`"),
    (detached, "no gradient reached x"),
    (lambda *args, **kw: [1.0], "returned a list"),
    (calls_the_library, "write the dispatch and combine yourself"),
]
PHRASES = ["split sizes", "wrong rank", "sent them to itself", "wrong order", "not weighted by the gates",
           "no gradient reached", "right rank, wrong local expert", "count twice", "applied before the expert",
           "gates never travel", "swapped", "not its global id", "ignores `group`"]


@pytest.mark.parametrize("fn, phrase", MISTAKES, ids=[f.__name__ if f.__name__ != "<lambda>" else "a_list"
                                                       for f, _ in MISTAKES])
def test_known_mistakes_are_named(fn, phrase):
    """Each named mistake fails with its own message: its phrase, and none of the others'."""
    fb = ex16.check_dispatch_combine(fn)
    assert fb.status == WRONG and phrase in fb.message, fb
    assert [p for p in PHRASES if p in fb.message] == [p for p in PHRASES if p in phrase], fb.message


def test_a_deadlock_is_an_error_not_a_hang():
    def only_rank_zero_counts(x, expert, gate, num_experts, local_experts, group=None):
        if dist.get_rank() == 0:
            counts(expert, num_experts)
        return dispatch_combine(x, expert, gate, num_experts, local_experts)

    fb = ex16.check_dispatch_combine(only_rank_zero_counts)
    assert fb.status == WRONG and ("did not finish" in fb.message or "raised" in fb.message), fb
