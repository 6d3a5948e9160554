"""Model parallelism in one process: a model's layers split across devices, activations moved between them.

:func:`split_model` cuts an ``nn.Sequential`` at the given layer indices and puts each part on a device
(``cuda:0``, ``cuda:1``...; devices that do not exist here are mapped onto ones that do, and the mapping
is printed).  ``forward`` moves the activations from one part's device to the next: the whole trick.

Split naively, only one device works at a time.  :class:`PipelinedSplit` cuts the batch into
micro-batches so that, on real separate GPUs, part 1 can work on micro-batch i while part 0 already
computes micro-batch i+1 (CUDA kernels are launched asynchronously).  On one device, or on a CPU, the
micro-batches run one after another and nothing overlaps: the timeline shows it, and the notebook
claims no speed-up it did not measure.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from ..hardware import map_device, synchronize


class SplitModel(nn.Module):
    """An ``nn.Sequential`` cut into parts, each on its own device."""

    def __init__(self, parts: list[nn.Sequential], devices: list[torch.device]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.devices = devices
        self._timeline: list[tuple[int, int, float, float]] = []   # (part, micro-batch, start, end)
        self._pending: list[tuple[int, int, object, object]] = []
        self._clock: tuple[float, dict] | None = None

    @property
    def timeline(self) -> list[tuple[int, int, float, float]]:
        """``(part, micro-batch, start, end)`` of every recorded part, in seconds (``time.perf_counter``)."""
        self._finish_recording()
        return self._timeline

    def forward(self, x: torch.Tensor, micro_batch: int = 0, record: bool = False) -> torch.Tensor:
        if record and self._clock is None:
            self._start_recording()
        for k, (part, device) in enumerate(zip(self.parts, self.devices)):
            x = x.to(device, non_blocking=True)      # the activation crosses to the next device
            start = self._mark(device) if record else None
            x = part(x)
            if record:
                self._pending.append((k, micro_batch, start, self._mark(device)))
        return x

    # On a GPU a part's kernels run after forward() has returned: its times are taken by CUDA events in the
    # device's stream, not by synchronising (which would stop the next part from overlapping this one).
    # Each GPU's events are timed from a reference event recorded when recording starts, with all devices
    # idle; the references are taken back to back, so the GPUs' clocks agree to ~10 microseconds.
    def _cuda_devices(self) -> list[torch.device]:
        return sorted({d for d in self.devices if d.type == "cuda"}, key=str)

    def _start_recording(self) -> None:
        for d in self._cuda_devices():
            torch.cuda.synchronize(d)
        refs = {d: self._mark(d) for d in self._cuda_devices()}
        self._clock = (time.perf_counter(), refs)

    @staticmethod
    def _mark(device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def _finish_recording(self) -> None:
        if self._clock is None:
            return
        for d in self._cuda_devices():
            torch.cuda.synchronize(d)
        t0, refs = self._clock
        device_of = dict(enumerate(self.devices))

        def seconds(mark, device):
            return mark if device.type != "cuda" else t0 + refs[device].elapsed_time(mark) / 1e3

        for k, i, start, end in self._pending:
            self._timeline.append((k, i, seconds(start, device_of[k]), seconds(end, device_of[k])))
        self._pending, self._clock = [], None


def split_model(model: nn.Sequential, split_points: list[int], devices: list[str] | None = None,
                verbose: bool = True) -> SplitModel:
    """Cut ``model`` before each index in ``split_points``; part k goes to ``devices[k]``.

    ``split_model(m, [2])`` gives layers ``[0, 2)`` and ``[2, len(m))``.  Raises ``ValueError`` for a split
    point outside the model, points not increasing, more parts than layers, or a device that is no device.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError("split_model cuts an nn.Sequential; wrap your layers in one")
    n = len(model)
    points = list(split_points)
    if len(points) + 1 > n:
        raise ValueError(f"{len(points) + 1} parts asked for, but the model has only {n} layers")
    if any(not 0 < p < n for p in points):
        raise ValueError(f"split points must be between 1 and {n - 1} (the model has {n} layers), got {points}")
    if points != sorted(set(points)):
        raise ValueError(f"split points must be strictly increasing, got {points}")
    devices = devices or [f"cuda:{k}" for k in range(len(points) + 1)]
    if len(devices) != len(points) + 1:
        raise ValueError(f"{len(points) + 1} parts need {len(points) + 1} devices, got {len(devices)}: {devices}")
    mapped = [map_device(d, verbose=verbose) for d in devices]
    bounds = [0, *points, n]
    parts = [nn.Sequential(*list(model)[a:b]).to(dev) for a, b, dev in zip(bounds, bounds[1:], mapped)]
    return SplitModel(parts, mapped)


class PipelinedSplit(nn.Module):
    """GPipe-style micro-batching over a :class:`SplitModel`, in one process."""

    def __init__(self, split: SplitModel, micro_batches: int):
        super().__init__()
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        self.split, self.micro_batches = split, micro_batches

    def forward(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        # issue every micro-batch's forward; with separate GPUs the parts overlap, on one device they queue
        outs = [self.split(mb, micro_batch=i, record=record) for i, mb in enumerate(x.tensor_split(self.micro_batches))]
        return torch.cat(outs)


def timed_forward(piped: PipelinedSplit, x: torch.Tensor) -> dict:
    """One forward of ``piped`` (after a warm-up one), without autograd, recorded and timed.

    Returns ``timeline`` (per part, ``("F", micro_batch, start, end)`` in seconds from the first part's start, the
    format :func:`course_lib.viz.draw_pipeline` draws), ``wall`` (seconds until every device is done) and
    ``issued`` (seconds the host took to *issue* the work). On a CPU an op runs when it is called, so
    ``issued`` is ``wall``; on a GPU a call only queues kernels, so the host is done long before the GPU when
    each kernel's work is well above the cost of launching it: the Python loop runs ahead.
    """
    devices = list(dict.fromkeys(piped.split.devices))
    with torch.no_grad():
        piped(x)                                              # warm-up: CUDA contexts, cuBLAS handles, caches
        for d in devices:
            synchronize(d)
        piped.split.timeline.clear()
        t0 = time.perf_counter()
        piped(x, record=True)
        issued = time.perf_counter() - t0
        for d in devices:
            synchronize(d)
        wall = time.perf_counter() - t0
    recorded = piped.split.timeline
    first = min(start for _, _, start, _ in recorded)
    parts = len(piped.split.parts)
    timeline = [[("F", i, s - first, e - first) for k, i, s, e in recorded if k == part] for part in range(parts)]
    return {"timeline": timeline, "wall": wall, "issued": issued}


def overlapped(timeline: list[list[tuple]]) -> bool:
    """Whether two parts ever computed at the same time (in a :func:`timed_forward` timeline)."""
    return any(a[2] < b[3] and b[2] < a[3] for p, q in zip(timeline, timeline[1:]) for a in p for b in q)


def same_outputs_and_grads(reference: nn.Module, candidate: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           atol: float = 1e-5) -> bool:
    """True when ``candidate`` (a split or pipelined copy of ``reference``) gives the same outputs and grads."""
    out_r = reference(x)
    out_c = candidate(x)
    ok = torch.allclose(out_r, out_c.to(out_r.device), atol=atol)
    nn.functional.mse_loss(out_r, y).backward()
    nn.functional.mse_loss(out_c, y.to(out_c.device)).backward()
    for p, q in zip(reference.parameters(), candidate.parameters()):
        ok &= torch.allclose(p.grad, q.grad.to(p.device), atol=atol)
    return bool(ok)
