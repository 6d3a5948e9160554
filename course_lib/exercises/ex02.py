"""Notebook 02's exercises: all-reduce written by hand, checked against ``dist.all_reduce``.

The learner writes ``fn(tensor)`` that sums ``tensor`` across ranks **in place** (returning it is fine
too). The check runs it on 2, 3 and 4 ranks, on float32, float64 and int64 tensors, with sizes that do
not divide by the world size and sizes smaller than it, and compares every rank with ``dist.all_reduce``.
The data are whole numbers, so every correct order of additions gives exactly the same sums, and a wrong
answer can be recognised by what it equals (the rank's own data, a sum counted twice, ...).

The checks run on Gloo, where ``isend`` returns at once and Gloo's threads move every posted operation at
the same time. NCCL is stricter: a send or receive issued on its own is a kernel that runs after the ones
issued before it, and it finishes only when the peer's matching operation runs too. (PyTorch may put
operations with different peers on different streams; between two ranks, and in NCCL's own rule that a
rank's concurrent sends and receives go in one group, the order is what counts. The replay is that
conservative rule.) So the check also records, on every rank, the order in which
the learner issued point-to-point operations (:func:`recording_p2p`), replays those orders with NCCL's rule
(:func:`nccl_deadlock`) and calls a pattern that would hang there wrong, even when Gloo gave the right sums.
A ring whose ranks each post ``isend`` to the right before ``irecv`` from the left is such a pattern; the
send and the receive of one step handed over together, in one ``dist.batch_isend_irecv`` (one NCCL group),
is the fix.
"""
from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def recording_p2p(trace: list):
    """Record the point-to-point operations this process issues, in order, into ``trace``.

    Each entry is one unit the backend gets at once: a list of ``(kind, peer)`` with kind ``"send"`` or
    ``"recv"`` (peer ``None``: a receive from any source). ``send``/``recv``/``isend``/``irecv`` give one-op
    units; a ``batch_isend_irecv`` gives one unit with all its operations. Only ``torch.distributed``'s
    names are wrapped, in this process, while the block runs; ``P2POp`` is wrapped so that it accepts the
    wrapped ``isend``/``irecv``.
    """
    real = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp")}

    def peer(args, kwargs, key):
        return args[0] if args else kwargs.get(key)

    def one(kind, name, key):
        def wrapped(tensor, *args, **kwargs):
            trace.append([(kind, peer(args, kwargs, key))])
            return real[name](tensor, *args, **kwargs)
        wrapped.real = real[name]
        return wrapped

    wrapped = {"send": one("send", "send", "dst"), "recv": one("recv", "recv", "src"),
               "isend": one("send", "isend", "dst"), "irecv": one("recv", "irecv", "src")}

    def p2p_op(op, tensor, *args, **kwargs):
        return real["P2POp"](getattr(op, "real", op), tensor, *args, **kwargs)

    def batch_isend_irecv(ops):
        trace.append([("send" if op.op is real["isend"] else "recv", op.peer) for op in ops])
        return real["batch_isend_irecv"](ops)

    wrapped.update(batch_isend_irecv=batch_isend_irecv, P2POp=p2p_op)
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
    try:
        yield trace
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def nccl_deadlock(traces: list[list[list[tuple]]]) -> list[tuple] | None:
    """Replay every rank's issued units with NCCL's rule; the stuck ranks' pending operations, or ``None``.

    The rule: a rank runs its units in issue order, one at a time; an operation of the running unit
    finishes when the peer's matching operation (the next send ``a -> b`` with the next receive of ``b``
    from ``a``) is in the peer's running unit. A unit is done when all its operations are. If no
    operation can finish and a rank has units left, NCCL would hang: the answer is, for each stuck rank,
    ``(rank, [(kind, peer), ...])`` of its running unit's unfinished operations.
    """
    n = len(traces)
    position = [0] * n                     # the running unit of each rank
    done = [set() for _ in range(n)]       # finished operation indices of the running unit

    def running(r):
        return traces[r][position[r]] if position[r] < len(traces[r]) else []

    def advance(r):
        while position[r] < len(traces[r]) and len(done[r]) == len(traces[r][position[r]]):
            position[r] += 1
            done[r] = set()

    for r in range(n):
        advance(r)
    progress = True
    while progress:
        progress = False
        for a in range(n):
            for i, (kind, b) in enumerate(running(a)):
                if kind != "send" or i in done[a] or b is None or not 0 <= b < n:
                    continue
                for j, (kind_b, src) in enumerate(running(b)):
                    if kind_b == "recv" and j not in done[b] and src in (a, None):
                        done[a].add(i)
                        done[b].add(j)
                        progress = True
                        break
            for r in range(n):
                advance(r)
    stuck = [(r, [op for i, op in enumerate(running(r)) if i not in done[r]]) for r in range(n)
             if position[r] < len(traces[r])]
    return stuck or None


def _deadlock_message(stuck, n) -> str:
    waits = "; ".join(f"rank {r} " + " and ".join(f"{k} {'to' if k == 'send' else 'from'} {p}" for k, p in ops)
                      for r, ops in stuck[:4])
    return (f"on {n} ranks the sums are right on Gloo, but on NCCL this order of messages would deadlock: "
            f"each of these ranks waits for a peer that is waiting too ({waits}). On NCCL a send issued on its "
            "own finishes only when the peer's receive runs, and operations run in the order you issued them. "
            "Hand a step's send and receive to the backend together: "
            "dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), dist.P2POp(dist.irecv, ...)]) "
            "(one NCCL group), as allreduce.exchange does.")


def trial(rank, world_size, fn):
    """Worker: the reference result first (with the library), then the learner's, case by case."""
    out = []
    for dtype, size in CASES:
        g = torch.Generator().manual_seed(1000 * rank + size)
        x = torch.randint(-50, 50, (size,), generator=g).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        original = x.clone()
        with recording_p2p([]) as trace:
            result = fn(x)
        got = result if isinstance(result, torch.Tensor) else x
        out.append({"dtype": str(dtype).replace("torch.", ""), "size": size, "original": original,
                    "got": got.detach().clone(), "expected": expected, "trace": trace})
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
        for c in range(len(CASES)):
            stuck = nccl_deadlock([results[r][c]["trace"] for r in range(n)])
            if stuck:
                return wrong(_deadlock_message(stuck, n))
    return passed(f"{name} equals dist.all_reduce on 2, 3 and 4 ranks for float32, float64 and int64, "
                  "including sizes not divisible by the world size and smaller than it; its order of sends "
                  "and receives cannot deadlock on NCCL")
