"""course_lib.hardware: detection, backend choice and device mapping (GPU counts simulated where needed)."""
import pytest
import torch

from course_lib import hardware


def fake_gpus(monkeypatch, n, nccl=True):
    monkeypatch.setattr(hardware, "gpu_count", lambda: n)
    monkeypatch.setattr(hardware, "backends", lambda: {"gloo": True, "nccl": nccl, "mpi": False})


def test_detection_is_consistent():
    assert hardware.cpu_count() >= 1
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert hardware.gpu_count() == len(hardware.gpus()) == visible
    assert hardware.backends()["gloo"] is True
    v = hardware.versions()
    assert v["torch"] == torch.__version__ and v["python"].count(".") == 2
    text = hardware.summary()
    assert f"torch {torch.__version__}" in text and "CPU core" in text and "GPUs:" in text


@pytest.mark.parametrize("gpus, world_size, backend", [(0, 1, "gloo"), (0, 4, "gloo"), (1, 1, "nccl"),
                                                       (1, 2, "gloo"), (2, 2, "nccl"), (8, 4, "nccl")])
def test_default_backend_needs_a_gpu_per_rank(monkeypatch, gpus, world_size, backend):
    fake_gpus(monkeypatch, gpus)
    assert hardware.default_backend(world_size) == backend
    assert hardware.check_backend(None, world_size) == backend


def test_nccl_missing_from_the_build_falls_back_to_gloo(monkeypatch):
    fake_gpus(monkeypatch, 2, nccl=False)
    assert hardware.default_backend(2) == "gloo"
    with pytest.raises(ValueError, match="has no 'nccl' backend"):
        hardware.check_backend("nccl", 1)


def test_check_backend_errors_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        hardware.check_backend("tcp", 2)
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="needs CUDA GPUs and this machine has none"):
        hardware.check_backend("nccl", 1)
    fake_gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"4 ranks on this machine and it has 2 GPUs.*backend='gloo'"):
        hardware.check_backend("NCCL", 4)
    assert hardware.check_backend("Gloo", 4) == "gloo"


def test_device_for_rank_uses_the_local_rank(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert hardware.device_for_rank(3) == torch.device("cpu")
    fake_gpus(monkeypatch, 2)
    assert hardware.device_for_rank(1, "nccl") == torch.device("cuda", 1)
    assert hardware.device_for_rank(3, "gloo") == torch.device("cuda", 1)  # shared round-robin
    with pytest.raises(ValueError, match="no GPU of its own"):
        hardware.device_for_rank(2, "nccl")


def test_map_device_prints_what_it_changed(monkeypatch, capsys):
    fake_gpus(monkeypatch, 0)
    assert hardware.map_device("cuda:1") == torch.device("cpu")
    assert "cuda:1 -> cpu (no GPU on this machine)" in capsys.readouterr().out
    assert hardware.map_device("cpu") == torch.device("cpu")
    assert capsys.readouterr().out == ""
    fake_gpus(monkeypatch, 1)
    assert hardware.map_device("cuda:1") == torch.device("cuda", 0)
    assert "cuda:1 -> cuda:0 (only 1 GPU here)" in capsys.readouterr().out
    assert hardware.map_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert hardware.map_device("cuda:3", verbose=False) == torch.device("cuda", 0)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bad", ["gpu:0", "cuda:x", "", 3.5])
def test_map_device_rejects_what_is_not_a_device(bad):
    with pytest.raises(ValueError, match="is not a device: use 'cpu', 'cuda' or 'cuda:N'"):
        hardware.map_device(bad)


def test_map_device_rejects_other_device_types():
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda:N'"):
        hardware.map_device("meta")


@pytest.mark.gpu
def test_real_gpus_are_described():
    g = hardware.gpus()[0]
    assert g.memory_gib > 1 and g.name and "cuda:0" in str(g)
    assert hardware.versions()["cuda"] is not None


def test_local_rank_comes_from_the_launcher_never_the_global_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert hardware.local_rank() == 1
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set"):
        hardware.local_rank()
