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

* every wait gives up after :data:`WAIT` seconds and says which call it was stuck in (a deadlock becomes an
  error, and the check names who waited for whom, or who finished without sending);
* ``irecv`` fills its tensor with NaN until ``wait()`` returns, so a tensor used before it arrived gives NaN
  gradients every time (on a real machine it holds whatever was there: a silent, racy wrong gradient), and it
  refuses a buffer another pending ``irecv`` fills; an ``isend`` never waited for is named.

The stage is wrapped so that the forwards and backwards it runs are recorded and compared with ``ops``. The
machinery is in :mod:`._ex07_loop`.
"""
from __future__ import annotations

from ..pipeline_parallel import bubble_formula, make_batch, make_stage, schedule, simulate_plan
from . import NOT_ATTEMPTED, Feedback, passed, run_attempt, wrong
from ._ex07_loop import (  # noqa: F401 (re-exported: the notebook and the tests use them as ex07.*)
    BATCH,
    LAYERS,
    MICRO_BATCHES,
    STAGES,
    WAIT,
    WIDTH,
    Link,
    Stuck,
    diagnose_stage_loop,
    full_grads,
    reference_stage_loop,
    stage_loop_worker,
)

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
# The check's machinery (Link, the recorder, the diagnosis) lives in _ex07_loop, to keep this file short.
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
    (4 micro-batches), and compare the gradients with the unsplit model's and the ops each stage ran with its
    ``ops``; name a deadlock, a send never made, a tensor used before it arrived, two receives into one buffer,
    an isend never waited for, an order other than ``ops``'s, or a loss scaled wrong."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    if _not_attempted(fn):
        return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell again")
    results, problem = run_attempt(stage_loop_worker, STAGES, fn, timeout=120,
                                   timeout_hint="Did you call torch.distributed yourself? Use `comm`: its waits "
                                                "give up after a few seconds and say where they were stuck.")
    if problem is not None:
        return problem
    message = diagnose_stage_loop(results, full_grads())
    if message:
        return wrong(f"{STAGES} stages, {MICRO_BATCHES} micro-batches: {message}")
    return passed(f"on {STAGES} processes, GPipe and 1F1B with {MICRO_BATCHES} micro-batches: your loop runs its ops "
                  "in their order, gives the unsplit model's gradients, and no send waits for a receive that never "
                  "comes")
