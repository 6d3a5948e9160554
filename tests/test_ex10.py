"""Notebook 10's exercise check: passes the reference FSDP2 wrapping, says 'not attempted yet' for the stub, and
names each usual mistake with its own message (each wrong answer below is what a learner might write)."""
import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex10

POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def stub(model, mesh):
    raise NotImplementedError


def only_root(model, mesh):
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))


def no_root(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))
    return model


def per_linear(model, mesh):
    for block in model.blocks:
        for layer in (block.up, block.down):
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))


def keep_after_forward(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(**POLICY))
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))


def no_policy(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def bf16_reduce(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def root_first(model, mesh):
    policy = MixedPrecisionPolicy(**POLICY)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return model


def forgets_return(model, mesh):
    ex10.reference(model, mesh)


def uses_the_library(model, mesh):
    from course_lib.zero import fsdp2
    return fsdp2.apply_fsdp2(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def root_resharded(model, mesh):
    policy = MixedPrecisionPolicy(**POLICY)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)


def policy_on_blocks_only(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))
    return fully_shard(model, mesh=mesh)


def policy_on_root_only(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**POLICY))


def bf16_masters(model, mesh):
    return ex10.reference(model.to(torch.bfloat16), mesh)


def head_unit(model, mesh):
    policy = MixedPrecisionPolicy(**POLICY)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model.head, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def test_reference_passes_and_stub_is_not_attempted():
    assert ex10.check_fsdp_wrapping(ex10.reference).status == PASSED
    assert ex10.check_fsdp_wrapping(stub).status == NOT_ATTEMPTED


@pytest.mark.parametrize("fn, words", [
    (only_root, "only the root is a unit"),
    (no_root, "the root was not wrapped"),
    (per_linear, "one unit per Linear"),
    (keep_after_forward, "reshard_after_forward=False"),
    (no_policy, "compute in torch.float32"),
    (bf16_reduce, "reduce_dtype defaults to param_dtype"),
    (root_first, "bottom-up: each block first"),
    (forgets_return, "returned a NoneType"),
    (uses_the_library, "switched off"),
    (root_resharded, "reshard_after_forward=True on the root"),
    (policy_on_blocks_only, "the same mp_policy=MixedPrecisionPolicy(...) to every fully_shard call"),
    (policy_on_root_only, "the same mp_policy=MixedPrecisionPolicy(...) to every fully_shard call"),
    (bf16_masters, "the shards are the master weights, keep them fp32"),
    (head_unit, "model.head is a unit of its own"),
])
def test_each_mistake_is_named(fn, words):
    feedback = ex10.check_fsdp_wrapping(fn)
    assert feedback.status == WRONG and words in feedback.message, feedback.message
