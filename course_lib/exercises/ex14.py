"""Notebook 14's exercise: the loss-scaling loop that ``torch.amp.GradScaler`` runs.

The learner writes ``fn(loss, model, opt, state, max_norm) -> bool``, one training step after the forward:
``state`` holds ``"scale"`` (a power of two), ``"good_steps"`` (clean steps since the scale last changed) and
``"growth_interval"``. The step multiplies the loss by the scale before ``backward``, divides the gradients by it
(unscale) *before* clipping them to ``max_norm``, skips ``opt.step()`` when any gradient holds an inf or a NaN
(then halves the scale and resets the count), and doubles the scale after ``growth_interval`` clean steps in a row
(resetting the count). It returns whether the step was taken. ``opt.zero_grad()`` and the forward are the check's.

:func:`check_scaled_step` trains a small MLP under fp16 autocast on the CPU for 16 steps (GradScaler skips steps
1, 3 and 9, whose gradients overflow fp16 at the scale they meet, and step 13, whose batch holds a NaN; clipping
binds on some clean steps) and compares, step by step, the scale, the skipped steps and the weights with
``GradScaler``'s own loop (:func:`gradscaler_loop`) on the same model and data. Both step SGD with momentum
(:func:`optimizer`): a step on zeroed gradients still moves the weights, so it cannot pass for a skip. While the
learner's function runs, ``GradScaler`` refuses to be built under its public names (``torch.amp.GradScaler``,
``torch.amp.grad_scaler.GradScaler``). A wrong step is recognised by what it did: stepped on inf (or on NaN only),
stepped after replacing or zeroing the non-finite gradients, kept or grew the scale where it should have halved,
never grew, did not reset the count after growing or after a skip, clipped the scaled gradients, never unscaled,
never clipped, never scaled the loss.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import NOT_ATTEMPTED, Feedback, passed, wrong

STEPS, INIT_SCALE, GROWTH_INTERVAL, MAX_NORM, LR, MOMENTUM = 16, 2.0**18, 3, 1.0, 0.1, 0.9
NAN_STEP = 13


def optimizer(model):
    """The check's optimizer: SGD with momentum, so that ``opt.step()`` on zero gradients still moves the weights."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def reference(loss, model, opt, state, max_norm):
    """One loss-scaled step: what ``GradScaler`` does, written out."""
    params = list(model.parameters())
    (loss * state["scale"]).backward()                      # gradients S times larger: clear fp16's floor
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        g.div_(state["scale"])                               # unscale first: clipping sees the true gradients
    finite = all(torch.isfinite(g).all() for g in grads)     # inf or NaN anywhere: skip the step
    if finite:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        state["good_steps"] += 1
        if state["good_steps"] == state["growth_interval"]:
            state["scale"] *= 2.0                            # clean for a while: try a larger scale
            state["good_steps"] = 0
    else:
        state["scale"] *= 0.5                                # overflowed: back off
        state["good_steps"] = 0
    return finite


def model_and_data(seed: int = 0):
    """The check's model (fresh, seeded) and its 16 batches: step 9 overflows fp16, step 13 holds a NaN."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for i in range(STEPS):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        if i == 9:
            x = x * 40
        if i == NAN_STEP:
            x[0, 0] = float("nan")
        batches.append((x, y))
    return model, batches


def forward(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.mse_loss(model(x).float(), y)


def gradscaler_loop(model, opt, batches, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, max_norm=MAX_NORM):
    """The canonical loop. Returns per step the scale it used and the scale after, whether it skipped, and the
    weights after."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = forward(model, x, y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                                 # divide the gradients by the scale, note inf/NaN
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)                                     # opt.step(), unless a gradient was inf/NaN
        scaler.update()                                      # halve after a skip; double after growth_interval
        out.append({"scale": scale, "scale after": scaler.get_scale(), "skipped": scaler.get_scale() < scale,
                    "weights": [p.detach().clone() for p in model.parameters()]})
    return out


class _Refused:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("GradScaler is switched off during this check: write the loop yourself")


@contextlib.contextmanager
def _no_gradscaler():
    import torch.amp.grad_scaler as module
    saved = torch.amp.GradScaler, module.GradScaler
    torch.amp.GradScaler = module.GradScaler = _Refused
    try:
        yield
    finally:
        torch.amp.GradScaler, module.GradScaler = saved


def _flat(ts):
    return torch.cat([t.flatten() for t in ts])


def _grads_at(weights, x, y, scale):
    """The unscaled, unclipped fp32 gradients GradScaler's loop would see from ``weights`` on this batch."""
    model, _ = model_and_data()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    (forward(model, x, y) * scale).backward()
    return _flat([p.grad for p in model.parameters()]) / scale


def _what_step(d, g, scale, where):
    """Name the gradient ``d`` the learner stepped with (its ``.grad`` after the step) from the true one ``g``."""
    close = lambda a, b: ((a - b).norm() / b.norm()).item() < 1e-3   # noqa: E731
    norm = g.norm()
    clip = lambda v: v * min(1.0, MAX_NORM / (v.norm().item() + 1e-6))   # noqa: E731
    if close(d, g) and norm > MAX_NORM:
        return (f"{where}: the gradients were not clipped (their norm {norm:.3f} > max_norm {MAX_NORM}): call "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) after unscaling, before opt.step()")
    if close(d, clip(g * scale) / scale):
        return (f"{where}: you clipped the scaled gradients, then unscaled them: clipping then sees a norm "
                f"{scale:g} times too large and shrinks every step to almost nothing. Unscale first, then clip "
                "(GradScaler's loop calls scaler.unscale_(opt) before clip_grad_norm_)")
    if close(d, clip(g * scale)) or close(d, g * scale):
        return (f"{where}: the step used the scaled gradients: divide every .grad by state['scale'] after "
                "backward (unscale) before clipping and stepping")
    if close(d, clip(g / scale)) or close(d, g / scale):
        return (f"{where}: the step used gradients {scale:g} times too small: multiply the loss by state['scale'] "
                "before backward, and unscale (divide by the scale) once")
    return None


def _unscaled_loss(d, g1, scale) -> bool:
    """Whether ``d`` (the learner's ``.grad`` on a skipped step) comes from a loss that was never scaled: the fp32
    gradient at scale 1 (``g1``), possibly divided by the scale and/or clipped."""
    if not torch.isfinite(d).all() or d.norm() == 0:
        return False
    clip = lambda v: v * min(1.0, MAX_NORM / (v.norm().item() + 1e-6))   # noqa: E731
    return any(((d - v).norm() / v.norm()).item() < 1e-2 for v in (g1, clip(g1), g1 / scale, clip(g1) / scale))


def check_scaled_step(fn) -> Feedback:
    """``fn(loss, model, opt, state, max_norm) -> bool`` must follow GradScaler's loop step for step."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    model, batches = model_and_data()
    ref = gradscaler_loop(model, optimizer(model), batches)
    model, _ = model_and_data()
    opt = optimizer(model)
    state = {"scale": INIT_SCALE, "good_steps": 0, "growth_interval": GROWTH_INTERVAL}
    weights = [p.detach().clone() for p in model.parameters()]
    grew_at, skipped_at = [], []
    for i, ((x, y), r) in enumerate(zip(batches, ref)):
        where = f"step {i} (scale {r['scale']:g})"
        opt.zero_grad()
        loss = forward(model, x, y)
        try:
            with _no_gradscaler():
                took = fn(loss, model, opt, state, MAX_NORM)
        except NotImplementedError:
            return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell "
                                           "again")
        except RuntimeError as e:
            return wrong(f"{where}: your step raised RuntimeError: {e}")
        if not isinstance(took, bool) and not (isinstance(took, torch.Tensor) and took.numel() == 1):
            return wrong(f"{where}: return True when the step was taken, False when it was skipped; got {took!r}")
        took = bool(took)
        after = [p.detach().clone() for p in model.parameters()]
        moved = not all(torch.equal(a, b) for a, b in zip(after, weights))
        scale = state.get("scale")
        if r["skipped"]:
            kind = "a NaN" if i == NAN_STEP else "an inf (fp16 overflowed)"
            if moved and not torch.isfinite(_flat(after)).all():
                if i == NAN_STEP:
                    return wrong(f"{where}: the gradients hold NaN but no inf, and you stepped: torch.isinf misses "
                                 "NaN. Test torch.isfinite(g).all() on every gradient")
                return wrong(f"{where}: the gradients hold {kind}; you stepped anyway and the weights are now "
                             "inf/NaN. When any gradient is not finite, skip opt.step(). (The loss itself is finite: "
                             "fp16 overflows in the gradients, so test the gradients, not the loss)")
            if moved:
                d = _flat([torch.zeros_like(p) if p.grad is None else p.grad.detach().float()
                           for p in model.parameters()])
                if _unscaled_loss(d, _grads_at(weights, x, y, 1.0), r["scale"]):
                    return wrong(f"{where}: GradScaler skipped this step (its scaled gradients overflowed fp16) but "
                                 "your weights moved with finite gradients: multiply the loss by state['scale'] "
                                 "before backward, so that the overflow happens where GradScaler's does")
                return wrong(f"{where}: you stepped on an overflow step (after replacing or zeroing the non-finite "
                             "gradients): when any gradient is inf or NaN, skip opt.step() altogether. Even zero "
                             "gradients move the weights under momentum, weight decay or Adam")
            if took:
                return wrong(f"{where}: you skipped the step (right) but returned True: return False for a skip")
            if scale == r["scale"]:
                return wrong(f"{where}: after a skipped step the scale stays {scale:g}: back off, halve it, or the "
                             "same overflow comes back at the next step")
            if scale != r["scale"] / 2:
                return wrong(f"{where}: after a skipped step the scale should be halved to {r['scale'] / 2:g}; "
                             f"yours is {scale!r}")
            skipped_at.append(i)
        else:
            if not moved:
                return wrong(f"{where}: every gradient is finite, but you skipped the step: step when all are "
                             "finite (torch.isfinite(g).all())")
            d = _flat([torch.zeros_like(p) if p.grad is None else p.grad.detach().float()
                       for p in model.parameters()])
            g = _grads_at(weights, x, y, r["scale"])
            if not torch.allclose(_flat(after), _flat(r["weights"]), rtol=1e-5, atol=1e-7):
                return wrong(_what_step(d, g, r["scale"], where) or
                             f"{where}: your weights differ from GradScaler's loop's (by up to "
                             f"{(_flat(after) - _flat(r['weights'])).abs().max():.2e}): scale the loss, backward, "
                             "unscale, clip, step")
            if not took:
                return wrong(f"{where}: you took the step (right) but returned False: return True when you step")
            want = r["scale after"]
            if scale != want:
                if want > r["scale"] and scale == r["scale"]:
                    return wrong(f"{where}: this is the {ordinal(GROWTH_INTERVAL)} clean step in a row and GradScaler "
                                 f"doubles its scale to {want:g}; yours stays {scale:g}. Count clean steps in "
                                 "state['good_steps'] and double the scale when the count reaches growth_interval "
                                 "(not one step later): without growth the scale only ever falls")
                if scale > r["scale"] and grew_at and grew_at[-1] == i - 1:
                    return wrong(f"{where}: your scale grew again one step after growing: reset "
                                 "state['good_steps'] to 0 when you double the scale")
                if scale > r["scale"] and skipped_at and i - skipped_at[-1] < GROWTH_INTERVAL:
                    return wrong(f"{where}: your scale grew only {i - skipped_at[-1]} clean step(s) after the skip "
                                 f"at step {skipped_at[-1]}: reset state['good_steps'] to 0 on a skipped step too")
                return wrong(f"{where}: after this step GradScaler's scale is {want:g}, yours {scale!r}")
            if want > r["scale"]:
                grew_at.append(i)
        weights = after
    return passed(f"{STEPS} steps: your scale ({INIT_SCALE:g} → {state['scale']:g}), skipped steps {skipped_at} and "
                  "weights are GradScaler's loop's, step for step")
