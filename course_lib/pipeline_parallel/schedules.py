"""Pipeline schedules: who runs which forward and backward when, simulated in plain Python.

A *schedule* says in which order each stage runs the forward (``F``) and backward (``B``) pass of each
micro-batch.  Two classics:

* **GPipe**: every stage runs all m forwards, then all m backwards.  Simple; each stage keeps the
  activations of all m micro-batches until their backward.
* **1F1B**: after a short warm-up (p - 1 - s forwards on stage s), each stage alternates one forward
  and one backward, so it keeps at most p - s micro-batches' activations; the idle time is the same.

Either way a stage waits at the start (for the first micro-batch to reach it) and at the end (for the
last backward to come back): the **bubble**.  With equal work per stage, its share of the time is
(p - 1) / (m + p - 1): more micro-batches, smaller bubble.

Interleaving (``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B``) gives each rank v stages,
each v times shorter: the idle time becomes (p - 1) / (v m) of the compute time (:func:`bubble_overhead`).

:func:`schedule`, :func:`simulate` and :func:`simulate_plan` (any plan, a learner's included: it says who
waits for what when a plan deadlocks), and :func:`play` (several stages per rank, any op durations: it replays
a real run's ops with their measured compute times) are plain Python (the pictures, the explorer and the
exercise's check use them); :mod:`.stages` runs a schedule for real, with activations and gradients sent
between ranks, and :mod:`.torch_pipelining` runs PyTorch's own.
"""
from __future__ import annotations

KINDS = ("gpipe", "1f1b")


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """The ordered ops of each stage: ``[[("F", 0), ("F", 1), ..., ("B", 1), ("B", 0)], ...]``."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}: use one of {KINDS}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {stages} and {micro_batches}")
    out = []
    for s in range(stages):
        if kind == "gpipe":
            ops = [("F", i) for i in range(micro_batches)] + [("B", i) for i in reversed(range(micro_batches))]
        else:
            warm = min(stages - 1 - s, micro_batches)
            ops = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < micro_batches:
                if f < micro_batches:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
                b += 1
        out.append(ops)
    return out


def simulate(kind: str, stages: int, micro_batches: int, t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Start and end time of every op of schedule ``kind``, if each takes the given time and communication is
    free: :func:`simulate_plan` of :func:`schedule`."""
    return simulate_plan(schedule(kind, stages, micro_batches), t_forward, t_backward)


def _dependency(op: str, s: int, i: int, stages: int) -> tuple[str, int, int] | None:
    """The op that must finish before stage ``s`` can run ``op`` on micro-batch ``i``: ``(op, stage, i)``."""
    if op == "F":
        return ("F", s - 1, i) if s > 0 else None
    return ("B", s + 1, i) if s < stages - 1 else ("F", s, i)


def simulate_plan(plan: list[list[tuple[str, int]]], t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Run a schedule (``plan[s]``: stage s's ops in order, as :func:`schedule` returns) on an imaginary clock.

    Each forward takes ``t_forward``, each backward ``t_backward``, and communication is free: :func:`play` with
    one stage per rank. Returns the ops' times per stage (``(op, micro_batch, start, end)``), the makespan and the
    bubble. Raises ``RuntimeError`` naming what each stuck stage waits for when the plan deadlocks, and
    ``ValueError`` for an op that is not ``("F", i)`` or ``("B", i)``.
    """
    for s, ops in enumerate(plan):
        bad = [op for op in ops if not (isinstance(op, tuple) and len(op) == 2 and op[0] in ("F", "B")
                                        and isinstance(op[1], int))]
        if bad:
            raise ValueError(f"stage {s}: {bad[0]!r} is not an op: use ('F', i) or ('B', i)")
    played = play([[(op, i, s, t_forward if op == "F" else t_backward) for op, i in ops]
                   for s, ops in enumerate(plan)], len(plan))
    times = [[(op, i, start, end) for op, i, _, start, end in ops] for ops in played["times"]]
    return {"times": times, "makespan": played["makespan"], "bubble": played["bubble"]}


def play(ranks: list[list[tuple[str, int, int, float]]], stages: int) -> dict:
    """Play the ops of each rank, in order, with the given durations: ``ranks[r]`` lists ``(op, micro_batch,
    stage, duration)`` (a rank may hold several stages, as in interleaved 1F1B).

    F(s, i) waits for F(s-1, i); B(s, i) waits for B(s+1, i) (the last stage's B waits for its own F); each rank
    runs one op at a time, in its list's order; messages are free. Returns each rank's ops as ``(op, micro_batch,
    stage, start, end)``, the makespan, and the bubble: 1 - busy / (ranks x makespan).
    """
    done: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[str, int, int, float, float]]] = [[] for _ in ranks]
    cursor, clock = [0] * len(ranks), [0.0] * len(ranks)
    while any(cursor[r] < len(ops) for r, ops in enumerate(ranks)):
        progressed = False
        for r, ops in enumerate(ranks):
            if cursor[r] == len(ops):
                continue
            op, i, s, duration = ops[cursor[r]]
            dep = _dependency(op, s, i, stages)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done.get(dep, 0.0))
            done[(op, s, i)] = clock[r] = start + duration
            times[r].append((op, i, s, start, clock[r]))
            cursor[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks: " + "; ".join(_waits(ranks, cursor, stages)))
    makespan = max(clock, default=0.0)
    busy = sum(end - start for ops in times for *_, start, end in ops)
    return {"times": times, "makespan": makespan, "bubble": 1 - busy / (len(ranks) * makespan) if makespan else 0.0}


def _waits(ranks: list[list[tuple]], cursor: list[int], stages: int) -> list[str]:
    """What each stuck stage waits for, in words."""
    out = []
    planned = {(op, s, i) for ops in ranks for op, i, s, _ in ops}
    for r, ops in enumerate(ranks):
        if cursor[r] == len(ops):
            continue
        op, i, s, _ = ops[cursor[r]]
        d_op, d_s, d_i = _dependency(op, s, i, stages)
        source = "its own" if d_s == s else f"stage {d_s}'s"
        never = "" if (d_op, d_s, d_i) in planned else f" (which is not in stage {d_s}'s schedule)"
        where = "" if r == s else f" (on rank {r})"
        out.append(f"stage {s}{where} waits for {source} {d_op}{d_i}{never} before its {op}{i}")
    return out


def bubble_formula(stages: int, micro_batches: int) -> float:
    """The idle share of the time, (p - 1) / (m + p - 1), for GPipe and 1F1B with equal stages."""
    return (stages - 1) / (micro_batches + stages - 1)


def bubble_overhead(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle time over compute time, (p - 1) / (v m), with ``chunks`` = v stages per rank (interleaved 1F1B;
    v = 1 for GPipe and 1F1B, where it is :func:`bubble_formula`'s b / (1 - b))."""
    return (stages - 1) / (chunks * micro_batches)


def peak_in_flight(kind: str, stages: int, micro_batches: int) -> list[int]:
    """Per stage, the most micro-batches whose activations are held at once (forward done, backward not)."""
    peaks = []
    for ops in schedule(kind, stages, micro_batches):
        held = peak = 0
        for op, _ in ops:
            held += 1 if op == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def ranks_overlap(timelines: list[list[tuple]]) -> float:
    """How much two ranks computed at the same time: the wall-clock seconds during which both ran an op, over the
    less busy rank's busy seconds. ``timelines[r]`` lists ``(op, i, ..., start, end)``. A pipeline whose ranks
    work side by side gives well above 0 (1F1B, 2 stages, 8 micro-batches: 21 of 24 units, 0.875); ranks that
    run one after the other give 0. Time-slicing on a busy machine stretches the ops but leaves them
    overlapping, so the share stays far from 0 there too."""
    def busy(ops):
        return [(a, b) for *_, a, b in ops]
    first, second = (busy(t) for t in timelines[:2])
    both = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in first for a2, b2 in second)
    least = min(sum(b - a for a, b in first), sum(b - a for a, b in second))
    return both / least if least > 0 else 0.0
