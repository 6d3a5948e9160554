"""Notebook 03's exercises: average the gradients by hand after ``backward()``; overlap that averaging with
backward (an all-reduce launched from each gradient's hook); then bucket it (gradients gathered in the order they
become ready, each full bucket all-reduced asynchronously as one message, all waited for before the step).

Each check runs the learner's code on real ranks and compares with the truth computed by the library: the average
of the ranks' gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import make_dataset
from ..data_parallel import average_gradients  # noqa: F401 (the reference solution)
from ..models import make_mlp
from . import passed, run_attempt, wrong
from .ex03_buckets import WaitWatch


def grad_trial(rank, world_size, fn):
    """Worker: local gradients, their true average (computed with the library), and the learner's result."""
    model = make_mlp(seed=0)
    x, y = make_dataset(32 * world_size, seed=5).tensors
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    expected = [g.clone() for g in local]
    for g in expected:
        dist.all_reduce(g)
        g /= world_size
    fn(model)
    return {"local": local, "expected": expected, "got": [p.grad.clone() for p in model.parameters()]}


def _all_equal(a, b) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


def check_average_gradients(fn):
    """Every rank's gradients must equal the average over ranks after ``fn(model)``."""
    for n in (2, 3):
        results, feedback = run_attempt(grad_trial, n, fn, timeout=15)
        if feedback is not None:
            return feedback
        if all(_all_equal(r["got"], r["expected"]) for r in results):
            continue
        if all(_all_equal(r["got"], [g * n for g in r["expected"]]) for r in results):
            return wrong(f"on {n} ranks the gradients are {n} times too large: all_reduce sums, so divide by the "
                         "world size. (With the sum, the learning rate is silently multiplied by the number of ranks.)")
        if all(_all_equal(r["got"], r["local"]) for r in results):
            return wrong("the gradients are unchanged: each rank still has only its own. all_reduce every p.grad.")
        if _all_equal(results[0]["got"], results[0]["expected"]):
            return wrong("only rank 0 has the average: use dist.all_reduce (not dist.reduce) so every rank gets it")
        return wrong(f"on {n} ranks the gradients after your function are not the average over ranks")
    return passed("after your function every rank holds the average gradient, on 2 and 3 ranks")


# ---- overlap: launch each gradient's all-reduce from a hook, wait before the step --------------------------

def launch_when_ready(model) -> list:
    """Reference: a hook on every parameter launches its gradient's all-reduce, asynchronously, the moment the
    gradient has been accumulated; the returned list collects ``(parameter, work)`` pairs as backward runs."""
    pending = []

    def hook(p):
        pending.append((p, dist.all_reduce(p.grad, async_op=True)))   # returns at once: backward goes on
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    return pending


def wait_and_average(pending: list) -> None:
    """Reference: before ``optimizer.step()``, wait for every launched all-reduce and divide by the world size."""
    world_size = dist.get_world_size()
    for p, work in pending:
        work.wait()
        p.grad /= world_size
    pending.clear()


def overlap_trial(rank, world_size, launch, finish):
    """Worker: one backward pass with the learner's hooks; records the all-reduces launched during backward and
    every wait (``work.wait()``, the future's ``wait()``/``value()``, ``torch.futures.wait_all``)."""
    import copy
    model = make_mlp(seed=0, depth=3)
    reference = copy.deepcopy(model)
    x, y = make_dataset(32 * world_size, seed=6).tensors
    x, y = x[rank::world_size], y[rank::world_size]
    F.cross_entropy(reference(x), y).backward()
    for p in reference.parameters():                      # the truth, computed before any hook exists
        dist.all_reduce(p.grad)
        p.grad /= world_size
    with WaitWatch() as watch:
        pending = launch(model)
        watch.backward = True
        F.cross_entropy(model(x), y).backward()
        watch.backward = False
        launched = [c for c in watch.calls if c["backward"]]
        finish(pending)
    got = [p.grad.clone() for p in model.parameters()]
    return {"expected": [p.grad for p in reference.parameters()], "got": got, "launched": launched,
            "params": sum(1 for _ in model.parameters()), **watch.summary()}


def check_overlapped_averaging(launch, finish):
    """``launch(model)`` registers the hooks (and returns what ``finish`` needs); after backward, ``finish(that)``
    leaves every rank with the average gradient, on 2 and 3 ranks. The all-reduces must start during backward,
    asynchronously, and be waited for after backward, in ``finish``."""
    for n in (2, 3):
        results, feedback = run_attempt(overlap_trial, n, launch, finish, timeout=20)
        if feedback is not None:
            return feedback
        r = results[0]
        if not r["launched"]:
            return wrong("no all-reduce started during backward(): register a hook on each parameter "
                         "(p.register_post_accumulate_grad_hook) and launch the all-reduce inside it")
        if not all(c["async"] for c in r["launched"]):
            return wrong("the all-reduces in your hooks block (async_op=False): backward waits for each one, so "
                         "nothing overlaps. Launch them with async_op=True and wait for them in `finish`")
        if any(res["waits_in_backward"] for res in results):
            return wrong("your hook waits for its all-reduce right after launching it (waiting at once): backward "
                         "stands still until the sum arrives, so nothing overlaps. Keep the work, wait in `finish`")
        if any(res["unwaited"] for res in results):
            return wrong(f"{max(res['unwaited'] for res in results)} of the launched all-reduces were never waited "
                         "for: call .wait() on every work before reading p.grad (the sum may still be in flight)")
        if all(_all_equal(res["got"], [g * n for g in res["expected"]]) for res in results):
            return wrong(f"the gradients are {n} times too large on {n} ranks: divide by the world size, "
                         "dist.get_world_size(), after waiting")
        if not all(_all_equal(res["got"], res["expected"]) for res in results):
            return wrong(f"on {n} ranks, after `finish` the gradients are not the average over ranks")
    return passed(f"{len(r['launched'])} all-reduces started during backward, one per parameter as its gradient "
                  "was ready, and every rank ends with the average, on 2 and 3 ranks")


from .ex03_buckets import bucketed_averaging, check_bucketed_averaging  # noqa: E402, F401 (the third exercise)
