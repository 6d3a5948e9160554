"""Notebook 08's exercise: make a hang an error.

The learner writes ``mean_loss(loss)``, called by every rank to log the mean loss over the ranks. It must return that
mean when every rank calls it, and, when one rank never arrives (stuck loading data, say), raise within seconds on a
rank that is waiting, instead of waiting for the default 30 minutes. The check runs both: 3 healthy ranks, then 3
ranks of which the last one is stuck.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launch import RankError, RunTimeoutError, run
from . import NOT_ATTEMPTED, Feedback, passed, run_attempt, wrong

STUCK_FOR = 30.0      # seconds the stuck rank sleeps: far longer than any answer may wait
PROMISE = 10.0        # seconds within which a waiting rank must have raised


def mean_loss(loss: torch.Tensor) -> float:
    """Reference: the mean of ``loss`` over the ranks, or an error naming the ranks that did not arrive within 5 s.

    ``monitored_barrier`` (Gloo only) makes rank 0 wait for every rank with a timeout and say which are missing;
    only then does the all-reduce start, so it can no longer wait for a rank that is not coming."""
    dist.monitored_barrier(timeout=timedelta(seconds=5), wait_all_ranks=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def healthy_trial(rank, world_size, fn):
    return fn(torch.tensor(float(rank + 1)))


def stuck_trial(rank, world_size, fn):
    if rank == world_size - 1:
        time.sleep(STUCK_FOR)                   # never arrives in time
    return fn(torch.tensor(float(rank + 1)))


def check_mean_loss(fn) -> Feedback:
    """``fn(loss)`` returns the mean over ranks when all arrive, and raises within seconds when one never does."""
    results, feedback = run_attempt(healthy_trial, 3, fn, timeout=30)
    if feedback is not None:
        return feedback
    want = (1 + 2 + 3) / 3
    values = [float(r) if isinstance(r, torch.Tensor) and r.numel() == 1 else r for r in results]   # 0-d: fine
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or abs(v - want) > 1e-6 for v in values):
        return wrong(f"with every rank present, each should return the mean loss {want:g} (ranks hold 1, 2, 3), "
                     f"as a number or a one-element tensor; got {results}")
    start = time.monotonic()
    try:
        run(stuck_trial, 3, fn, backend="gloo", timeout=STUCK_FOR - 10, show_output=False)
    except RunTimeoutError:
        return wrong(f"with rank 2 stuck, ranks 0 and 1 were still waiting after {STUCK_FOR - 10:g} s: nothing turned "
                     "the wait into an error. A collective waits for the process group's timeout (30 minutes by "
                     "default): give the wait a timeout of its own, e.g. dist.monitored_barrier(timeout=...)")
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code")
        took = time.monotonic() - start
        if took > PROMISE + 5:
            return wrong(f"it did fail, but only after {took:.0f} s: a short timeout (a few seconds) turns the hang "
                         "into an error a person is still waiting for")
        named = "2" in e.exc_message and ("monitoredBarrier" in e.exc_message or "rank" in e.exc_message.lower())
        return passed(f"with every rank present the mean is {want:g}; with rank 2 stuck, rank {e.rank} raised after "
                      f"{took:.1f} s ({e.exc_type})" + (", naming the missing rank" if named else ""))
    return wrong(f"with rank 2 stuck for {STUCK_FOR:g} s, every rank still returned: did you skip the collective?")
