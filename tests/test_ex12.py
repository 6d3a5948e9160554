"""Notebook 12's exercise check: passes the reference block plan, says 'not attempted yet' for the stub, and names
each usual mistake with its own message (each wrong answer below is what a learner might write)."""
import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex12


def stub(sequence_parallel):
    raise NotImplementedError


def by_hand(sequence_parallel):
    """Right, written as a learner would."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=seq),
            "mlp.up": ColwiseParallel(input_layouts=seq), "mlp.down": RowwiseParallel(output_layouts=seq)}
    if sequence_parallel:
        plan["ln1"] = plan["ln2"] = SequenceParallel()
    return plan


def swapped(sequence_parallel):
    plan = by_hand(sequence_parallel)
    for k in ("attn.q", "attn.k", "attn.v", "mlp.up"):
        plan[k] = RowwiseParallel()
    plan["attn.out"] = plan["mlp.down"] = ColwiseParallel()
    return plan


def forgot_v(sequence_parallel):
    plan = by_hand(sequence_parallel)
    del plan["attn.v"]
    return plan


def misspelt(sequence_parallel):
    return {**by_hand(sequence_parallel), "attention.q": ColwiseParallel()}


def always_sp(sequence_parallel):
    return by_hand(True)


def no_prepare(sequence_parallel):
    plan = by_hand(sequence_parallel)
    del plan["attn"]
    return plan


def whole_output(sequence_parallel):
    plan = by_hand(sequence_parallel)
    plan["attn.out"] = plan["mlp.down"] = RowwiseParallel()
    return plan


def slice_as_whole(sequence_parallel):
    plan = by_hand(sequence_parallel)
    plan["mlp.up"] = ColwiseParallel()
    return plan


def no_sequence_norms(sequence_parallel):
    plan = by_hand(sequence_parallel)
    plan.pop("ln1", None)
    plan.pop("ln2", None)
    return plan


def test_the_reference_and_a_plan_by_hand_pass():
    assert ex12.check_block_plan(ex12.reference).status == PASSED
    assert ex12.check_block_plan(by_hand).status == PASSED


def test_the_stub_is_not_attempted_and_a_call_is_named():
    assert ex12.check_block_plan(stub).status == NOT_ATTEMPTED
    said = ex12.check_block_plan(by_hand(False))
    assert said.status == WRONG and "without calling it" in said.message


@pytest.mark.parametrize("fn, says", [
    (swapped, "swapped"),
    (forgot_v, "'attn.v' is not in your plan"),
    (misspelt, "no submodule 'attention.q'"),
    (always_sp, "sequence_parallel=False every rank holds the whole sequence"),
])
def test_mistakes_read_from_the_plan_are_named(fn, says):
    said = ex12.check_block_plan(fn)
    assert said.status == WRONG and says in said.message, said.message


@pytest.mark.parametrize("fn, says", [
    (no_prepare, "a PrepareModuleInput on 'attn' makes it one DTensor"),
    (whole_output, "output_layouts says Shard(1)"),
    (slice_as_whole, "desired_input_layouts saying what the module needs"),
    (no_sequence_norms, "SequenceParallel style on 'ln1' and 'ln2'"),
])
def test_mistakes_seen_when_run_are_named(fn, says):
    said = ex12.check_block_plan(fn)
    assert said.status == WRONG and says in said.message, said.message


def attention_slice_as_whole(sequence_parallel):
    plan = by_hand(sequence_parallel)
    plan["attn"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return plan


def test_a_slice_declared_whole_is_named_by_its_extra_gathers():
    said = ex12.check_block_plan(attention_slice_as_whole)
    assert said.status == WRONG and "desired_input_layouts saying" in said.message, said.message
    assert "gathered again" in said.message


def test_no_hint_prints_the_answer_as_code():
    for hint in (ex12.SP_INPUT, ex12.WHOLE_OUT):
        assert "(input_layouts=" not in hint and "(output_layouts=" not in hint, hint


def test_the_parameter_may_have_any_name():
    def plan(sp):   # not called "sequence_parallel": the check passes it positionally
        return by_hand(sp)
    assert ex12.check_block_plan(plan).status == PASSED


def test_a_function_of_no_argument_is_named():
    said = ex12.check_block_plan(lambda: by_hand(True))
    assert said.status == WRONG and "with one argument" in said.message, said.message


def test_prepare_module_input_with_output_layouts_is_named():
    def plan(sequence_parallel):
        p = by_hand(sequence_parallel)
        p["attn"] = PrepareModuleInput(input_layouts=(Replicate(),), output_layouts=(Replicate(),))
        return p
    said = ex12.check_block_plan(plan)
    assert said.status == WRONG and "desired_input_layouts" in said.message and "TypeError" in said.message
