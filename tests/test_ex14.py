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


def zero_and_step(loss, model, opt, state, max_norm):
    """Zeroes the gradients on an overflow step and still calls opt.step(): under momentum the weights move."""
    params = list(model.parameters())
    (loss * state["scale"]).backward()
    for p in params:
        p.grad /= state["scale"]
    ok = all(bool(torch.isfinite(p.grad).all()) for p in params)
    if not ok:
        for p in params:
            p.grad.zero_()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    _update(state, ok)
    return ok


def nan_to_num_and_step(loss, model, opt, state, max_norm):
    """Replaces inf/NaN by finite numbers and steps: finite weights, but a step GradScaler skips."""
    params = list(model.parameters())
    (loss * state["scale"]).backward()
    for p in params:
        p.grad /= state["scale"]
    ok = all(bool(torch.isfinite(p.grad).all()) for p in params)
    for p in params:
        p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    _update(state, ok)
    return ok


def loss_tested(loss, model, opt, state, max_norm):
    """Tests the scaled loss for inf instead of the gradients: the loss is finite, so it steps on inf."""
    params = list(model.parameters())
    scaled = loss * state["scale"]
    ok = bool(torch.isfinite(scaled))
    scaled.backward()
    for p in params:
        p.grad /= state["scale"]
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    _update(state, ok)
    return ok


def _update(state, ok):
    if ok:
        state["good_steps"] += 1
        if state["good_steps"] == state["growth_interval"]:
            state["scale"] *= 2
            state["good_steps"] = 0
    else:
        state["scale"] *= 0.5
        state["good_steps"] = 0


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
    "loss neither scaled nor unscaled": (make(scale_loss=False, unscale=False),
                                         "your weights moved with finite gradients: multiply the loss"),
    "zeroed the gradients and stepped": (zero_and_step, "you stepped on an overflow step (after replacing or zeroing"),
    "nan_to_num and stepped": (nan_to_num_and_step, "you stepped on an overflow step (after replacing or zeroing"),
    "tested the loss, not the gradients": (loss_tested, "test the gradients, not the loss"),
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
    ref = ex14.gradscaler_loop(model, ex14.optimizer(model), batches)
    skipped = [i for i, r in enumerate(ref) if r["skipped"]]
    assert ex14.NAN_STEP in skipped and len(skipped) >= 3
    assert any(b["scale"] > a["scale"] for a, b in zip(ref, ref[1:]))
    start, _ = ex14.model_and_data()
    before = [[p.detach().clone() for p in start.parameters()]] + [r["weights"] for r in ref[:-1]]
    norms = [ex14._grads_at(w, x, y, r["scale"]).norm().item()
             for w, (x, y), r in zip(before, batches, ref) if not r["skipped"]]
    assert any(n > ex14.MAX_NORM for n in norms) and any(n < ex14.MAX_NORM for n in norms)  # binds, not always


def test_ordinals_read_right():
    assert [ex14.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd"]


def test_using_gradscaler_inside_the_attempt_is_refused():
    def cheat(loss, model, opt, state, max_norm):
        scaler = torch.amp.GradScaler("cpu", init_scale=state["scale"])
        scaler.scale(loss).backward()
        return True
    fb = ex14.check_scaled_step(cheat)
    assert fb.status == WRONG and "switched off" in fb.message
    assert torch.amp.GradScaler is not ex14._Refused


def test_gradscaler_built_from_its_module_is_refused_too():
    import torch.amp.grad_scaler as module

    def cheat(loss, model, opt, state, max_norm):
        scaler = module.GradScaler("cpu", init_scale=state["scale"])
        scaler.scale(loss).backward()
        return True
    fb = ex14.check_scaled_step(cheat)
    assert fb.status == WRONG and "switched off" in fb.message
    assert module.GradScaler is not ex14._Refused
