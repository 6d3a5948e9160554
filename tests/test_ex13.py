"""Notebook 13's exercise check: the reference passes, the stub is not attempted, known mistakes are named."""
from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex13


def stub(op_name):
    raise NotImplementedError


def test_the_reference_passes():
    fb = ex13.check_recompute_choice(ex13.keep_linear_layers)
    assert fb.status == PASSED and fb, fb
    assert ex13.check_recompute_choice(lambda op: op.endswith("mm") and op != "bmm").status == PASSED


def test_the_stub_is_not_attempted():
    fb = ex13.check_recompute_choice(stub)
    assert fb.status == NOT_ATTEMPTED and not fb and "not attempted yet" in repr(fb)


def test_known_wrong_answers_are_named():
    cases = {
        "no checkpointing at all": lambda op: True,                          # keep everything
        "keep bmm": lambda op: op in ("mm", "addmm", "bmm"),                 # the course's "selective": scores kept
        "keep no matrix product": lambda op: False,                          # whole-layer: too many FLOPs
        "k has no bias": lambda op: op == "addmm",                           # forgot the bias-free Linear
        "with a bias run as addmm": lambda op: op == "mm",
        "keep no matrix product (the": lambda op: op in ("matmul", "linear"),  # names not in the table
        "too much is kept": lambda op: op in ("mm", "addmm", "gelu", "clone"),
    }
    for phrase, keep in cases.items():
        fb = ex13.check_recompute_choice(keep)
        assert fb.status == WRONG and phrase in fb.message, (phrase, fb)


def test_bad_returns_are_explained():
    assert "pass your function itself" in ex13.check_recompute_choice(None).message
    assert "return True" in ex13.check_recompute_choice(lambda op: "mm").message
    assert "raised KeyError" in ex13.check_recompute_choice(lambda op: {}[op]).message


def test_the_table_the_learner_reads():
    ops = ex13.block_ops()
    assert {"mm", "addmm", "bmm", "_softmax", "gelu", "native_layer_norm"} <= set(ops)
    assert ops["bmm"]["flops"] > 0 and ops["gelu"]["flops"] == 0
