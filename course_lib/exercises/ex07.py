"""Notebook 07's exercises: write the 1F1B schedule, then one stage's loop that runs it across processes.

**The 1F1B schedule** (:func:`check_1f1b`).

The learner writes ``fn(stages, micro_batches)`` that returns, for each stage, the ops it runs in order,
in the format of :func:`course_lib.pipeline_parallel.schedule`: ``[[("F", 0), ("F", 1), ("B", 0), ...], ...]``.
The check asks for several pipelines (more micro-batches than stages, fewer, one stage, one micro-batch)
and compares each with ``schedule("1f1b", p, m)``. A wrong answer is run on the simulator
(:func:`~course_lib.pipeline_parallel.simulate_plan`) to say what it would do: deadlock (and which stage
waits for what), idle longer, or hold more activations than 1F1B.

**One stage's loop** (:func:`check_stage_loop`). The learner writes ``fn(stage, ops, rank, world_size, xs, ys,
comm)``: stage ``rank``'s part of one training step, its ``ops`` in the schedule's order, with the sends and
receives (``comm.send/recv/isend/irecv``, the signatures of ``torch.distributed``'s), the forwards and the
backwards. The check runs it on 3 Gloo ranks, GPipe then 1F1B, and compares the gradients with the unsplit
model's. ``comm`` is a :class:`Link`: ``torch.distributed`` point-to-point with two things added so that a
mistake is named, not a hang or a silent wrong number:

* every wait gives up after a few seconds and says which call it was stuck in (a deadlock becomes an error
  in seconds, and the check names who waited for whom);
* ``irecv`` fills its tensor with NaN until ``wait()`` returns, so a tensor used before it arrived gives NaN
  gradients every time (on a real machine it holds whatever was there: a silent, racy wrong gradient).
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from ..pipeline_parallel import bubble_formula, make_batch, make_full_model, make_stage, schedule, simulate_plan
from ..pipeline_parallel.stages import stage_step
from . import NOT_ATTEMPTED, Feedback, passed, run_attempt, wrong

CASES = ((2, 4), (4, 8), (3, 5), (4, 2), (2, 1), (1, 3))   # (stages, micro-batches)


def reference_1f1b(stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """The reference solution: the course library's 1F1B."""
    return schedule("1f1b", stages, micro_batches)


def _normalise(plan, p: int) -> tuple[list[list[tuple[str, int]]] | None, str | None]:
    """The plan as lists of ``(op, i)`` tuples, or a message saying what is wrong with its format."""
    example = "return one list per stage, e.g. [[('F', 0), ('B', 0)], ...]"
    if not isinstance(plan, (list, tuple)):
        return None, f"your function returned {type(plan).__name__}, not a list: {example}"
    if len(plan) != p:
        return None, f"{len(plan)} lists of ops for {p} stages: {example}"
    out = []
    for s, ops in enumerate(plan):
        if not isinstance(ops, (list, tuple)) or any(isinstance(op, str) for op in ops):
            return None, f"stage {s}'s ops are {str(ops)[:60]}: write each op as a pair ('F', 0), not 'F0'. {example}"
        try:
            out.append([(str(op), int(i)) for op, i in ops])
        except (TypeError, ValueError):
            return None, f"stage {s}'s ops are not (op, micro_batch) pairs: {str(ops)[:60]}... {example}"
        bad = next((op for op, _ in out[-1] if op not in ("F", "B")), None)
        if bad is not None:
            return None, f"stage {s} has an op {bad!r}: ops are 'F' (forward) and 'B' (backward)"
    return out, None


def _warmups(plan: list[list[tuple[str, int]]]) -> list[int]:
    """Per stage, the forwards it runs before its first backward."""
    return [next((k for k, (op, _) in enumerate(ops) if op == "B"), len(ops)) for ops in plan]


def _held(ops: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    held = peak = 0
    for op, _ in ops:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


def diagnose(plan, p: int, m: int) -> str | None:
    """A message naming what is wrong with ``plan`` as the 1F1B schedule of p stages and m micro-batches;
    ``None`` when it is the 1F1B schedule."""
    plan, problem = _normalise(plan, p)
    if problem:
        return problem
    ref = schedule("1f1b", p, m)
    if plan == ref:
        return None
    for s, ops in enumerate(plan):
        for op in ("F", "B"):
            for i in range(m):
                n = ops.count((op, i))
                if n != 1:
                    return f"stage {s} {f'never runs {op}{i}' if n == 0 else f'runs {op}{i} {n} times'}: every " \
                           f"stage runs the forward and the backward of each micro-batch (0 to {m - 1}) exactly once"
        if len(ops) != 2 * m:
            extra = next(f"{op}{i}" for op, i in ops if not 0 <= i < m)
            return f"stage {s} runs {extra}, but the micro-batches are 0 to {m - 1}"
        for i in range(m):
            if ops.index(("B", i)) < ops.index(("F", i)):
                return f"stage {s} runs B{i} before F{i}: a backward needs the activations its forward saved"
    if plan == schedule("gpipe", p, m):
        return ("that is GPipe's order (all forwards, then all backwards). 1F1B starts the backwards early: "
                "after a warm-up of p-1-s forwards, stage s alternates one forward and one backward")
    want = [min(p - s, m) for s in range(p)]
    warm = _warmups(plan)
    warm_note = next((f" Stage {s} runs {w} forward(s) before its first backward; 1F1B runs min(p-s, m) = {want[s]} "
                      f"(a warm-up of p-1-s = {p - 1 - s}, then one forward and one backward)."
                      for s, (w, want_s) in enumerate(zip(warm, want)) if w != want_s), "")
    try:
        sim = simulate_plan(plan)
    except RuntimeError as e:
        return f"{e}.{warm_note}"
    held, ref_held = [_held(ops) for ops in plan], [_held(ops) for ops in ref]
    effect = (f" Simulated (forward 1, backward 2): bubble {sim['bubble']:.3f} (1F1B: {bubble_formula(p, m):.3f}); "
              f"activations held per stage {held} (1F1B: {ref_held}).")
    if warm_note:
        return warm_note.strip() + effect
    s = next(s for s in range(p) if plan[s] != ref[s])
    k = next(k for k, (a, b) in enumerate(zip(plan[s], ref[s])) if a != b)
    return (f"stage {s}'s op number {k} is {''.join(map(str, plan[s][k]))}; 1F1B runs "
            f"{''.join(map(str, ref[s][k]))} there: after the warm-up, one forward, then one backward, the oldest "
            f"micro-batch first.{effect}")


def check_1f1b(fn) -> Feedback:
    """Compare ``fn(stages, micro_batches)`` with the 1F1B schedule on several pipelines; explain the first
    difference."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    for p, m in CASES:
        try:
            plan = fn(p, m)
        except NotImplementedError:
            return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell "
                                           "again")
        except Exception as e:  # noqa: BLE001 (the learner's code: any error is feedback)
            return wrong(f"for {p} stages and {m} micro-batches your function raised {type(e).__name__}: {e}")
        message = diagnose(plan, p, m)
        if message:
            return wrong(f"{p} stages, {m} micro-batches: {message}")
    cases = ", ".join(f"{p}x{m}" for p, m in CASES)
    return passed(f"your schedule is 1F1B for every (stages x micro-batches) tried: {cases}; simulated, it idles "
                  "(p-1)/(m+p-1) of the time and stage s holds at most min(p-s, m) micro-batches' activations")


# ---------------------------------------------------------------------------------------------- one stage's loop
STAGES, MICRO_BATCHES, BATCH, WIDTH, LAYERS = 3, 4, 8, 16, 2
WAIT = 3.0   # seconds a Link waits for a message before it says which call was stuck


class Stuck(RuntimeError):
    """A :class:`Link` call waited longer than its timeout: ``call`` is e.g. ``"send(dst=1)"``."""

    def __init__(self, rank: int, call: str, peer: int, why: str):
        super().__init__(f"rank {rank} waited {WAIT:g} s in {call} and nothing happened ({why})")
        self.call, self.peer = call, peer


class _Handle:
    def __init__(self, link, call, peer, work, inbox=None, tensor=None):
        self.link, self.call, self.peer, self.work, self.inbox, self.tensor = link, call, peer, work, inbox, tensor
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            try:
                self.work.wait(timeout=datetime.timedelta(seconds=WAIT))
            except RuntimeError as e:
                raise Stuck(self.link.rank, self.call, self.peer, str(e).splitlines()[0][-80:]) from None
            if self.inbox is not None:
                with torch.no_grad():             # only now does the received tensor hold the message
                    self.tensor.copy_(self.inbox)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class Link:
    """``torch.distributed``'s point-to-point calls for the learner's stage loop, with a timeout on every wait and
    a received tensor filled only when its ``wait()`` returns (see the module's docstring)."""

    def __init__(self, rank: int):
        self.rank, self.handles = rank, []

    def isend(self, tensor, dst: int):
        h = _Handle(self, f"a wait() on isend(dst={dst})", dst, dist.isend(tensor.detach().contiguous(), dst=dst))
        self.handles.append(h)
        return h

    def irecv(self, tensor, src: int):
        inbox = torch.empty_like(tensor)
        tensor.fill_(float("nan"))         # until wait(): what a tensor read before it arrived holds here
        h = _Handle(self, f"a wait() on irecv(src={src})", src, dist.irecv(inbox, src=src), inbox, tensor)
        self.handles.append(h)
        return h

    def send(self, tensor, dst: int) -> None:
        h = self.isend(tensor, dst)
        h.call = f"send(dst={dst})"
        h.wait()

    def recv(self, tensor, src: int) -> int:
        h = self.irecv(tensor, src)
        h.call = f"recv(src={src})"
        h.wait()
        return src

    def drain(self) -> None:
        """Wait for every message still on its way (a loop may leave its isends to finish)."""
        for h in self.handles:
            h.wait()


def reference_stage_loop(stage, ops, rank, world_size, xs, ys, comm):
    """The reference solution: the course library's :func:`~course_lib.pipeline_parallel.stage_step`."""
    stage_step(stage, ops, rank, world_size, xs, ys, comm=comm)


def _stage_loop_worker(rank: int, world_size: int, fn) -> dict:
    stage = make_stage(rank, WIDTH, LAYERS)
    x, y = make_batch(BATCH, WIDTH)
    xs, ys = x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)
    out = {}
    for kind in ("gpipe", "1f1b"):   # GPipe first: a loop that deadlocks in 1F1B has run GPipe by then
        stage.zero_grad(set_to_none=True)
        link = Link(rank)
        try:
            fn(stage, schedule(kind, world_size, MICRO_BATCHES)[rank], rank, world_size, xs, ys, link)
            link.drain()
        except Stuck as e:
            out[kind] = {"stuck": (e.call, e.peer)}
            return out                 # the process group has a message in flight: no second run
        dist.barrier()
        out[kind] = {"grads": [None if p.grad is None else p.grad.clone() for p in stage.parameters()]}
    return out


def _full_grads() -> list[list[torch.Tensor]]:
    """Per stage, the gradients of the unsplit model for the whole batch's mean loss."""
    full = make_full_model(STAGES, WIDTH, LAYERS)
    x, y = make_batch(BATCH, WIDTH)
    torch.nn.functional.mse_loss(full(x), y).backward()
    params = list(full.parameters())
    per = len(params) // STAGES
    return [[p.grad for p in params[s * per:(s + 1) * per]] for s in range(STAGES)]


def _diagnose_stuck(states: dict[int, tuple[str, int]], kind: str) -> str:
    where = "; ".join(f"rank {r} in {call}" for r, (call, _) in sorted(states.items()))
    for r, (call, peer) in sorted(states.items()):
        other = states.get(peer)
        if call.startswith("send") and other and other[0].startswith("send") and other[1] == r:
            return (f"{kind} deadlocks: rank {r} is stuck in send(dst={peer}) and rank {peer} in send(dst={r}), "
                    f"each waiting {WAIT:g} s for the other to receive (stuck: {where}). A blocking send returns "
                    "only once its receiver takes the message, and these two neighbours both sent first. Send with "
                    "isend (and wait for it at the end), or post the receive first with irecv.")
    return (f"{kind} deadlocks: {where}, {WAIT:g} s each. Every receive needs a matching send on the other rank, "
            "and in the same order: stage s gets F i's input from stage s-1 and B i's gradient from stage s+1.")


def diagnose_stage_loop(results: list[dict], expected: list[list[torch.Tensor]]) -> str | None:
    """What is wrong with a stage loop's results (one dict per rank from the check's worker); ``None`` if nothing."""
    last = len(results) - 1
    for kind in ("gpipe", "1f1b"):
        stuck = {r: res[kind]["stuck"] for r, res in enumerate(results) if "stuck" in res.get(kind, {})}
        if stuck:
            also = " (It ran GPipe: there all forwards flow one way, then all backwards the other; in 1F1B they " \
                   "cross.)" if kind == "1f1b" else ""
            return _diagnose_stuck(stuck, kind) + also
        grads = [res[kind]["grads"] for res in results]
        none = [r for r, g in enumerate(grads) if any(t is None for t in g)]
        if none:
            return (f"{kind}: stage {none[0]} has no gradients: each ('B', i) runs a backward, the last stage's "
                    "from the loss, the others' from the gradient that stage s+1 sends")
        nan = [r for r, g in enumerate(grads) if any(not torch.isfinite(t).all() for t in g)]
        if nan:
            if nan[-1] == last:
                return (f"{kind}: the loss is NaN: a stage ran a forward on its input before it arrived. irecv only "
                        "starts a receive: wait() on its handle before you use the tensor (this check fills it "
                        "with NaN until then; on a real machine it would hold garbage)")
            r = nan[-1]
            return (f"{kind}: stage {r}'s gradients are NaN, stage {r + 1}'s are right: stage {r} ran a backward "
                    f"before the gradient of its forward's output arrived from stage {r + 1}. wait() on the "
                    "irecv's handle before you use the tensor (this check fills it with NaN until then; on a real "
                    "machine it would hold garbage)")
        ratios = [float((g * e).sum() / (e * e).sum()) for gs, es in zip(grads, expected) for g, e in zip(gs, es)]
        wrong_stages = [r for r, (gs, es) in enumerate(zip(grads, expected))
                        if not all(torch.allclose(g, e, atol=1e-6, rtol=1e-4) for g, e in zip(gs, es))]
        if not wrong_stages:
            continue
        c = ratios[0]
        if all(math.isclose(v, c, rel_tol=1e-3) for v in ratios) and all(
                torch.allclose(g, e * c, atol=1e-6, rtol=1e-4) for gs, es in zip(grads, expected)
                for g, e in zip(gs, es)):
            if math.isclose(c, MICRO_BATCHES, rel_tol=1e-3):
                return (f"{kind}: your gradients are {MICRO_BATCHES} = m times the whole model's: the loss of each "
                        "micro-batch was scaled by 1. F.mse_loss is the mean over the micro-batch; the batch's mean "
                        "is the mean of the m micro-batch means, so scale each one by 1/m")
            return f"{kind}: your gradients are {c:.3g} times the whole model's: scale each micro-batch's loss by 1/m"
        r = wrong_stages[-1]
        return (f"{kind}: stage {r}'s gradients differ from the unsplit model's"
                + (f" (stages after it are right: look at what stage {r} computes or receives)" if r < last else "")
                + ". Each stage runs the forward of its input and, for ('B', i), the backward of that same output")
    return None


class _Probe:
    """A ``comm`` for a dry run in this process: the first call to it ends the run."""

    def __getattr__(self, name):
        raise _ProbeReached


class _ProbeReached(Exception):
    pass


def _not_attempted(fn) -> bool:
    """Whether ``fn`` is still the stub: run as stage 0 here, with a ``comm`` that stops it at its first send or
    receive (no process is started for a stub)."""
    x, y = make_batch(BATCH, WIDTH)
    try:
        fn(make_stage(0, WIDTH, LAYERS), schedule("1f1b", STAGES, MICRO_BATCHES)[0], 0, STAGES,
           x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES), _Probe())
    except NotImplementedError:
        return True
    except Exception:  # noqa: BLE001 (the probe, or the learner's error: the real run reports it)
        pass
    return False


def check_stage_loop(fn) -> Feedback:
    """Run ``fn(stage, ops, rank, world_size, xs, ys, comm)`` as each stage of a 3-stage pipeline, GPipe then 1F1B
    (4 micro-batches), and compare the gradients with the unsplit model's; name a deadlock, a tensor used before
    it arrived, or a loss scaled wrong."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    if _not_attempted(fn):
        return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell again")
    results, problem = run_attempt(_stage_loop_worker, STAGES, fn, timeout=60,
                                   timeout_hint="Did you call torch.distributed yourself? Use `comm`: its waits "
                                                "give up after a few seconds and say where they were stuck.")
    if problem is not None:
        return problem
    message = diagnose_stage_loop(results, _full_grads())
    if message:
        return wrong(f"{STAGES} stages, {MICRO_BATCHES} micro-batches: {message}")
    return passed(f"on {STAGES} processes, GPipe and 1F1B with {MICRO_BATCHES} micro-batches: your loop gives the "
                  "unsplit model's gradients, and no send waits for a receive that never comes")
