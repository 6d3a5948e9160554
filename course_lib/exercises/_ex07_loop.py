"""Notebook 07's second exercise, one stage's loop: the check's machinery (see :mod:`course_lib.exercises.ex07`).

``comm`` is a :class:`Link`: ``torch.distributed`` point-to-point with these added, so that a mistake is named,
not a hang or a silent wrong number:

* every wait gives up after :data:`WAIT` seconds and says which call it was stuck in; after each schedule the
  ranks gather their states on a group of their own (Gloo closes a connection whose wait timed out), so the
  check can say "rank 1 waited in recv(src=2); rank 2 finished without sending it";
* ``irecv`` fills its tensor with NaN until ``wait()`` returns (a tensor used before it arrived gives NaN
  gradients every time), and refuses a tensor that shares storage with another pending ``irecv`` (two messages
  into one buffer: each overwrites the other);
* an ``isend`` never waited for is named (its tensor may be freed or changed before the message has gone).

The stage is wrapped in an :class:`_Recorder`: each forward notes which micro-batch it ran (its input is matched
against the inputs the unsplit model gives that stage), a hook on its output notes when that micro-batch's
backward reached the stage. The sequence is compared with ``ops``: a loop that runs its own order (GPipe
always, the backwards at the end, the micro-batches reversed) gives the right gradients but is not the schedule.
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist
from torch import nn

from ..pipeline_parallel import make_batch, make_full_model, make_stage, schedule
from ..pipeline_parallel.stages import stage_step

STAGES, MICRO_BATCHES, BATCH, WIDTH, LAYERS = 3, 4, 8, 16, 2
WAIT = 10.0   # seconds a Link waits for a message before it says which call was stuck (busy machines: not 3)


class Stuck(RuntimeError):
    """A :class:`Link` call waited longer than its timeout: ``call`` is e.g. ``"send(dst=1)"``."""

    def __init__(self, rank: int, call: str, peer: int, why: str):
        super().__init__(f"rank {rank} waited {WAIT:g} s in {call} and nothing happened ({why})")
        self.call, self.peer = call, peer


class Mistake(RuntimeError):
    """A use of ``comm`` that the check names at once (two pending receives into one buffer)."""


class _Handle:
    def __init__(self, link, call, peer, work, inbox=None, tensor=None):
        self.link, self.call, self.peer, self.work, self.inbox, self.tensor = link, call, peer, work, inbox, tensor
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            try:
                self.work.wait(timeout=datetime.timedelta(seconds=WAIT))
            except RuntimeError as e:
                raise Stuck(self.link.rank, self.call, self.peer, str(e).splitlines()[0][-80:]) from None
            if self.inbox is not None:
                with torch.no_grad():             # only now does the received tensor hold the message
                    self.tensor.copy_(self.inbox)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class Link:
    """``torch.distributed``'s point-to-point calls for the learner's stage loop (see the module's docstring)."""

    def __init__(self, rank: int):
        self.rank, self.handles = rank, []

    def isend(self, tensor, dst: int):
        h = _Handle(self, f"a wait() on isend(dst={dst})", dst, dist.isend(tensor.detach().contiguous(), dst=dst))
        self.handles.append(h)
        return h

    def irecv(self, tensor, src: int):
        ptr = tensor.untyped_storage().data_ptr()
        clash = next((h for h in self.handles if h.inbox is not None and not h.done
                      and h.tensor.untyped_storage().data_ptr() == ptr), None)
        if clash is not None:
            raise Mistake(f"rank {self.rank} posted irecv(src={src}) into a tensor that a pending "
                          f"irecv(src={clash.peer}) also fills: give every pending receive its own buffer "
                          "(torch.empty_like(xs[i]) for each), or each message overwrites the other")
        inbox = torch.empty_like(tensor)
        tensor.fill_(float("nan"))         # until wait(): what a tensor read before it arrived holds here
        h = _Handle(self, f"a wait() on irecv(src={src})", src, dist.irecv(inbox, src=src), inbox, tensor)
        self.handles.append(h)
        return h

    def send(self, tensor, dst: int) -> None:
        h = self.isend(tensor, dst)
        h.call = f"send(dst={dst})"
        h.wait()

    def recv(self, tensor, src: int) -> int:
        h = self.irecv(tensor, src)
        h.call = f"recv(src={src})"
        h.wait()
        return src

    def unwaited_sends(self) -> list[int]:
        """The destinations of the isends whose handle was never waited for."""
        return [h.peer for h in self.handles if h.inbox is None and not h.done]

    def drain(self) -> None:
        """Wait for every message still on its way."""
        for h in self.handles:
            h.wait()


class _Recorder(nn.Module):
    """The learner's stage, noting each forward's micro-batch and when each one's backward reached it."""

    def __init__(self, stage: nn.Module, inputs: list[torch.Tensor]):
        super().__init__()
        self.stage, self.inputs, self.ops = stage, inputs, []

    def _which(self, x) -> int | None:
        x = x.detach()
        if x.shape != self.inputs[0].shape or not torch.isfinite(x).all():
            return None
        dist_ = [float((x - e).abs().max()) for e in self.inputs]
        i = min(range(len(dist_)), key=dist_.__getitem__)
        return i if dist_[i] < 1e-4 else None

    def forward(self, x):
        i = self._which(x)
        self.ops.append(("F", i))
        out = self.stage(x)
        if out.requires_grad:
            out.register_hook(lambda g, i=i: self.ops.append(("B", i)))
        return out


def reference_stage_loop(stage, ops, rank, world_size, xs, ys, comm):
    """The reference solution: the course library's :func:`~course_lib.pipeline_parallel.stage_step`."""
    stage_step(stage, ops, rank, world_size, xs, ys, comm=comm)


def _inputs(rank: int, xs) -> list[torch.Tensor]:
    """What stage ``rank`` receives for each micro-batch: the earlier stages of the unsplit model applied."""
    with torch.no_grad():
        out = [x.clone() for x in xs]
        for r in range(rank):
            before = make_stage(r, WIDTH, LAYERS)
            out = [before(x) for x in out]
    return out


def stage_loop_worker(rank: int, world_size: int, fn) -> dict:
    stage = make_stage(rank, WIDTH, LAYERS)
    x, y = make_batch(BATCH, WIDTH)
    xs, ys = x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)
    recorder = _Recorder(stage, _inputs(rank, xs))
    # The states go through a group of their own: Gloo closes a connection whose wait timed out, so the default
    # group's may be gone by the time the ranks compare notes.
    states_group = dist.new_group(backend="gloo")
    out = {}
    for kind in ("gpipe", "1f1b"):   # GPipe first: a loop that deadlocks in 1F1B has run GPipe by then
        stage.zero_grad(set_to_none=True)
        recorder.ops = []
        link = Link(rank)
        state = {"finished": True}
        try:
            fn(recorder, schedule(kind, world_size, MICRO_BATCHES)[rank], rank, world_size, xs, ys, link)
            unwaited = link.unwaited_sends()
            link.drain()
            if unwaited:
                state = {"mistake": f"rank {rank} never waited for its isend(dst={unwaited[0]}): an isend only "
                                    "starts a send; call wait() on its handle (at the latest at the end of the "
                                    "loop) before the tensor may change or be freed"}
        except Stuck as e:
            state = {"stuck": (e.call, e.peer)}
        except Mistake as e:
            state = {"mistake": str(e)}
        states = [None] * world_size
        dist.all_gather_object(states, state, group=states_group)     # every rank gets here, stuck or not
        out[kind] = {"states": states, "ops": list(recorder.ops),
                     "grads": [None if p.grad is None else p.grad.clone() for p in stage.parameters()]}
        if any("finished" not in s for s in states):
            return out                 # a message may be in flight: no second run
    return out


def full_grads() -> list[list[torch.Tensor]]:
    """Per stage, the gradients of the unsplit model for the whole batch's mean loss."""
    full = make_full_model(STAGES, WIDTH, LAYERS)
    x, y = make_batch(BATCH, WIDTH)
    torch.nn.functional.mse_loss(full(x), y).backward()
    params = list(full.parameters())
    per = len(params) // STAGES
    return [[p.grad for p in params[s * per:(s + 1) * per]] for s in range(STAGES)]


def _diagnose_stuck(states: list[dict], kind: str) -> str:
    stuck = {r: s["stuck"] for r, s in enumerate(states) if "stuck" in s}
    where = "; ".join(f"rank {r} in {call}" for r, (call, _) in sorted(stuck.items()))
    for r, (call, peer) in sorted(stuck.items()):
        other = stuck.get(peer)
        if call.startswith("send") and other and other[0].startswith("send") and other[1] == r:
            return (f"{kind} deadlocks: rank {r} is stuck in send(dst={peer}) and rank {peer} in send(dst={r}), "
                    f"each waiting {WAIT:g} s for the other to receive (stuck: {where}). A blocking send returns "
                    "only once its receiver takes the message, and these two neighbours both sent first (on Gloo; "
                    "NCCL may hang on the GPU stream instead). Send with isend (and wait for it at the end), or "
                    "post the receive first with irecv.")
    for r, (call, peer) in sorted(stuck.items()):
        if "finished" in states[peer]:
            what = "receiving" if "send" in call else "sending"
            return (f"{kind}: rank {r} waited {WAIT:g} s in {call}; rank {peer} finished its ops without "
                    f"{what} that message (stuck: {where}). Each F i sends its output to rank+1 and each B i its "
                    "input's gradient to rank-1, on every stage that has such a neighbour.")
    return (f"{kind} deadlocks: {where}, {WAIT:g} s each. Every receive needs a matching send on the other rank, "
            "and in the same order: stage s gets F i's input from stage s-1 and B i's gradient from stage s+1.")


def _diagnose_order(ran: list, ops: list, rank: int, kind: str) -> str | None:
    """What differs between the ops a stage ran (as recorded) and the ones it was given."""
    ops = [(op, int(i)) for op, i in ops]
    if ran == ops or any(i is None for _, i in ran):
        return None               # unidentified inputs: the gradient checks name what went wrong
    m = MICRO_BATCHES
    head = f"{kind}: stage {rank} ran {' '.join(f'{o}{i}' for o, i in ran)}; its ops were " \
           f"{' '.join(f'{o}{i}' for o, i in ops)}. "
    for op in "FB":
        for i in range(m):
            n = ran.count((op, i))
            if n != 1:
                return head + f"It ran {op}{i} {n} times: run each op of `ops` once, in its order."
    if kind != "gpipe" and ran == [(o, int(i)) for o, i in schedule("gpipe", STAGES, m)[rank]]:
        return head + "That is GPipe's order, whatever `ops` says: loop over `ops` and run each op in its turn."
    if [o for o, _ in ran] == ["F"] * m + ["B"] * m and [o for o, _ in ops] != [o for o, _ in ran]:
        return head + "It ran every forward first and the backwards at the end: run each backward when `ops` " \
                      "says, between the forwards."
    if [o for o, _ in ran] == [o for o, _ in ops] and [i for _, i in ran] == [m - 1 - i for _, i in ops]:
        return head + "It ran the micro-batches in reverse order: ('F', i) is micro-batch i, xs[i]."
    k = next(k for k, (a, b) in enumerate(zip(ran, ops)) if a != b)
    return head + f"Its op number {k} was {ran[k][0]}{ran[k][1]}, not {ops[k][0]}{ops[k][1]}: run `ops` in order."


def diagnose_stage_loop(results: list[dict], expected: list[list[torch.Tensor]]) -> str | None:
    """What is wrong with a stage loop's results (one dict per rank from the check's worker); ``None`` if nothing."""
    last = len(results) - 1
    for kind in ("gpipe", "1f1b"):
        states = results[0][kind]["states"]
        mistakes = [s["mistake"] for s in states if "mistake" in s]
        if mistakes:
            return f"{kind}: {mistakes[0]}"
        if any("stuck" in s for s in states):
            also = " (It ran GPipe: there all forwards flow one way, then all backwards the other; in 1F1B they " \
                   "cross.)" if kind == "1f1b" else ""
            return _diagnose_stuck(states, kind) + also
        grads = [res[kind]["grads"] for res in results]
        none = [r for r, g in enumerate(grads) if any(t is None for t in g)]
        if none:
            return (f"{kind}: stage {none[0]} has no gradients: each ('B', i) runs a backward, the last stage's "
                    "from the loss, the others' from the gradient that stage s+1 sends")
        nan = [r for r, g in enumerate(grads) if any(not torch.isfinite(t).all() for t in g)]
        if nan:
            if nan[-1] == last:
                return (f"{kind}: the loss is NaN: a stage ran a forward on its input before it arrived. irecv only "
                        "starts a receive: wait() on its handle before you use the tensor (this check fills it "
                        "with NaN until then; on a real machine it would hold garbage)")
            r = nan[-1]
            return (f"{kind}: stage {r}'s gradients are NaN, stage {r + 1}'s are right: stage {r} ran a backward "
                    f"before the gradient of its forward's output arrived from stage {r + 1}. wait() on the "
                    "irecv's handle before you use the tensor (this check fills it with NaN until then; on a real "
                    "machine it would hold garbage)")
        for r, res in enumerate(results):
            message = _diagnose_order(res[kind]["ops"], schedule(kind, len(results), MICRO_BATCHES)[r], r, kind)
            if message:
                return message
        ratios = [float((g * e).sum() / (e * e).sum()) for gs, es in zip(grads, expected) for g, e in zip(gs, es)]
        wrong_stages = [r for r, (gs, es) in enumerate(zip(grads, expected))
                        if not all(torch.allclose(g, e, atol=1e-6, rtol=1e-4) for g, e in zip(gs, es))]
        if not wrong_stages:
            continue
        c = ratios[0]
        if all(math.isclose(v, c, rel_tol=1e-3) for v in ratios) and all(
                torch.allclose(g, e * c, atol=1e-6, rtol=1e-4) for gs, es in zip(grads, expected)
                for g, e in zip(gs, es)):
            if math.isclose(c, MICRO_BATCHES, rel_tol=1e-3):
                return (f"{kind}: your gradients are {MICRO_BATCHES} = m times the whole model's: the loss of each "
                        "micro-batch was scaled by 1. F.mse_loss is the mean over the micro-batch; the batch's mean "
                        "is the mean of the m micro-batch means, so scale each one by 1/m")
            return f"{kind}: your gradients are {c:.3g} times the whole model's: scale each micro-batch's loss by 1/m"
        r = wrong_stages[-1]
        return (f"{kind}: stage {r}'s gradients differ from the unsplit model's"
                + (f" (stages after it are right: look at what stage {r} computes or receives)" if r < last else "")
                + ". Each stage runs the forward of its input and, for ('B', i), the backward of that same output")
    return None
