"""Split and pipelined models equal the unsplit model; bad splits are refused; memory arithmetic is exact."""
import copy

import pytest
import torch
import torch.nn as nn

from course_lib import memory
from course_lib.model_parallel import PipelinedSplit, overlapped, same_outputs_and_grads, split_model, timed_forward
from course_lib.models import mlp
from course_lib.viz.widgets import MemoryCalculator


def deep_mlp(layers=6, width=16, seed=0):
    return mlp([width] * (layers // 2 + 1), nn.Tanh, last_activation=True, seed=seed)


@pytest.mark.parametrize("points", [[1], [2], [4], [5], [2, 4], [1, 3, 5]])
def test_split_model_equals_the_unsplit_model(points, capsys):
    model = deep_mlp()
    x, y = torch.randn(10, 16), torch.randn(10, 16)
    split = split_model(copy.deepcopy(model), points, devices=["cpu"] * (len(points) + 1))
    assert same_outputs_and_grads(model, split, x, y)


@pytest.mark.parametrize("micro_batches, batch", [(1, 8), (2, 8), (3, 10), (4, 7), (7, 7)])
def test_pipelined_split_equals_the_unsplit_model(micro_batches, batch):
    model = deep_mlp()
    x, y = torch.randn(batch, 16), torch.randn(batch, 16)
    piped = PipelinedSplit(split_model(copy.deepcopy(model), [2, 4], devices=["cpu"] * 3), micro_batches)
    assert same_outputs_and_grads(model, piped, x, y)


def test_missing_devices_are_mapped_and_said(capsys):
    split = split_model(deep_mlp(), [3])          # asks for cuda:0 and cuda:1
    out = capsys.readouterr().out
    if torch.cuda.device_count() >= 2:
        assert split.devices == [torch.device("cuda", 0), torch.device("cuda", 1)] and out == ""
    elif torch.cuda.is_available():
        assert split.devices == [torch.device("cuda", 0)] * 2 and "cuda:1 -> cuda:0" in out
    else:
        assert split.devices == [torch.device("cpu")] * 2 and "cuda:0 -> cpu" in out and "cuda:1 -> cpu" in out


@pytest.mark.parametrize("points, devices, message", [
    ([0], None, "between 1 and 5"), ([6], None, "between 1 and 5"), ([3, 2], None, "strictly increasing"),
    ([1, 2, 3, 4, 5, 6], None, "7 parts asked for"), ([3], ["cpu"], "2 parts need 2 devices"),
    ([3], ["cpu", "gpu:1"], "is not a device")])
def test_bad_splits_are_refused_with_a_clear_error(points, devices, message):
    with pytest.raises(ValueError, match=message):
        split_model(deep_mlp(), points, devices)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_model(nn.Linear(2, 2), [1])
    with pytest.raises(ValueError, match="at least 1"):
        PipelinedSplit(split_model(deep_mlp(), [3], ["cpu", "cpu"]), 0)


def test_timeline_records_every_part_and_micro_batch():
    piped = PipelinedSplit(split_model(deep_mlp(), [2, 4], ["cpu"] * 3), 4)
    piped(torch.randn(8, 16), record=True)
    assert sorted((k, i) for k, i, _, _ in piped.split.timeline) == [(k, i) for k in range(3) for i in range(4)]
    assert all(end >= start for _, _, start, end in piped.split.timeline)


@pytest.mark.parametrize("opt, ctor, states", [("sgd", lambda p: torch.optim.SGD(p, lr=0.1), 0),
                                               ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
                                               ("adam", lambda p: torch.optim.Adam(p), 2)])
def test_calculator_equals_measured_bytes_on_cpu(opt, ctor, states):
    model = deep_mlp(layers=8, width=64)
    optimizer = ctor(model.parameters())
    nn.functional.mse_loss(model(torch.randn(4, 64)), torch.randn(4, 64)).backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    predicted = memory.training_memory(params, "fp32", opt)
    measured = memory.measured_state_bytes(model, optimizer)
    for part in ("weights", "gradients", "optimizer states"):
        assert predicted[part] == measured[part], part
    assert predicted["total"] == params * (8 + 4 * states)


def test_calculator_rules_and_errors():
    seven = memory.training_memory(7_000_000_000, "bf16", "adam")
    assert seven["total"] == 7e9 * (2 + 2 + 8 + 4)            # 16 bytes per parameter
    assert not memory.fits(seven, 80) and memory.fits(memory.training_memory(1_000_000_000, "bf16", "adam"), 80)
    assert memory.mlp_activation_bytes(2, [3, 5, 7]) == 2 * (3 + 2 * 5 + 7) * 4
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory.training_memory(1, "fp8")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        memory.training_memory(1, optimizer="lion")
    assert memory.human(3 * 2**30) == "3.0 GiB"


def test_memory_widget_driven_in_code():
    calc = MemoryCalculator(billions=7, dtype="bf16", optimizer="adam", device_gib=80)
    assert calc.state["fits"] is False
    calc.billions.value = 1
    assert calc.state["fits"] is True and "fits" in calc.out.value
    calc.optimizer.value = "sgd"
    assert calc.state["breakdown"]["optimizer states"] == 0


def test_memory_widget_keeps_the_number_typed_and_says_what_it_computed():
    calc = MemoryCalculator(billions=7, dtype="bf16", optimizer="adam", device_gib=80)
    assert calc.state["breakdown"] == memory.training_memory(7_000_000_000, "bf16", "adam")
    assert "7 B parameters, bf16, adam" in calc.out.value and "104.3 GiB" in calc.out.value
    calc.billions.value = 70.5                         # a text box: no slider step to round it
    assert calc.billions.value == 70.5 and calc.state["breakdown"]["total"] == 70_500_000_000 * 16
    bundle = calc._repr_mimebundle_()                  # what a saved notebook holds for the widget
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == calc.widget.model_id
    assert "run this cell" in bundle["text/plain"]


@pytest.mark.gpu
def test_timeline_on_a_gpu_comes_from_cuda_events_without_stopping_the_queue():
    model = mlp([512] * 5, nn.Tanh, last_activation=True, seed=0)
    split = split_model(model, [4], ["cuda:0", "cuda:1"], verbose=False)   # one GPU: both parts on cuda:0
    piped = PipelinedSplit(split, 4)
    x = torch.randn(256, 512, device=split.devices[0])
    with torch.no_grad():
        piped(x)
        split.timeline.clear()
        piped(x, record=True)
        assert split._pending and split._clock is not None          # nothing converted before it is read
        timeline = split.timeline
    assert sorted((k, i) for k, i, _, _ in timeline) == [(k, i) for k in range(2) for i in range(4)]
    assert all(end > start for _, _, start, end in timeline)
    if split.devices[0] == split.devices[1]:                          # one queue: parts strictly one after another
        spans = sorted((s, e) for _, _, s, e in timeline)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))


def test_timed_forward_on_the_cpu_runs_the_parts_one_after_another():
    piped = PipelinedSplit(split_model(deep_mlp(width=64), [2, 4], ["cpu"] * 3), 4)
    r = timed_forward(piped, torch.randn(64, 64))
    assert [[(op, i) for op, i, *_ in part] for part in r["timeline"]] == [[("F", i) for i in range(4)]] * 3
    assert min(start for part in r["timeline"] for _, _, start, _ in part) == 0
    assert not overlapped(r["timeline"])
    assert 0 < r["issued"] <= r["wall"] and r["wall"] - r["issued"] < 0.05   # a CPU has nothing left to do
    assert overlapped([[("F", 0, 0.0, 2.0)], [("F", 0, 1.0, 3.0)]])
    assert not overlapped([[("F", 0, 0.0, 1.0)], [("F", 0, 1.0, 2.0)]])


@pytest.mark.gpu
def test_on_a_gpu_the_host_issues_the_work_long_before_the_gpu_has_done_it():
    model = mlp([4096] * 5, nn.Tanh, last_activation=True, seed=0)   # a part: 2 products of 1024 x 4096 x 4096
    piped = PipelinedSplit(split_model(model, [4], ["cuda:0", "cuda:1"], verbose=False), 4)
    r = timed_forward(piped, torch.randn(4096, 4096, device=piped.split.devices[0]))
    assert r["issued"] < r["wall"] / 2                       # the Python loop ran ahead of the GPU(s)
    if piped.split.devices[0] == piped.split.devices[1]:    # one GPU: one queue, the parts cannot overlap
        assert not overlapped(r["timeline"])
