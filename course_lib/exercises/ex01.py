"""Notebook 01's exercises: a ring shift with point-to-point messages, and a global mean.

Each ``check_*`` runs the learner's worker on several world sizes and explains what went wrong.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import as_number, passed, run_attempt, wrong

RING_SIZES = (3, 4)  # not 2: with two ranks "the next" and "the previous" rank are the same rank


def ring_shift(rank, world_size):
    """Reference: send my value to the next rank, receive the previous rank's, return what arrived."""
    mine = torch.tensor([100.0 + rank])
    received = torch.empty(1)
    send = dist.isend(mine, dst=(rank + 1) % world_size)      # post both without blocking...
    recv = dist.irecv(received, src=(rank - 1) % world_size)
    send.wait()                                               # ...then wait for both
    recv.wait()
    return received


def check_ring_shift(fn):
    """Every rank r must return 100 + (r - 1) % world_size: the value of the rank before it."""
    for n in RING_SIZES:
        results, feedback = run_attempt(
            fn, n, timeout=10,
            timeout_hint="Every rank is probably blocked in recv() (or send()) waiting for a partner that is "
                         "itself blocked: a deadlock. Post the send without blocking (dist.isend) before you "
                         "wait, or let even ranks send first and odd ranks receive first. (A rank that sends to "
                         "a rank that does not exist waits forever too: wrap around with % world_size.)",
            error_hints={"rank": "a destination or source outside 0..world_size-1: wrap around with "
                                 "% world_size so the last rank sends to rank 0."})
        if feedback is not None:
            return feedback
        for r, value in enumerate(results):
            got = as_number(value)
            want, own, nxt = 100.0 + (r - 1) % n, 100.0 + r, 100.0 + (r + 1) % n
            if value is None:
                return wrong(f"rank {r} returned None: return the tensor you received into")
            if got is None:
                return wrong(f"rank {r} returned {value!r}: return the one-element tensor you received")
            if got == want:
                continue
            if got == own:
                return wrong(f"rank {r} returned its own value {got:g}: return the buffer you received into, "
                             "not the one you sent")
            if got == nxt:
                return wrong(f"on {n} ranks, rank {r} received {got:g}, which rank {(r + 1) % n} sent: the data went "
                             "the wrong way round. Send to (rank + 1) % world_size and receive from "
                             "(rank - 1) % world_size.")
            return wrong(f"rank {r} returned {got:g}, which no rank sent: did you wait for the irecv "
                         "(req.wait()) before returning the buffer?")
    return passed(f"on {' and '.join(map(str, RING_SIZES))} ranks every rank received its left neighbour's value")


def shard(rank: int) -> torch.Tensor:
    """Rank r's share of the data: r + 2 numbers (the shards differ in size on purpose)."""
    return torch.arange(rank + 2, dtype=torch.float64) + 10 * rank


def global_mean(rank, world_size):
    """Reference: the mean of every rank's numbers, the same on every rank."""
    data = shard(rank)
    totals = torch.tensor([data.sum().item(), float(data.numel())], dtype=torch.float64)
    dist.all_reduce(totals)                                   # [sum of all numbers, count of all numbers]
    return (totals[0] / totals[1]).item()


def check_global_mean(fn):
    """Every rank must return the mean of all shards' numbers."""
    for n in (2, 4):
        results, feedback = run_attempt(fn, n, timeout=10)
        if feedback is not None:
            return feedback
        shards = [shard(r) for r in range(n)]
        everything = torch.cat(shards)
        want = everything.mean().item()
        local = [s.mean().item() for s in shards]
        got = [as_number(v) for v in results]
        if any(g is None for g in got):
            r = got.index(None)
            return wrong(f"rank {r} returned {results[r]!r}: return one number (a float or a 1-element tensor)")
        if all(abs(g - want) < 1e-9 for g in got):
            continue
        if abs(got[0] - want) < 1e-9:
            return wrong("only rank 0 has the right answer: dist.reduce leaves the result on the destination "
                         "rank; use dist.all_reduce so every rank gets it")
        if all(abs(g - m) < 1e-9 for g, m in zip(got, local)):
            return wrong("each rank returned the mean of its own shard: combine the ranks with dist.all_reduce")
        mean_of_means = sum(local) / n
        if all(abs(g - mean_of_means) < 1e-9 for g in got):
            return wrong(f"you averaged the per-rank means ({mean_of_means:g}), but the shards have different "
                         f"sizes, so that is not the mean of all numbers ({want:g}): all-reduce the sum and the "
                         "count, then divide")
        if all(abs(g - sum(local)) < 1e-9 for g in got) or all(abs(g - want * n) < 1e-9 for g in got):
            return wrong("the answer is world_size times too big: after all_reduce(SUM) you must divide "
                         "(by the total count, or by world_size for a mean of equal shards)")
        return wrong(f"on {n} ranks the ranks returned {[round(g, 4) for g in got]}, expected {want:g} on every rank")
    return passed("every rank agrees on the mean of all numbers, on 2 and 4 ranks")
