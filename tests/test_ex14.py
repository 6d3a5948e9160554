"""Notebook 14's exercise check: passes the reference loss-scaling step, says 'not attempted yet' for the stub, and
names each usual mistake with its own message (each wrong answer below is what a learner might write)."""
import pytest
import torch

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex14


def stub(loss, model, opt, state, max_norm):
    raise NotImplementedError


def make(scale_loss=True, unscale=True, clip_first=False, clip=True, finite=torch.isfinite, skip=True,
         backoff=0.5, grow=True, reset_on_growth=True, reset_on_skip=True, returns=True, late=False):
    """A loss-scaling step with one of the usual mistakes switched on."""
    def step(loss, model, opt, state, max_norm):
        params = list(model.parameters())
        (loss * state["scale"] if scale_loss else loss).backward()
        if clip_first:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if unscale:
            for p in params:
                p.grad /= state["scale"]
        ok = all(bool(finite(p.grad).all()) for p in params)
        if ok or not skip:
            if clip and not clip_first:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
        if ok:
            state["good_steps"] += 1
            if grow and state["good_steps"] >= state["growth_interval"] + late:
                state["scale"] *= 2
                if reset_on_growth:
                    state["good_steps"] = 0
        else:
            state["scale"] *= backoff
            if reset_on_skip:
                state["good_steps"] = 0
        return ok if returns else None
    return step


def not_inf(g):
    return ~torch.isinf(g)


WRONG_ANSWERS = {
    "stepped anyway": (make(skip=False), "you stepped anyway"),
    "isinf only": (make(finite=not_inf), "torch.isinf misses NaN"),
    "no backoff": (make(backoff=1.0), "back off, halve it"),
    "never grows": (make(grow=False), "without growth the scale only ever falls"),
    "grows one step late": (make(late=True), "(not one step later)"),
    "growth counter not reset": (make(reset_on_growth=False), "reset state['good_steps'] to 0 when you double"),
    "counter not reset on skip": (make(reset_on_skip=False), "on a skipped step too"),
    "clip before unscale": (make(clip_first=True), "you clipped the scaled gradients, then unscaled them"),
    "never unscaled": (make(unscale=False), "the step used the scaled gradients"),
    "not clipped": (make(clip=False), "the gradients were not clipped"),
    "loss not scaled": (make(scale_loss=False), "multiply the loss by state['scale'] before backward"),
    "returns nothing": (make(returns=False), "return True when the step was taken"),
}


def test_the_reference_passes():
    fb = ex14.check_scaled_step(ex14.reference)
    assert fb.status == PASSED, fb.message


def test_the_learner_written_loop_in_this_file_passes():
    fb = ex14.check_scaled_step(make())
    assert fb.status == PASSED, fb.message


def test_the_stub_is_not_attempted_and_a_call_result_is_refused():
    assert ex14.check_scaled_step(stub).status == NOT_ATTEMPTED
    assert "pass your function itself" in ex14.check_scaled_step(None).message


@pytest.mark.parametrize("name", WRONG_ANSWERS)
def test_each_wrong_answer_fails_with_its_own_message(name):
    fn, words = WRONG_ANSWERS[name]
    fb = ex14.check_scaled_step(fn)
    assert fb.status == WRONG and words in fb.message, fb.message


def test_the_scenario_overflows_skips_nan_and_grows():
    """The check is only as good as its scenario: GradScaler skips at least two overflow steps and the NaN step,
    grows the scale at least once, and clipping binds on some clean step."""
    model, batches = ex14.model_and_data()
    ref = ex14.gradscaler_loop(model, torch.optim.SGD(model.parameters(), lr=ex14.LR), batches)
    skipped = [i for i, r in enumerate(ref) if r["skipped"]]
    assert ex14.NAN_STEP in skipped and len(skipped) >= 3
    assert any(b["scale"] > a["scale"] for a, b in zip(ref, ref[1:]))


def test_using_gradscaler_inside_the_attempt_is_refused():
    def cheat(loss, model, opt, state, max_norm):
        scaler = torch.amp.GradScaler("cpu", init_scale=state["scale"])
        scaler.scale(loss).backward()
        return True
    fb = ex14.check_scaled_step(cheat)
    assert fb.status == WRONG and "switched off" in fb.message
    assert torch.amp.GradScaler is not ex14._Refused
