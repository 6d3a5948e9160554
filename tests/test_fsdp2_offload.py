"""FSDP2 with CPUOffloadPolicy (notebook 10's optional section): the bytes per GPU match the hand count; on 2 Gloo
ranks (a CPU mesh, pin_memory=False) the policy is applied and training is unchanged; on GPUs the shards,
gradients and optimizer states live on the CPU and the GPU holds less between steps."""
import functools

import pytest
import torch

from course_lib.launch import RankError, run
from course_lib.zero import fsdp2, fsdp2_offload, measure

MODEL = functools.partial(measure.deep_mlp, 64, 4)


def test_offload_bytes_match_the_hand_count_for_a_7b_model_on_8_gpus():
    b = fsdp2_offload.offload_bytes(7_000_000_000, 8, 32)          # fp32 weights and gradients, Adam, 32 units
    unit = 7e9 / 32
    assert b["host, CPU offload"] == 7e9 / 8 * (4 + 4 + 8) == 14e9
    assert b["GPU, CPU offload"] == 2 * unit * 4 + unit * 4 == 2.625e9
    assert b["GPU, no offload"] == b["host, CPU offload"] + b["GPU, CPU offload"]
    assert b["host-device bytes per step"] == 7e9 / 8 * (2 * 4 + 4)
    assert fsdp2_offload.offload_bytes(7_000_000_000, 8, 32, param_bytes=2)["GPU, CPU offload"] == unit * (2 * 2 + 4)


def test_on_a_cpu_mesh_the_policy_is_applied_and_training_is_unchanged(no_leftovers):
    for result in run(fsdp2_offload.offload_worker, 2, MODEL, 64, backend="gloo", show_output=False):
        assert result["CPU offload"]["offloaded by the policy"] == {True}
        assert result["no offload"]["offloaded by the policy"] == {False}
        for key in ("sharded parameters", "gradients", "optimizer states"):
            assert result["CPU offload"][key] == {"cpu"}, key
        assert result["difference"] == 0.0                           # the same arithmetic on the same CPU
        assert result["CPU offload"]["moved"] > 1e-3                 # ... and it really trained


def _pinned_worker(rank, world_size):
    fsdp2.apply_fsdp2(MODEL(), offload_policy=fsdp2_offload.cpu_offload_policy())      # pin_memory=True


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU: pinning works")
def test_the_default_pinned_policy_needs_an_accelerator(no_leftovers):
    with pytest.raises(RankError, match="accelerator"):
        run(_pinned_worker, 2, backend="gloo", show_output=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_shards_gradients_and_states_live_on_the_cpu(no_leftovers):
    n = min(2, torch.cuda.device_count())
    for result in run(fsdp2_offload.offload_worker, n, MODEL, 64, backend="nccl", show_output=False):
        off, on = result["CPU offload"], result["no offload"]
        assert off["offloaded by the policy"] == {True}
        assert off["sharded parameters"] == off["gradients"] == off["optimizer states"] == {"cpu"}
        assert on["sharded parameters"] == on["optimizer states"] == {"cuda"}
        assert off["GPU bytes between steps"] < on["GPU bytes between steps"]
        assert result["difference"] < 1e-5 < 1e-3 < off["moved"]      # Adam on the CPU against Adam on the GPU
