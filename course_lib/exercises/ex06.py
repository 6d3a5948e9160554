"""Notebook 06's exercise: split a model at given points, checked against the unsplit model.

The learner writes ``fn(model, points, devices)``: cut the ``nn.Sequential`` ``model`` before each index in
``points``, put part k on ``devices[k]``, and return something callable that runs the parts in order and
moves the activation to each part's device before it. The check compares the outputs and the gradients with
those of an unsplit copy, on several splits of an 8-layer model.

It also watches the run, to name a mistake rather than only report a difference: a forward pre-hook on each
of the model's layers notes which layer runs when, and a ``TorchFunctionMode`` (PyTorch's hook on every
tensor function) notes each ``Tensor.to``/``.cpu``/``.cuda``. The check runs on the CPU, so every "device" is
``"cpu"``: a forgotten move raises nothing here (on two GPUs it would raise "Expected all tensors to be on
the same device"), but the check sees that no move happened between the two parts. For the parts' placement it wraps
``nn.Module.to`` while the learner's function runs: each device it is handed is a distinct ``str`` ("cpu") that
knows its index k, so a part left where it was, or put on ``devices[0]`` instead of ``devices[k]``, is named
(a device the learner built anew, e.g. ``torch.device(devices[k])``, cannot be traced and is accepted).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..model_parallel import split_model
from ..models import mlp
from . import NOT_ATTEMPTED, Feedback, passed, wrong

CASES = ([4], [1], [2, 6], [3, 5, 7])     # split points of the 8-layer model
MOVES = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda)
NOT_MOVED = ("the activation was not moved to the next part's device: call x.to(device) before each part. On the "
             "CPU every device is 'cpu' and nothing fails, but on two GPUs PyTorch raises 'Expected all tensors to "
             "be on the same device'")


def reference_split(model: nn.Sequential, points: list[int], devices: list[str]) -> nn.Module:
    """The reference solution: the course library's :func:`~course_lib.model_parallel.split_model`."""
    return split_model(model, points, devices, verbose=False)


def make_model() -> nn.Sequential:
    """The model the check splits: 4 x (Linear(16, 16) + Tanh), 8 layers, all 16 wide (so that parts run in the
    wrong order still fit together, and only the numbers show it)."""
    return mlp([16] * 5, nn.Tanh, last_activation=True, seed=0)


class _Device(str):
    """``"cpu"``, knowing that it is ``devices[k]``."""

    def __new__(cls, name: str, k: int):
        obj = super().__new__(cls, name)
        obj.k = k
        return obj


@contextlib.contextmanager
def _watch_placement(moves: list):
    """Note each ``module.to(...)`` as ``(ids of its parameters, the device argument as passed)``."""
    original = nn.Module.to

    def to(self, *args, **kwargs):
        raw = next((a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))), None)
        moves.append(({id(p) for p in self.parameters()}, raw))
        return original(self, *args, **kwargs)
    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def _read_placement(moves: list, model: nn.Sequential, points: list[int]) -> str | None:
    """Whether part k's layers were moved to ``devices[k]``: a message naming the first that was not."""
    bounds = [0, *points, len(model)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for layer in list(model)[a:b]:
            ids = {id(p) for p in layer.parameters()}
            if not ids:
                continue
            last = next((raw for got, raw in reversed(moves) if ids & got), None)
            if last is None:
                return (f"part {k} (layers {a} to {b - 1}) was never put on its device: call .to(devices[{k}]) on "
                        "it. On the CPU nothing fails, but on GPUs the part would stay where the model was")
            if isinstance(last, _Device) and last.k != k:
                return (f"part {k} (layers {a} to {b - 1}) went to devices[{last.k}], not devices[{k}]: part k goes "
                        "on devices[k], or every part lands on one device and nothing is split")
            break
    return None


def _target(func, args, kwargs) -> torch.device | None:
    """The device a ``.to``/``.cpu``/``.cuda`` call moves to (``None`` for a change of dtype only)."""
    if func is torch.Tensor.cpu:
        return torch.device("cpu")
    if func is torch.Tensor.cuda:
        return torch.device("cuda", args[1] if len(args) > 1 and isinstance(args[1], int) else 0)
    for a in (*args[1:], (kwargs or {}).get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class _Watch(TorchFunctionMode):
    """Notes every move of a tensor to a device in ``events``."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in MOVES:
            target = _target(func, args, kwargs)
            if target is not None:
                self.events.append(("move", target))
        return func(*args, **(kwargs or {}))


def _read_run(events: list, n: int, points: list[int], devices: list[str]) -> str | None:
    """What the layer and move events of one forward say is wrong, or ``None``."""
    ran = [k for kind, k in events if kind == "layer"]
    missing = [k for k in range(n) if k not in ran]
    if missing:
        return (f"layer(s) {missing} never ran: an off-by-one at a split point? With points {points}, part k is "
                "model[points[k-1]:points[k]]: a slice stops before its end, and the next part starts there")
    twice = sorted({k for k in ran if ran.count(k) > 1})
    if twice:
        return (f"layer(s) {twice} ran twice: the parts overlap (an off-by-one at a split point?). With points "
                f"{points}, part k is model[points[k-1]:points[k]]; the next part starts at points[k]")
    if ran != sorted(ran):
        return (f"the layers ran in the order {ran}: the parts run in the wrong order. Run part 0 first (layers "
                f"0 to {points[0] - 1}), then part 1, ...")
    for k, p in enumerate(points, start=1):
        at = [e for e in events[events.index(("layer", p - 1)) + 1:events.index(("layer", p))] if e[0] == "move"]
        if not any(target == torch.device(devices[k]) for _, target in at):
            return f"at split point {p} (between layer {p - 1} and layer {p}) {NOT_MOVED}"
    return None


def _attempt(fn, points: list[int]) -> tuple[Feedback | None, dict]:
    """Split a fresh model with ``fn``, run it once under watch; ``(feedback, what happened)``."""
    model, devices = make_model(), [_Device("cpu", k) for k in range(len(points) + 1)]
    reference = copy.deepcopy(model)
    events: list = []
    for k, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda module, inputs, k=k: events.append(("layer", k)))
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    where = f"split at {points} onto {devices}"
    try:
        moves: list = []
        with _watch_placement(moves):
            split = fn(model, points, devices)
        if split is model:
            return wrong(f"{where}: your function returned the model itself: cut it into parts"), {}
        if not callable(split):
            return wrong(f"{where}: your function returned {type(split).__name__}, which cannot be called: return "
                         "the split model (e.g. an nn.Module whose forward runs the parts)"), {}
        with _Watch(events):
            out = split(x)
    except NotImplementedError:
        return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run this cell "
                                       "again"), {}
    except Exception as e:  # noqa: BLE001 (the learner's code: any error is feedback)
        hint = f"\nHint: {NOT_MOVED}" if "same device" in str(e) else ""
        return wrong(f"{where}: {type(e).__name__}: {e}{hint}"), {}
    if not isinstance(out, torch.Tensor):
        return wrong(f"{where}: calling the split model returned {type(out).__name__}, not a tensor"), {}
    return None, {"model": model, "reference": reference, "events": events, "out": out, "x": x, "y": y,
                  "devices": devices, "where": where,
                  "placement": _read_placement(moves, model, points)}


def check_split(fn) -> Feedback:
    """``fn(model, points, devices)`` must return a callable equal to the unsplit model, outputs and gradients,
    for every split in :data:`CASES`; the first mistake is named."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    for points in CASES:
        feedback, run = _attempt(fn, points)
        if feedback is not None:
            return feedback
        where, model, reference = run["where"], run["model"], run["reference"]
        message = _read_run(run["events"], len(model), points, run["devices"])
        if message:
            return wrong(f"{where}: {message}")
        expected = reference(run["x"])
        if run["out"].shape != expected.shape or not torch.allclose(run["out"], expected, atol=1e-6):
            return wrong(f"{where}: the output differs from the unsplit model's")
        nn.functional.mse_loss(run["out"], run["y"]).backward()
        nn.functional.mse_loss(expected, run["y"]).backward()
        grads = [p.grad for p in model.parameters()]
        if any(g is None for g in grads):
            return wrong(f"{where}: the output is right, but the model's own layers got no gradient: did you copy "
                         "them (copy.deepcopy)? Build the parts from the model's own layers: "
                         "nn.Sequential(*list(model)[a:b]).to(device) keeps the same parameter objects and moves "
                         "their data, so that training the split model trains the model")
        if not all(torch.allclose(g, r.grad, atol=1e-6) for g, r in zip(grads, reference.parameters())):
            return wrong(f"{where}: the output is right but the gradients differ from the unsplit model's")
        if run["placement"]:
            return wrong(f"{where}: {run['placement']}")
    return passed(f"outputs and gradients equal the unsplit model's for the splits {list(CASES)}, and the "
                  "activation moves to the next part's device at every split point; part k is on devices[k]")
