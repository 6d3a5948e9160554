"""Notebook 02's exercises: all-reduce written by hand, checked against ``dist.all_reduce``.

The learner writes ``fn(tensor)`` that sums ``tensor`` across ranks **in place** (returning it is fine
too). The check runs it on 2, 3 and 4 ranks, on float32, float64 and int64 tensors, with sizes that do
not divide by the world size and sizes smaller than it, and compares every rank with ``dist.all_reduce``.
The data are whole numbers, so every correct order of additions gives exactly the same sums, and a wrong
answer can be recognised by what it equals (the rank's own data, a sum counted twice, ...).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.allreduce import naive_all_reduce, recursive_doubling_all_reduce, ring_all_reduce  # noqa: F401 (references)
from . import passed, run_attempt, wrong

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
        result = fn(x)
        got = result if isinstance(result, torch.Tensor) else x
        out.append({"dtype": str(dtype).replace("torch.", ""), "size": size, "original": original,
                    "got": got.detach().clone(), "expected": expected})
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
        extra = k["got"] - k["expected"]
        changed = extra != 0
        if any(torch.equal(extra[changed], q["original"][changed]) for q in cases):
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


def check_all_reduce(fn, name: str = "your all-reduce"):
    """Run ``fn`` on 2, 3 and 4 ranks over every case; explain the first wrong answer."""
    for n in WORLD_SIZES:
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
    return passed(f"{name} equals dist.all_reduce on 2, 3 and 4 ranks for float32, float64 and int64, "
                  "including sizes not divisible by the world size and smaller than it")
