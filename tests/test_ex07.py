"""Notebook 07's exercise checks: pass the reference, 'not attempted yet' for the stub, name each known mistake."""
import time

import pytest
import torch

from course_lib import pipeline_parallel as P
from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex07
from course_lib.launch import run
from course_lib.pipeline_parallel import schedule, simulate_plan


def one_f_one_b(warm=lambda p, s: p - 1 - s, backward_first=False, stop_after_forwards=False):
    """1F1B as a learner might write it; the keywords put one known mistake in."""
    def my_1f1b(stages, micro_batches):
        plan = []
        for s in range(stages):
            w = min(warm(stages, s), micro_batches)
            ops, f, b = [("F", i) for i in range(w)], w, 0
            while (f < micro_batches) if stop_after_forwards else (b < micro_batches):
                step = [("F", f)] if f < micro_batches else []
                step.append(("B", b))
                ops += step[::-1] if backward_first else step
                f, b = f + len(step) - 1, b + 1
            plan.append(ops)
        return plan
    return my_1f1b


def test_the_reference_and_a_learners_right_answer_pass():
    assert ex07.check_1f1b(ex07.reference_1f1b).status == PASSED
    assert ex07.check_1f1b(one_f_one_b()).status == PASSED


def test_the_stub_is_not_attempted():
    def my_1f1b(stages, micro_batches):
        raise NotImplementedError
    fb = ex07.check_1f1b(my_1f1b)
    assert fb.status == NOT_ATTEMPTED and "not attempted yet" in repr(fb)


def test_gpipe_given_for_1f1b_is_named():
    fb = ex07.check_1f1b(lambda p, m: schedule("gpipe", p, m))
    assert fb.status == WRONG and "that is GPipe's order" in fb.message


@pytest.mark.parametrize("warm, runs", [(lambda p, s: p - s, 3), (lambda p, s: 0, 1)])
def test_a_warm_up_of_the_wrong_length_is_named_with_what_the_simulator_shows(warm, runs):
    fb = ex07.check_1f1b(one_f_one_b(warm=warm))
    assert fb.status == WRONG, fb
    assert f"Stage 0 runs {runs} forward(s) before its first backward; 1F1B runs min(p-s, m) = 2" in fb.message
    assert "Simulated (forward 1, backward 2): bubble" in fb.message


def test_the_simulators_numbers_in_the_message_are_right():
    """No warm-up serialises the stages: 2 stages idle half the time (1F1B: 1/5), each holds one micro-batch."""
    fb = ex07.check_1f1b(one_f_one_b(warm=lambda p, s: 0))
    assert "bubble 0.500 (1F1B: 0.200); activations held per stage [1, 1] (1F1B: [2, 1])" in fb.message


def test_a_deadlocking_order_says_which_stage_waits_for_what():
    fb = ex07.check_1f1b(one_f_one_b(warm=lambda p, s: s))          # warm-up counted from the wrong end
    assert fb.status == WRONG
    assert ("the schedule deadlocks: stage 0 waits for stage 1's B0 before its B0; stage 1 waits for stage 0's F1 "
            "before its F1") in fb.message


def test_a_backward_before_its_forward_is_named():
    fb = ex07.check_1f1b(one_f_one_b(backward_first=True))
    assert fb.status == WRONG and "stage 1 runs B0 before F0" in fb.message


def test_missing_ops_and_bad_formats_are_named():
    fb = ex07.check_1f1b(one_f_one_b(stop_after_forwards=True))
    assert fb.status == WRONG and "stage 0 never runs B3" in fb.message
    assert "1 lists of ops for 2 stages" in ex07.check_1f1b(lambda p, m: [[("F", 0)]]).message
    assert "not 'F0'" in ex07.check_1f1b(lambda p, m: [["F0", "B0"]] * p).message
    assert "ops are 'F' (forward) and 'B'" in ex07.check_1f1b(lambda p, m: [[("X", 0)]] * p).message
    assert "raised ZeroDivisionError" in ex07.check_1f1b(lambda p, m: 1 / 0).message
    assert "pass your function itself" in ex07.check_1f1b(None).message


def test_the_simulator_refuses_what_is_not_an_op():
    with pytest.raises(ValueError, match="is not an op"):
        simulate_plan([[("F", 0), "B0"]])


# ------------------------------------------------------------------------------------------ one stage's loop
def stage_loop(blocking_send=False, early_forward=False, early_backward=False, loss_scale="1/m", order="ops",
               wait_sends=True, skip_last_grad=False):
    """One stage's loop as a learner might write it: blocking receives, isends; the keywords put one mistake in.
    ``order``: "ops", "gpipe" (ignores ops), "f_then_b" (ops' forwards, then its backwards), "reversed"."""
    def my_stage_loop(stage, ops, rank, world_size, xs, ys, comm):
        import torch.nn.functional as F

        from course_lib.pipeline_parallel import schedule
        first, last, m = rank == 0, rank == world_size - 1, len(xs)
        inputs, outputs, sends = {}, {}, []
        if order == "gpipe":
            ops = schedule("gpipe", world_size, m)[rank]
        elif order == "f_then_b":
            ops = [o for o in ops if o[0] == "F"] + [o for o in ops if o[0] == "B"]
        elif order == "reversed":
            ops = [(op, m - 1 - i) for op, i in ops]

        def send(t, dst):
            if blocking_send:
                comm.send(t, dst)
            else:
                sends.append(comm.isend(t, dst))

        def receive(like, src, early):
            buf = like.new_empty(like.shape)
            h = comm.irecv(buf, src)
            if not early:
                h.wait()
            return buf
        for op, i in ops:
            if op == "F":
                inp = xs[i].clone() if first else receive(xs[i], rank - 1, early_forward)
                inp.requires_grad_()
                out = stage(inp)
                inputs[i], outputs[i] = inp, out
                if not last:
                    send(out.detach(), rank + 1)
            else:
                if last:
                    loss = F.mse_loss(outputs[i], ys[i])
                    (loss / m if loss_scale == "1/m" else loss).backward()
                else:
                    outputs[i].backward(receive(xs[i], rank + 1, early_backward))
                if not first and not (skip_last_grad and last and i == m - 1):
                    send(inputs[i].grad, rank - 1)
        if wait_sends:
            for h in sends:
                h.wait()
    return my_stage_loop


def test_the_stage_loop_reference_and_a_learners_right_answer_pass():
    assert ex07.check_stage_loop(ex07.reference_stage_loop).status == PASSED
    assert ex07.check_stage_loop(stage_loop()).status == PASSED


def test_the_stage_loop_stub_is_not_attempted():
    def my_stage_loop(stage, ops, rank, world_size, xs, ys, comm):
        raise NotImplementedError
    assert ex07.check_stage_loop(my_stage_loop).status == NOT_ATTEMPTED


def test_blocking_sends_on_both_neighbours_are_named_as_a_deadlock_within_seconds():
    start = time.monotonic()
    fb = ex07.check_stage_loop(stage_loop(blocking_send=True))
    assert fb.status == WRONG, fb
    assert "1f1b deadlocks" in fb.message and "these two neighbours both sent first" in fb.message, fb.message
    assert "It ran GPipe" in fb.message                      # the same loop is fine when nothing crosses
    assert time.monotonic() - start < 45


def test_a_backward_before_its_gradient_arrived_is_named():
    fb = ex07.check_stage_loop(stage_loop(early_backward=True))
    assert fb.status == WRONG and "ran a backward before the gradient of its forward's output arrived" in fb.message


def test_a_forward_before_its_input_arrived_is_named():
    fb = ex07.check_stage_loop(stage_loop(early_forward=True))
    assert fb.status == WRONG and "ran a forward on its input before it arrived" in fb.message, fb.message


def test_the_loss_scaled_by_1_instead_of_1_over_m_is_named():
    fb = ex07.check_stage_loop(stage_loop(loss_scale="1"))
    assert fb.status == WRONG and "4 = m times the whole model's" in fb.message, fb.message


def test_the_library_stage_step_is_the_reference_and_pipeline_worker_runs_it():
    """The notebook's listing (stage_step) is what pipeline_worker runs: equal gradients, with or without the clock."""
    expected = ex07.full_grads()
    res = run(P.pipeline_worker, ex07.STAGES, "1f1b", ex07.MICRO_BATCHES, ex07.BATCH, ex07.WIDTH, ex07.LAYERS,
              backend="gloo", show_output=False)
    for r, es in zip(res, expected):
        assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(r["grads"], es))


@pytest.mark.parametrize("keyword, phrase", [
    (dict(order="gpipe"), "That is GPipe's order, whatever `ops` says"),
    (dict(order="f_then_b"), "It ran every forward first and the backwards at the end"),
    (dict(order="reversed"), "It ran the micro-batches in reverse order"),
    (dict(wait_sends=False), "never waited for its isend(dst="),
])
def test_a_loop_with_the_right_gradients_but_not_the_schedule_is_named(keyword, phrase):
    """Each of these gives the unsplit model's gradients: only the recorded order or the handles show the mistake."""
    fb = ex07.check_stage_loop(stage_loop(**keyword))
    assert fb.status == WRONG and phrase in fb.message, fb.message


class SharedBuffer:
    """A comm that receives every irecv into one tensor: what a loop reusing one buffer for all its receives does."""

    def __init__(self, comm):
        self.comm, self.buf = comm, None

    def irecv(self, tensor, src):
        self.buf = tensor if self.buf is None else self.buf
        return self.comm.irecv(self.buf, src)

    def __getattr__(self, name):
        return getattr(self.comm, name)


def test_two_pending_receives_into_one_buffer_are_named():
    def my_stage_loop(stage, ops, rank, world_size, xs, ys, comm):
        ex07.reference_stage_loop(stage, ops, rank, world_size, xs, ys, SharedBuffer(comm))
    fb = ex07.check_stage_loop(my_stage_loop)
    assert fb.status == WRONG and "a pending irecv(src=" in fb.message and "its own buffer" in fb.message, fb.message


def test_a_gradient_the_last_stage_never_sends_is_named_not_a_closed_connection():
    fb = ex07.check_stage_loop(stage_loop(skip_last_grad=True))
    assert fb.status == WRONG, fb
    assert "rank 1 waited" in fb.message and "irecv(src=2)" in fb.message, fb.message
    assert "rank 2 finished its ops without sending that message" in fb.message, fb.message
    assert "Connection closed" not in fb.message
