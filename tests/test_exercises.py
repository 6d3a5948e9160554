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


# ---- notebook 02: all-reduce by hand ------------------------------------------------------------------------
from course_lib.comm import allreduce  # noqa: E402
from course_lib.comm.allreduce import exchange  # noqa: E402
from course_lib.exercises import ex02  # noqa: E402


def test_all_reduce_references_pass_and_stub_is_not_attempted():
    for fn in (allreduce.naive_all_reduce, allreduce.ring_all_reduce, allreduce.recursive_doubling_all_reduce):
        assert ex02.check_all_reduce(fn).status == PASSED
    assert ex02.check_all_reduce(lambda t: (_ for _ in ()).throw(NotImplementedError)).status == NOT_ATTEMPTED
    assert "pass your function itself" in ex02.check_all_reduce(None).message


def naive_without_send_back(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buf = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(buf, src)
            t += buf
    else:
        dist.send(t, 0)


def naive_root_forgets_itself(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buf, acc = torch.empty_like(t), torch.zeros_like(t)
        for src in range(1, n):
            dist.recv(buf, src)
            acc += buf
        t.copy_(acc)
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def ring_variant(t, all_gather=True, all_gather_adds=False, split=True):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(t.view(-1).tensor_split(n)) if split else list(t.view(-1).chunk(n))
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        buf = incoming[: chunks[recv_i].numel()]
        exchange(chunks[send_i], (rank + 1) % n, buf, (rank - 1) % n)
        chunks[recv_i] += buf
    for step in range(n - 1 if all_gather else 0):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        buf = incoming[: chunks[recv_i].numel()] if all_gather_adds else chunks[recv_i]
        exchange(chunks[send_i], (rank + 1) % n, buf, (rank - 1) % n)
        if all_gather_adds:
            chunks[recv_i] += buf


def test_all_reduce_wrong_answers_are_explained():
    cases = {naive_without_send_back: "only rank 0 has the sum",
             naive_root_forgets_itself: "without rank 0's data",
             (lambda t: ring_variant(t, all_gather=False)): "stopped after the reduce-scatter",
             (lambda t: ring_variant(t, all_gather_adds=True)): "added twice",
             (lambda t: ring_variant(t, split=False)): "tensor_split"}
    for fn, phrase in cases.items():
        fb = ex02.check_all_reduce(fn)
        assert fb.status == WRONG and phrase in fb.message, fb


def ring_with(t, exchange_step):
    """The reference ring with each step's send and receive done by ``exchange_step(send, dst, recv, src)``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(t.view(-1).tensor_split(n))
    incoming = torch.empty_like(chunks[0])
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        buf = incoming[: chunks[recv_i].numel()]
        exchange_step(chunks[send_i], right, buf, left)
        chunks[recv_i] += buf
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        exchange_step(chunks[send_i], right, chunks[recv_i], left)


def isend_then_irecv(send, dst, recv, src):     # both posted before waiting: fine on Gloo, a hang on NCCL
    for request in [dist.isend(send, dst), dist.irecv(recv, src)]:
        request.wait()


def batched_inline(send, dst, recv, src):       # a learner's own batch_isend_irecv, not the library's helper
    ops = [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def test_ring_check_sees_how_sends_and_receives_are_paired():
    assert ex02.check_all_reduce(lambda t: ring_with(t, batched_inline)).status == PASSED
    fb = ex02.check_all_reduce(lambda t: ring_with(t, isend_then_irecv))     # passes on Gloo by value
    assert fb.status == WRONG and "NCCL" in fb.message and "deadlock" in fb.message, fb
    assert "batch_isend_irecv" in fb.message, fb


def notebook_solution(notebook: str, name: str):
    """The function ``name`` defined in a code block of ``notebook``'s folded solutions, as printed there."""
    import json
    import re
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / notebook).read_text())
    text = "".join(nb["cells"][-1]["source"])
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if f"def {name}(" in b)
    namespace = {"dist": dist, "torch": torch}
    exec(block.split("\nex02.")[0], namespace)                # the definition, not the call of the check
    return namespace[name]


def test_notebook_02_exercise_2_solution_passes_the_check():
    fn = notebook_solution("02_allreduce_from_scratch.ipynb", "all_reduce_from_collectives")
    assert ex02.check_all_reduce(fn, p2p_only=False).status == PASSED
    assert "point-to-point messages only" in ex02.check_all_reduce(fn).message   # the main exercises' rule


def test_nccl_replay_by_hand():
    send, recv = "send", "recv"
    naive = [[[(recv, 1)], [(recv, 2)], [(send, 1)], [(send, 2)]], [[(send, 0)], [(recv, 0)]],
             [[(send, 0)], [(recv, 0)]]]
    assert ex02.nccl_deadlock(naive) is None                       # rank 0 receives in turn: no cycle
    ring = [[[(send, (r + 1) % 3)], [(recv, (r - 1) % 3)]] for r in range(3)]
    assert ex02.nccl_deadlock(ring) == [(r, [(send, (r + 1) % 3)]) for r in range(3)]
    batched = [[[(send, (r + 1) % 3), (recv, (r - 1) % 3)]] for r in range(3)]
    assert ex02.nccl_deadlock(batched) is None
    odd_even = [[[(send, 1)], [(recv, 1)]], [[(recv, 0)], [(send, 0)]]]   # one sends first, the other receives
    assert ex02.nccl_deadlock(odd_even) is None
    assert ex02.nccl_deadlock([[[(recv, None)]], [[(send, 0)]]]) is None  # a receive from any source
    assert ex02.nccl_deadlock([[[(recv, 1)]], []]) == [(0, [(recv, 1)])]  # a receive nobody serves



def test_a_collective_inside_fails_unless_allowed():
    fb = ex02.check_all_reduce(dist.all_reduce)                      # right sums, but not the exercise
    assert fb.status == WRONG and "point-to-point messages only" in fb.message, fb
    assert ex02.check_all_reduce(dist.all_reduce, p2p_only=False).status == PASSED


def naive_with(send, recv):
    def fn(t):
        rank, n = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            buf = torch.empty_like(t)
            for src in range(1, n):
                recv(buf, src)
                t += buf
            for dst in range(1, n):
                send(t, dst)
        else:
            send(t, 0)
            recv(t, 0)
    return fn


def test_sends_that_bypass_the_recorder_fail():
    from torch.distributed import distributed_c10d, isend  # bound before the check wraps dist's names
    fb = ex02.check_all_reduce(naive_with(lambda t, d: isend(t, d).wait(), dist.recv))
    assert fb.status == WRONG and "bypasses" in fb.message, fb
    fb = ex02.check_all_reduce(naive_with(distributed_c10d.send, dist.recv))
    assert fb.status == WRONG and "bypasses" in fb.message, fb


def test_group_ranks_are_resolved_not_a_false_deadlock():
    fn = naive_with(lambda t, d: dist.send(t, group_dst=d), lambda t, s: dist.recv(t, group_src=s))
    assert ex02.check_all_reduce(fn).status == PASSED


def ring_body_only(t):
    """The ring on the first size // N * N elements: an uneven tail left unreduced."""
    n = dist.get_world_size()
    flat = t.view(-1)
    body = flat[: flat.numel() // n * n]
    if body.numel():
        ring_with(body, batched_inline)


def test_an_unreduced_tail_is_named_not_added_twice():
    fb = ex02.check_all_reduce(ring_body_only)
    assert fb.status == WRONG and "never reduced" in fb.message and "added twice" not in fb.message, fb


def test_unknown_peers_are_unknown_not_a_deadlock():
    assert ex02.nccl_deadlock([[[("send", None)]], [[("recv", 0)]]]) is None


def test_power_of_two_recursive_doubling_on_chosen_world_sizes():
    def power_of_two_only(t):
        rank, n = dist.get_rank(), dist.get_world_size()
        assert n & (n - 1) == 0, "power-of-two world sizes only"
        buf, mask = torch.empty_like(t), 1
        while mask < n:
            exchange(t, rank ^ mask, buf, rank ^ mask)
            t += buf
            mask *= 2
    fb = ex02.check_all_reduce(power_of_two_only, world_sizes=(2, 4))
    assert fb.status == PASSED and "2 and 4 ranks" in fb.message, fb
    assert ex02.check_all_reduce(power_of_two_only).status == WRONG          # 3 ranks: the end exercise

# ---- notebook 03: averaging gradients by hand --------------------------------------------------------------
from course_lib.data_parallel import average_gradients  # noqa: E402
from course_lib.exercises import ex03  # noqa: E402


def test_average_gradients_check():
    assert ex03.check_average_gradients(average_gradients).status == PASSED
    def stub_for_a_model(model):
        raise NotImplementedError
    assert ex03.check_average_gradients(stub_for_a_model).status == NOT_ATTEMPTED

    def forgot_to_divide(model):
        for p in model.parameters():
            dist.all_reduce(p.grad)

    def did_nothing(model):
        pass

    def used_reduce(model):
        for p in model.parameters():
            dist.reduce(p.grad, dst=0)
            p.grad /= dist.get_world_size()

    for fn, phrase in ((forgot_to_divide, "times too large"), (did_nothing, "unchanged"), (used_reduce, "only rank 0")):
        fb = ex03.check_average_gradients(fn)
        assert fb.status == WRONG and phrase in fb.message, fb


def test_overlapped_averaging_check():
    assert ex03.check_overlapped_averaging(ex03.launch_when_ready, ex03.wait_and_average).status == PASSED

    def stub(model):
        raise NotImplementedError
    assert ex03.check_overlapped_averaging(stub, ex03.wait_and_average).status == NOT_ATTEMPTED

    def after_backward_only(model):          # no hooks: nothing is launched while backward runs
        return [model]

    def average_at_the_end(pending):
        average_gradients(pending[0])

    def blocking_hooks(model):
        done = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: done.append((q, dist.all_reduce(q.grad))))
        return done

    def divide_only(pending):
        for p, _ in pending:
            p.grad /= dist.get_world_size()

    def wait_without_dividing(pending):
        for _, work in pending:
            work.wait()

    def waiting_hooks(model):                # async, but waits right after launching, inside the hook
        done = []

        def hook(q):
            work = dist.all_reduce(q.grad, async_op=True)
            work.get_future().wait()
            done.append((q, work))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return done

    def divide_by_two(pending):
        for p, work in pending:
            work.wait()
            p.grad /= 2

    cases = [((after_backward_only, average_at_the_end), "no all-reduce started during backward"),
             ((blocking_hooks, divide_only), "block (async_op=False)"),
             ((ex03.launch_when_ready, divide_only), "never waited for"),
             ((ex03.launch_when_ready, wait_without_dividing), "2 times too large"),
             ((waiting_hooks, divide_only), "waiting at once"),
             ((ex03.launch_when_ready, divide_by_two), "on 3 ranks")]
    for (launch, finish), phrase in cases:
        fb = ex03.check_overlapped_averaging(launch, finish)
        assert fb.status == WRONG and phrase in fb.message, fb


def bucketed(wait_at_once=False, keep_bucket=False, no_division=False, blocking=False, per_parameter=False,
             launch_in_finish_only=False, divide_every_parameter=False, divide_by_two=False, future_wait_at_once=False,
             wait_all=False, keep_launched=False, keep_last_bucket=False, tensor_hook=False):
    """The reference bucketed averaging with one of the usual mistakes switched on (``wait_all``: a right answer
    that waits with torch.futures.wait_all on the works' futures)."""
    def attempt(model, cap):
        world_size = 2 if divide_by_two else dist.get_world_size()
        bucket, launched = [], []

        def launch(clear=True):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            work = dist.all_reduce(flat, async_op=not blocking)
            if wait_at_once:
                work.wait()
            if future_wait_at_once:
                work.get_future().wait()
            launched.append((list(bucket), flat, work))
            if clear and not keep_bucket:
                bucket.clear()

        def hook(p):
            bucket.append(p)
            full = sum(q.grad.numel() * q.grad.element_size() for q in bucket) >= cap
            if (full or per_parameter) and not launch_in_finish_only:
                launch()
        for p in model.parameters():
            if tensor_hook:
                p.register_hook(lambda grad, p=p: hook(p))        # runs before p.grad is set
            else:
                p.register_post_accumulate_grad_hook(hook)

        def finish():
            if bucket:
                launch(clear=not keep_last_bucket)
            if wait_all:
                torch.futures.wait_all([work.get_future() for _, _, work in launched])
            for params, flat, work in launched:
                if work is not None and not blocking and not wait_all:
                    work.wait()
                if not no_division:
                    flat /= world_size
                for p, piece in zip(params, flat.split([p.numel() for p in params])):
                    p.grad.copy_(piece.view_as(p))
            if divide_every_parameter:
                for p in model.parameters():
                    p.grad /= 1
            if not keep_launched:
                launched.clear()
            if not keep_last_bucket:
                bucket.clear()
        return finish
    return attempt


def registration_order_buckets(model, cap):
    """Right sums, wrong buckets: fixed up front from model.parameters() in registration order, each launched once
    all its gradients arrived; the rest in finish()."""
    world_size = dist.get_world_size()
    params, buckets, size = list(model.parameters()), [[]], 0
    for p in params:
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append([])
            size = 0
    buckets = [b for b in buckets if b]
    state = {"arrived": set(), "done": set()}
    launched = []

    def launch(i):
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in buckets[i]])
        launched.append((buckets[i], flat, dist.all_reduce(flat, async_op=True)))
        state["done"].add(i)

    def hook(p):
        state["arrived"].add(p)
        for i, bucket in enumerate(buckets):
            if i not in state["done"] and all(q in state["arrived"] for q in bucket):
                launch(i)
    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i in range(len(buckets)):
            if i not in state["done"]:
                launch(i)
        for bucket, flat, work in launched:
            work.wait()
            flat /= world_size
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                if p.grad is not None:
                    p.grad.copy_(piece.view_as(p))
        launched.clear()
        state.update(arrived=set(), done=set())
    return finish


def fixed_buckets_waiting_for_every_parameter(model, cap):
    """Buckets fixed up front from all parameters; a bucket launches when all its gradients arrived, so the bucket
    holding the parameter that never gets a gradient never launches."""
    world_size = dist.get_world_size()
    buckets, size = [[]], 0
    for p in reversed(list(model.parameters())):
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append([])
            size = 0
    missing = {i: len(b) for i, b in enumerate(buckets)}
    where = {p: i for i, b in enumerate(buckets) for p in b}
    launched = []

    def hook(p):
        i = where[p]
        missing[i] -= 1
        if missing[i] == 0:
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            launched.append((buckets[i], flat, dist.all_reduce(flat, async_op=True)))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for params, flat, work in launched:
            work.wait()
            flat /= world_size
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(piece.view_as(p))
        launched.clear()
        missing.update({i: len(b) for i, b in enumerate(buckets)})
    return finish


def test_bucketed_averaging_check_passes_the_reference_and_names_each_mistake():
    fb = ex03.check_bucketed_averaging(ex03.bucketed_averaging)
    assert fb.status == PASSED, fb

    def stub(model, cap):
        raise NotImplementedError
    assert ex03.check_bucketed_averaging(stub).status == NOT_ATTEMPTED
    cases = [(bucketed(wait_at_once=True), "waiting at once"),
             (bucketed(keep_bucket=True), "a bucket was launched twice"),
             (fixed_buckets_waiting_for_every_parameter, "never gets a gradient"),
             (bucketed(divide_every_parameter=True), "never gets a gradient"),
             (bucketed(no_division=True), "2 times too large"),
             (bucketed(blocking=True), "blocks (async_op=False)"),
             (bucketed(per_parameter=True), "one all-reduce per parameter"),
             (bucketed(launch_in_finish_only=True), "no all-reduce started during backward"),
             (bucketed(divide_by_two=True), "on 3 ranks, after finish() the gradients differ"),
             (bucketed(future_wait_at_once=True), "waiting at once"),
             (bucketed(keep_launched=True), "waited again for buckets launched in step 1"),
             (bucketed(keep_last_bucket=True), "a bucket left over from the previous step"),
             (bucketed(tensor_hook=True), "register_hook runs before .grad is set"),
             (registration_order_buckets, "in the order the gradients became ready carry")]
    for attempt, phrase in cases:
        fb = ex03.check_bucketed_averaging(attempt)
        assert fb.status == WRONG and phrase in fb.message, (phrase, fb)


def test_bucketed_averaging_check_passes_a_wait_all_answer():
    assert ex03.check_bucketed_averaging(bucketed(wait_all=True)).status == PASSED
