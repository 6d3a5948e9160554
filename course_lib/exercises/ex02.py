"""Notebook 02's exercises: all-reduce written by hand, checked against ``dist.all_reduce``.

The learner writes ``fn(tensor)`` that sums ``tensor`` across ranks **in place** (returning it is fine
too). The check runs it on 2, 3 and 4 ranks, on float32, float64 and int64 tensors, with sizes that do
not divide by the world size and sizes smaller than it, and compares every rank with ``dist.all_reduce``.
The data are whole numbers, so every correct order of additions gives exactly the same sums, and a wrong
answer can be recognised by what it equals (the rank's own data, a sum counted twice, ...).

The checks run on Gloo, where ``isend`` returns at once and Gloo's threads move every posted operation at
the same time. NCCL is stricter. Its documented contract: a send may block until the matching receive is
posted, and operations that must progress together go in one group (``ncclGroupStart``/``End``; in PyTorch
``dist.batch_isend_irecv``). Besides, PyTorch without ``device_id`` in ``init_process_group`` gives each
pair of ranks that exchange a send/recv its own 2-rank communicator and stream, created at their first
message; on N >= 3 ranks that all send first, the hang is a cycle of ranks each waiting for a neighbour to
join a communicator set-up. The replay applies the contract's conservative reading: a rank's units run one at
a time, in issue order. So the check also records, on every rank, the order in which
the learner issued point-to-point operations (:func:`recording_p2p`), replays those orders with NCCL's rule
(:func:`nccl_deadlock`) and calls a pattern that would hang there wrong, even when Gloo gave the right sums.
A ring whose ranks each post ``isend`` to the right before ``irecv`` from the left is such a pattern; the
send and the receive of one step handed over together, in one ``dist.batch_isend_irecv`` (one NCCL group),
is the fix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.allreduce import naive_all_reduce, recursive_doubling_all_reduce, ring_all_reduce  # noqa: F401 (references)
from . import passed, run_attempt, wrong
from ._ex02_trace import COLLECTIVES, _deadlock_message, nccl_deadlock, recording_p2p  # noqa: F401

WORLD_SIZES = (2, 3, 4)
CASES = ((torch.float32, 1000), (torch.float64, 7), (torch.int64, 2), (torch.float32, 1))
UNEVEN = ("sizes not divisible by world_size, or smaller than it, give uneven or empty chunks (and tensor.chunk "
          "then returns fewer than world_size of them): tensor.tensor_split(world_size) always returns world_size "
          "chunks; empty ones need no message.")
HINTS = {"size": UNEVEN, "index out of range": UNEVEN,
         "shape": "the buffer you receive into must have the sender's shape."}


def trial(rank, world_size, fn):
    """Worker: the reference result first (with the library), then the learner's, case by case."""
    out = []
    for dtype, size in CASES:
        g = torch.Generator().manual_seed(1000 * rank + size)
        x = torch.randint(-50, 50, (size,), generator=g).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        original = x.clone()
        seen = {}
        with recording_p2p([], seen) as trace:
            result = fn(x)
        got = result if isinstance(result, torch.Tensor) else x
        out.append({"dtype": str(dtype).replace("torch.", ""), "size": size, "original": original,
                    "got": got.detach().clone(), "expected": expected, "trace": trace,
                    "backend_sends": seen["sends"], "collectives": seen["collectives"]})
    return out


def _diagnose(per_rank, n) -> str | None:
    """A message for the first wrong case, naming the likely mistake; ``None`` if all are right."""
    for c in range(len(CASES)):
        cases = [per_rank[r][c] for r in range(n)]
        if all(k["got"].shape == k["expected"].shape and torch.equal(k["got"], k["expected"]) for k in cases):
            continue
        where = f"on {n} ranks, {cases[0]['dtype']} tensor of {cases[0]['size']} element(s)"
        bad = next(r for r, k in enumerate(cases) if not torch.equal(k["got"], k["expected"]))
        k = cases[bad]
        if k["got"].shape != k["expected"].shape:
            return f"{where}: rank {bad} returned shape {tuple(k['got'].shape)}, not {tuple(k['expected'].shape)}"
        if torch.equal(cases[0]["got"], cases[0]["expected"]) and all(
                torch.equal(q["got"], q["original"]) for q in cases[1:]):
            return f"{where}: only rank 0 has the sum; the other ranks still hold their own data. Send the result back."
        if all(torch.equal(q["got"], q["original"]) for q in cases):
            return f"{where}: every rank still holds its own data. Modify `tensor` in place (or return the result)."
        if k["got"].is_floating_point() and torch.allclose(k["got"] * n, k["expected"].to(k["got"].dtype)):
            return f"{where}: the result is the average; this check wants the sum (dist.all_reduce's default)"
        missing = [r for r in range(n)
                   if all(torch.equal(q["got"], q["expected"] - cases[r]["original"]) for q in cases)]
        if missing:
            return (f"{where}: every rank got the sum without rank {missing[0]}'s data: "
                    "did that rank forget its own tensor?")
        if n > 1 and cases[0]["size"] % n:
            body = cases[0]["size"] // n * n          # the part a split into n equal chunks covers
            if all(torch.equal(q["got"][:body], q["expected"][:body]) for q in cases):
                return f"{where}: the last {cases[0]['size'] - body} element(s) were never reduced. " + UNEVEN
        extra = k["got"] - k["expected"]
        changed = extra != 0
        if int(changed.sum()) > 1 and any(torch.equal(extra[changed], q["original"][changed]) for q in cases):
            return (f"{where}: rank {bad} has a contribution added twice. In the all-gather the finished chunks must "
                    "overwrite the partial ones, not be added to them; and no chunk may go round more than N-1 times.")
        if n > 1 and cases[0]["size"] >= n:
            chunks = lambda t: list(t.view(-1).tensor_split(n))  # noqa: E731
            owners = [sum(torch.equal(a, b) for a, b in zip(chunks(q["got"]), chunks(q["expected"]))) for q in cases]
            if all(o == 1 for o in owners):
                return (f"{where}: each rank has exactly one correct chunk: you stopped after the reduce-scatter. "
                        "Now pass the finished chunks round the ring (the all-gather).")
        return (f"{where}: rank {bad} got {k['got'].flatten()[:6].tolist()}..., expected "
                f"{k['expected'].flatten()[:6].tolist()}...")
    return None


def _p2p_message(cases, n) -> str | None:
    """Why the recorded messages of one case cannot be judged: a collective used, or sends the recorder missed."""
    used = sorted({c for k in cases for c in k["collectives"]})
    if used:
        return (f"on {n} ranks your function called a collective ({', '.join(used)}): this exercise is built from "
                "point-to-point messages only (dist.send/recv, dist.isend/irecv, dist.batch_isend_irecv).")
    recorded = sum(kind == "send" for k in cases for unit in k["trace"] for kind, _ in unit)
    if sum(k["backend_sends"] for k in cases) > recorded:
        return (f"on {n} ranks some sends reached the backend without going through dist.send, dist.isend or "
                "dist.batch_isend_irecv, so the check cannot see their order (a name imported with `from "
                "torch.distributed import ...` or taken from distributed_c10d bypasses it): call them as dist.<name>.")
    return None


def check_all_reduce(fn, name: str = "your all-reduce", world_sizes=WORLD_SIZES, p2p_only: bool = True):
    """Run ``fn`` on 2, 3 and 4 ranks (``world_sizes``) over every case; explain the first wrong answer.

    With ``p2p_only`` (the default) ``fn`` must be made of point-to-point messages, all issued through
    ``dist.``'s names: a collective inside fails, and so do sends the recorder did not see (their order cannot
    be replayed). ``p2p_only=False`` is for an all-reduce built from other collectives; the NCCL replay is
    then skipped.
    """
    for n in world_sizes:
        results, feedback = run_attempt(
            trial, n, fn, timeout=15,
            timeout_hint="A rank is waiting for a message nobody sends: check that every send has a matching recv "
                         "(same pair of ranks, same sizes) and that blocking calls cannot wait on each other.",
            error_hints=HINTS)
        if feedback is not None:
            return feedback
        message = _diagnose(results, n)
        if message:
            return wrong(message)
        for c in range(len(CASES) if p2p_only else 0):
            message = _p2p_message([results[r][c] for r in range(n)], n)
            if message:
                return wrong(message)
            stuck = nccl_deadlock([results[r][c]["trace"] for r in range(n)])
            if stuck:
                return wrong(_deadlock_message(stuck, n))
    ranks = ", ".join(map(str, world_sizes[:-1])) + f" and {world_sizes[-1]}" if len(world_sizes) > 1 \
        else str(world_sizes[0])
    return passed(f"{name} equals dist.all_reduce on {ranks} ranks for float32, float64 and int64, "
                  "including sizes not divisible by the world size and smaller than it"
                  + ("; it uses point-to-point messages only, in an order that cannot deadlock on NCCL"
                     if p2p_only else ""))
