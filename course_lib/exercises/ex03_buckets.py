"""Notebook 03's third exercise: bucketed, overlapped gradient averaging (re-exported by :mod:`.ex03`).

Gradients go into the current bucket in the order they become ready; each full bucket is all-reduced asynchronously
as one tensor while backward goes on; ``finish()`` launches the last bucket, waits for all, divides and copies back.
The check counts the all-reduces and the values each one carries, in launch order, and watches every wait
(``work.wait()``, the work's future's ``wait()`` or ``value()``, ``torch.futures.wait_all``), on 2 and 3 ranks, so that
it can name the usual mistakes: waiting at once, buckets not filled in ready order, a bucket launched twice or left
over from the previous step, a parameter that never gets a gradient, a wrong divisor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import make_dataset
from ..models import make_mlp
from . import Feedback, passed, run_attempt, wrong


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


class _WatchedFuture(torch.futures.Future):
    """The future of a watched work: completes with it; ``wait()`` and ``value()`` count as waiting on the work."""

    def __init__(self, real, work):
        super().__init__()
        self._work = work
        real.then(self._forward)

    def _forward(self, real):
        try:
            self.set_result(real.value())
        except Exception as e:  # noqa: BLE001 (handed on to whoever waits)
            self.set_exception(e)

    def wait(self):
        self._work.waited()
        return super().wait()

    def value(self):
        self._work.waited()
        return super().value()


class _WatchedWork:
    """A work handle that records each wait on it: in which step, and whether backward was running."""

    def __init__(self, work, watch):
        self.work, self.watch, self.step, self.waits = work, watch, watch.step, []

    def waited(self):
        self.waits.append((self.watch.step, self.watch.backward))

    def wait(self, *args, **kwargs):
        self.waited()
        return self.work.wait(*args, **kwargs)

    def get_future(self):
        return _WatchedFuture(self.work.get_future(), self)

    def __getattr__(self, name):
        return getattr(self.work, name)


class WaitWatch:
    """While active, ``dist.all_reduce`` is recorded (values, async or not, step, during backward or not) and each
    asynchronous work is watched; ``torch.futures.wait_all`` on watched futures counts as waiting on their works.
    The trial sets ``step`` and ``backward``."""

    def __init__(self):
        self.step, self.backward, self.calls, self.works = 0, False, [], []

    def __enter__(self):
        self._all_reduce, self._wait_all = dist.all_reduce, torch.futures.wait_all

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            self.calls.append({"backward": self.backward, "async": async_op, "values": tensor.numel(),
                               "step": self.step})
            work = self._all_reduce(tensor, *args, async_op=async_op, **kwargs)
            if async_op:
                self.works.append(_WatchedWork(work, self))
                return self.works[-1]
            return work

        def wait_all(futures):
            for f in futures:
                if isinstance(f, _WatchedFuture):
                    f._work.waited()
            return self._wait_all(futures)
        dist.all_reduce, torch.futures.wait_all = all_reduce, wait_all
        return self

    def __exit__(self, *exc):
        dist.all_reduce, torch.futures.wait_all = self._all_reduce, self._wait_all

    def summary(self) -> dict:
        waits = [w for work in self.works for w in work.waits]
        return {"calls": self.calls, "waits_in_backward": sum(b for _, b in waits),
                "unwaited": sum(not work.waits for work in self.works),
                "stale_waits": sum(step != work.step for work in self.works for step, _ in work.waits)}


BUCKET_CAP_BYTES = 8 * 2**10     # the check's model then fills 3 buckets, the last one only partly
STEPS = 2                        # two backward passes on two batches: a bucket left over from step 1 shows in step 2


def _none_hint(watch) -> str:
    """Which parameter's ``.grad`` was ``None`` when the learner's code failed, from when it failed."""
    if not watch.backward:
        return ("one parameter (`unused`) never gets a gradient: its .grad stays None and its hook never fires. "
                "Work only with the parameters your hooks received.")
    if watch.step > 0:
        return (f"a used parameter's .grad was None while backward ran in step {watch.step + 1}: a bucket left over "
                "from the previous step still holds parameters whose new gradients do not exist yet (zero_grad set "
                "them to None). Start a new, empty bucket after each launch and at the end of finish().")
    return ("a used parameter's .grad was None while backward ran: a hook from register_hook runs before .grad is "
            "set. Use p.register_post_accumulate_grad_hook: it runs after .grad is set, and receives the parameter.")


def bucket_trial(rank, world_size, fn):
    """Worker: two steps, on two batches, of the learner's bucketed averaging on an MLP with one parameter that never
    gets a gradient. Records the sizes of the gradients in the order they became ready, every all-reduce (how many
    values, whether async, during backward or not, in which step) and every wait."""
    import torch.nn as nn
    model = make_mlp(seed=0, depth=3)
    model.register_parameter("unused", nn.Parameter(torch.zeros(4, 64)))    # registered, never used in forward
    x_all, y_all = make_dataset(32 * world_size * STEPS, seed=7).tensors
    one_process, expected = make_mlp(seed=0, depth=3), []                   # the truth: one process, global batch
    batches = [(x_all[s::STEPS], y_all[s::STEPS]) for s in range(STEPS)]
    for x, y in batches:
        one_process.zero_grad()
        F.cross_entropy(one_process(x), y).backward()
        expected.append([p.grad.clone() for p in one_process.parameters()])
    ready = []
    for p in model.parameters():                                              # registered first: runs first
        p.register_post_accumulate_grad_hook(lambda p: ready.append(p.numel() * p.element_size()))
    steps = []
    with WaitWatch() as watch:
        try:
            finish = fn(model, BUCKET_CAP_BYTES)
            for step, (x, y) in enumerate(batches):
                watch.step = step
                model.zero_grad()
                ready.clear()
                watch.backward = True
                F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
                watch.backward = False
                if not callable(finish):
                    raise TypeError(f"your function must return `finish` (a function), got {finish!r}")
                finish()
                steps.append({"got": [p.grad.clone() for n, p in model.named_parameters() if n != "unused"],
                              "ready": list(ready), "unused_grad": model.unused.grad is not None})
        except (AttributeError, TypeError) as e:
            if "NoneType" not in str(e):
                raise
            raise type(e)(f"{e}\nHint: {_none_hint(watch)}") from None
    return {"expected": expected, "steps": steps, **watch.summary(), "unused_values": model.unused.numel()}


def _expected_buckets(ready_bytes: list[int], cap: int) -> list[int]:
    """The values each bucket carries when the gradients fill buckets in the order they became ready."""
    buckets, size = [], 0
    for b in ready_bytes:
        size += b
        if size >= cap:
            buckets, size = buckets + [size // 4], 0
    return buckets + ([size // 4] if size else [])


def check_bucketed_averaging(fn):
    """``fn(model, bucket_cap_bytes)`` registers hooks and returns ``finish``; after each backward, ``finish()``
    must leave every rank with the gradient of one process on the global batch, on 2 and 3 ranks. Buckets fill in
    the order the gradients become ready, each is all-reduced asynchronously as soon as it holds
    ``bucket_cap_bytes``, once, and is waited for in ``finish()`` of the same step."""
    for world in (2, 3):
        feedback, buckets = _check_buckets_on(fn, world)
        if feedback is not None:
            return feedback
    return passed(f"{buckets} buckets of at least {BUCKET_CAP_BYTES} bytes (the last one partial), filled in the order "
                  f"the gradients became ready and all-reduced as they filled, during backward; every rank holds the "
                  f"one-process gradient, in {STEPS} steps, on 2 and 3 ranks")


def _check_buckets_on(fn, world: int):
    """``(feedback, None)`` for a wrong answer on ``world`` ranks, ``(None, number of buckets)`` for a right one."""
    feedback = _bucket_feedback(fn, world)
    return (feedback, None) if isinstance(feedback, Feedback) else (None, feedback)


def _bucket_feedback(fn, world: int):
    results, feedback = run_attempt(bucket_trial, world, fn, timeout=20)
    if feedback is not None:
        return feedback
    r = results[0]
    ready = r["steps"][0]["ready"]
    values = sum(ready) // 4
    sizes = _expected_buckets(ready, BUCKET_CAP_BYTES)
    in_backward = [c for c in r["calls"] if c["backward"]]
    per_step = [[c for c in r["calls"] if c["step"] == s] for s in range(STEPS)]
    if not in_backward:
        return wrong("no all-reduce started during backward(): launch each bucket from the hook that fills it, "
                     "not in finish() (then nothing overlaps)")
    if not all(c["async"] for c in r["calls"]):
        return wrong("an all-reduce blocks (async_op=False): backward waits for each bucket, so nothing overlaps. "
                     "Launch with async_op=True and wait in finish()")
    if any(res["waits_in_backward"] for res in results):
        return wrong("you wait for a bucket's all-reduce during backward, right after launching it (waiting at once): "
                     "backward stands still until the sum arrives, so nothing overlaps. Keep the work, and wait in "
                     "finish()")
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
        if len(calls) == len(ready) and len(ready) != len(sizes):
            return wrong(f"one all-reduce per parameter ({len(calls)}): that is the previous exercise. Gather the "
                         "gradients in a bucket until it holds bucket_cap_bytes, then send the bucket as one tensor")
        if len(calls) != len(sizes):
            return wrong(f"in step {s + 1}, {len(calls)} all-reduces for {len(sizes)} buckets: add each ready gradient "
                         "to the bucket; as soon as the bucket holds at least bucket_cap_bytes, launch it and start a "
                         "new one; launch the rest in finish()")
        got_sizes = [c["values"] for c in calls]
        if got_sizes not in (sizes, sizes[:-1] + [sizes[-1] + r["unused_values"]]):
            return wrong(f"in step {s + 1}, the all-reduces carried {got_sizes} values, in launch order; buckets "
                         f"filled in the order the gradients became ready carry {sizes}. Fill the bucket from the "
                         "hooks, as each gradient arrives, not from a list of parameters fixed in advance (such as "
                         "model.parameters(), in registration order)")
    if any(res["unwaited"] for res in results):
        return wrong(f"{max(res['unwaited'] for res in results)} launched all-reduces were never waited for: call "
                     ".wait() on each bucket's work in finish() before copying its values back")
    if any(res["stale_waits"] for res in results):
        return wrong("in step 2, finish() waited again for buckets launched in step 1: the list of launched buckets "
                     "still holds the previous step's. Clear it once finish() has waited for them and copied back")
    got = [[res["steps"][s]["got"] for s in range(STEPS)] for res in results]
    if all(_all_equal(g[s], [e * world for e in r["expected"][s]]) for g in got for s in range(STEPS)):
        return wrong(f"the gradients are {world} times too large on {world} ranks: all_reduce sums, so divide by the "
                     "world size, dist.get_world_size()")
    if not all(_all_equal(g[s], r["expected"][s]) for g in got for s in range(STEPS)):
        return wrong(f"on {world} ranks, after finish() the gradients differ from one process on the global batch: "
                     "divide by dist.get_world_size(), and copy each bucket's slices back into the .grad of the "
                     "parameter they came from, in the order you flattened them")
    return len(sizes)
