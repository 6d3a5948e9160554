"""Notebook 03's third exercise: bucketed, overlapped gradient averaging (re-exported by :mod:`.ex03`).

Gradients go into the current bucket in the order they become ready; each full bucket is all-reduced asynchronously
as one tensor while backward goes on; ``finish()`` launches the last bucket, waits for all, divides and copies back.
The check counts the all-reduces and the values they carry and watches every wait, so that it can name the usual
mistakes: waiting at once, a bucket launched twice, a parameter that never gets a gradient, no division.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import make_dataset
from ..models import make_mlp
from . import passed, run_attempt, wrong


def _all_equal(a, b) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


# ---- buckets: gather gradients in the order they become ready, all-reduce each full bucket at once ---------------

def bucketed_averaging(model, bucket_cap_bytes: int):
    """Reference: hooks put each gradient, as it becomes ready, into the current bucket; once the bucket holds at
    least ``bucket_cap_bytes`` it is flattened and all-reduced asynchronously, and a new bucket begins. The returned
    ``finish()`` (call it after backward, before the step) launches the last, partly filled bucket, waits for every
    bucket, divides by the world size and copies the averages back into ``.grad``."""
    world_size = dist.get_world_size()
    bucket, launched = [], []                    # the bucket being filled; (params, flat, work) per launched bucket

    def launch():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        launched.append((list(bucket), flat, dist.all_reduce(flat, async_op=True)))
        bucket.clear()

    def hook(p):
        bucket.append(p)
        if sum(q.grad.numel() * q.grad.element_size() for q in bucket) >= bucket_cap_bytes:
            launch()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        if bucket:
            launch()
        for params, flat, work in launched:
            work.wait()
            flat /= world_size
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(piece.view_as(p))
        launched.clear()
    return finish


BUCKET_CAP_BYTES = 8 * 2**10     # the check's model then fills 3 buckets, the last one only partly
STEPS = 2                        # two backward passes: a bucket left over from step 1 shows in step 2


def bucket_trial(rank, world_size, fn):
    """Worker: two steps of the learner's bucketed averaging on an MLP with one parameter that never gets a gradient.
    Records every all-reduce (how many values, whether async, during backward or not) and every wait."""
    import torch.nn as nn
    model = make_mlp(seed=0, depth=3)
    model.register_parameter("unused", nn.Parameter(torch.zeros(4, 64)))    # registered, never used in forward
    x, y = make_dataset(32 * world_size, seed=7).tensors
    one_process = make_mlp(seed=0, depth=3)                                   # the truth: one process, global batch
    F.cross_entropy(one_process(x), y).backward()
    x, y = x[rank::world_size], y[rank::world_size]
    ready = []
    for p in model.parameters():                                              # registered first: runs first
        p.register_post_accumulate_grad_hook(lambda p: ready.append(p.numel() * p.element_size()))
    real, state = dist.all_reduce, {"backward": False, "calls": [], "waits_in_backward": 0}

    class Watched:
        def __init__(self, work):
            self.work, self.waited = work, False

        def wait(self, *args, **kwargs):
            self.waited = True
            state["waits_in_backward"] += state["backward"]
            return self.work.wait(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.work, name)

    works = []

    def watching(tensor, *args, async_op=False, **kwargs):
        state["calls"].append({"backward": state["backward"], "async": async_op, "values": tensor.numel(),
                               "step": state["step"]})
        work = real(tensor, *args, async_op=async_op, **kwargs)
        if async_op:
            works.append(Watched(work))
            return works[-1]
        return work
    dist.all_reduce = watching
    steps = []
    try:
        state["step"] = 0
        finish = fn(model, BUCKET_CAP_BYTES)
        for step in range(STEPS):
            state["step"] = step
            model.zero_grad()
            ready.clear()
            state["backward"] = True
            F.cross_entropy(model(x), y).backward()
            state["backward"] = False
            if not callable(finish):
                raise TypeError(f"your function must return `finish` (a function), got {finish!r}")
            finish()
            steps.append({"got": [p.grad.clone() for n, p in model.named_parameters() if n != "unused"],
                          "ready": list(ready),
                          "unused_grad": model.unused.grad is not None})
    finally:
        dist.all_reduce = real
    return {"expected": [p.grad for p in one_process.parameters()], "steps": steps, "calls": state["calls"],
            "waits_in_backward": state["waits_in_backward"], "unwaited": sum(not w.waited for w in works),
            "unused_values": model.unused.numel()}


def _expected_buckets(ready_bytes: list[int], cap: int) -> int:
    buckets, size = 0, 0
    for b in ready_bytes:
        size += b
        if size >= cap:
            buckets, size = buckets + 1, 0
    return buckets + (size > 0)


def check_bucketed_averaging(fn):
    """``fn(model, bucket_cap_bytes)`` registers hooks and returns ``finish``; after each backward, ``finish()``
    must leave every rank with the gradient of one process on the global batch. Buckets fill in the order the
    gradients become ready, each is all-reduced asynchronously as soon as it holds ``bucket_cap_bytes``, once."""
    results, feedback = run_attempt(bucket_trial, 2, fn, timeout=20, error_hints={
        "NoneType": "one parameter (`unused`) never gets a gradient: its .grad stays None and its hook never fires. "
                    "Work only with the parameters your hooks received.",
        "expected Tensor": "one parameter (`unused`) never gets a gradient: its .grad stays None and its hook never "
                           "fires. Work only with the parameters your hooks received."})
    if feedback is not None:
        return feedback
    r, world = results[0], 2
    ready = r["steps"][0]["ready"]
    values = sum(ready) // 4
    in_backward = [c for c in r["calls"] if c["backward"]]
    per_step = [[c for c in r["calls"] if c["step"] == s] for s in range(STEPS)]
    buckets = _expected_buckets(ready, BUCKET_CAP_BYTES)
    if not in_backward:
        return wrong("no all-reduce started during backward(): launch each bucket from the hook that fills it, "
                     "not in finish() (then nothing overlaps)")
    if not all(c["async"] for c in r["calls"]):
        return wrong("an all-reduce blocks (async_op=False): backward waits for each bucket, so nothing overlaps. "
                     "Launch with async_op=True and wait in finish()")
    if any(res["waits_in_backward"] for res in results):
        return wrong("you wait for a bucket's all-reduce right after launching it (waiting at once): backward stands "
                     "still until the sum arrives, so nothing overlaps. Keep the work, and wait in finish()")
    for s, calls in enumerate(per_step):
        sent = sum(c["values"] for c in calls)
        if sent > values and sent != values + r["unused_values"]:
            return wrong(f"in step {s + 1}, {sent} gradient values were all-reduced for {values} that have a gradient: "
                         "a bucket was launched twice. Start a new, empty bucket after each launch, launch only the "
                         "rest in finish(), and forget the launched buckets once finish() has waited for them")
        if sent < values:
            return wrong(f"in step {s + 1}, only {sent} of the {values} gradient values were all-reduced: the last, "
                         "partly filled bucket must be launched in finish(), and no bucket may wait for a parameter "
                         "that never gets a gradient (this model has one, `unused`)")
        if len(calls) == len(ready) and len(ready) != buckets:
            return wrong(f"one all-reduce per parameter ({len(calls)}): that is the previous exercise. Gather the "
                         "gradients in a bucket until it holds bucket_cap_bytes, then send the bucket as one tensor")
        if len(calls) != buckets:
            return wrong(f"in step {s + 1}, {len(calls)} all-reduces for {buckets} buckets: add each ready gradient "
                         "to the bucket; as soon as the bucket holds at least bucket_cap_bytes, launch it and start a "
                         "new one; launch the rest in finish()")
    if any(res["unwaited"] for res in results):
        return wrong(f"{max(res['unwaited'] for res in results)} launched all-reduces were never waited for: call "
                     ".wait() on each bucket's work in finish() before copying its values back")
    got = [res["steps"][s]["got"] for res in results for s in range(STEPS)]
    if all(_all_equal(g, [e * world for e in r["expected"]]) for g in got):
        return wrong("the gradients are 2 times too large on 2 ranks: all_reduce sums, so divide by the world size")
    if not all(_all_equal(g, r["expected"]) for g in got):
        return wrong("after finish() the gradients differ from one process on the global batch: copy each bucket's "
                     "slices back into the .grad of the parameter they came from, in the order you flattened them")
    return passed(f"{buckets} buckets of at least {BUCKET_CAP_BYTES} bytes (the last one partial), all-reduced as they "
                  f"filled, during backward; every rank holds the one-process gradient, in {STEPS} steps")
