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

:func:`schedule` and :func:`simulate` are plain Python (the pictures and the explorer use them);
:mod:`.stages` runs a schedule for real, with activations and gradients sent between ranks.
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
    """Start and end time of every op, if each takes the given time and communication is free.

    F(s, i) waits for F(s-1, i); B(s, i) waits for B(s+1, i) (the last stage's B waits for its own F);
    each stage runs its ops in schedule order.  Returns the ops' times, the makespan and the bubble.
    """
    plan = schedule(kind, stages, micro_batches)
    done: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[str, int, float, float]]] = [[] for _ in range(stages)]
    cursor, clock = [0] * stages, [0.0] * stages
    while any(cursor[s] < len(plan[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if cursor[s] == len(plan[s]):
                continue
            op, i = plan[s][cursor[s]]
            dep = ("F", s - 1, i) if op == "F" and s > 0 else ("B", s + 1, i) if op == "B" and s < stages - 1 \
                else ("F", s, i) if op == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            end = start + (t_forward if op == "F" else t_backward)
            done[(op, s, i)] = clock[s] = end
            times[s].append((op, i, start, end))
            cursor[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {kind} deadlocks")  # cannot happen for the schedules above
    makespan = max(clock)
    busy = micro_batches * (t_forward + t_backward)
    return {"times": times, "makespan": makespan, "bubble": 1 - busy / makespan}


def bubble_formula(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


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
