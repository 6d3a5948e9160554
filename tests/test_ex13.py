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
        "holds more than no checkpointing": lambda op: True,                 # keep everything
        "keep bmm": lambda op: op in ("mm", "addmm", "bmm"),                 # the course's "selective": scores kept
        "keep no matrix product": lambda op: False,                          # whole-layer: too many FLOPs
        "k has no bias": lambda op: op == "addmm",                           # forgot the bias-free Linear
        "with a bias run as addmm": lambda op: op == "mm",
        "keep no matrix product (the": lambda op: op in ("matmul", "linear"),  # names not in the table
        "too much is kept": lambda op: op in ("mm", "addmm", "gelu", "clone"),
        "native_layer_norm (0.52 MiB": lambda op: op in ("mm", "addmm", "native_layer_norm"),   # 39.7%: now over
        "without `aten.`": lambda op: op in ("aten.mm", "aten.addmm"),       # names as printed by the profiler
        "residual sum after attention": lambda op: op in ("mm", "addmm", "add"),   # 37%: add is only partly free
    }
    for phrase, keep in cases.items():
        fb = ex13.check_recompute_choice(keep)
        assert fb.status == WRONG and phrase in fb.message, (phrase, fb)


CORE = ("bmm", "_softmax", "masked_fill", "div")


def test_kept_views_are_blamed_not_the_linear_products():
    """Everything but the attention core keeps views of the scores (166% of no checkpointing's bytes); with div and
    masked_fill kept too, 262%. The message ranks by bytes kept alive, names the views, never blames addmm."""
    for keep, s2 in ((lambda op: op not in CORE, False), (lambda op: op not in ("bmm", "_softmax"), True)):
        fb = ex13.check_recompute_choice(keep)
        assert fb.status == WRONG and ("held 1" in fb.message or "held 2" in fb.message), fb
        ranked = fb.message.split("keeps alive: ")[1].split(". A view")[0]
        assert ranked.startswith("view (") and "_unsafe_view" in ranked and "expand" in ranked, fb
        assert "addmm (" not in fb.message and "a view" in ranked and "makes no new memory" in fb.message
        assert ("an s² tensor" in ranked) == s2, fb
    fb = ex13.check_recompute_choice(lambda op: op not in CORE + ex13.VIEWS)       # views recomputed: 68%
    assert fb.status == WRONG and "clone (" in fb.message and "makes no new memory" not in fb.message


def test_the_margins_are_wide():
    ref = ex13.measure(ex13.keep_linear_layers)
    assert ref["held_fraction"] < ex13.MEMORY_BUDGET - 0.02 and ref["recomputed_fraction"] < ex13.FLOPS_BUDGET - 0.02
    ln = ex13.measure(lambda op: op in ("mm", "addmm", "native_layer_norm"))
    assert ln["held_fraction"] > ex13.MEMORY_BUDGET + 0.03
    assert ex13.measure(lambda op: op == "addmm")["recomputed_fraction"] > ex13.FLOPS_BUDGET + 0.02


def test_bad_returns_are_explained():
    assert "pass your function itself" in ex13.check_recompute_choice(None).message
    assert "return True" in ex13.check_recompute_choice(lambda op: "mm").message
    assert "raised KeyError" in ex13.check_recompute_choice(lambda op: {}[op]).message


def test_the_table_the_learner_reads():
    ops = ex13.block_ops()
    assert {"mm", "addmm", "bmm", "_softmax", "gelu", "native_layer_norm"} <= set(ops)
    assert ops["bmm"]["flops"] > 0 and ops["gelu"]["flops"] == 0
    assert ops["view"]["new_bytes"] == 0 < ops["_softmax"]["new_bytes"] <= ops["view"]["kept_alive"]
    assert ops["view"]["note"] == ops["expand"]["note"] == "view" and ops["t"]["kept_alive"] == 0   # a weight's view
    assert ops["add"]["note"] == "partly held anyway" and ops["add"]["kept_alive"] == ops["add"]["new_bytes"] // 2
    assert all(ops[op]["kept_alive"] == ops[op]["new_bytes"] for op in ("addmm", "gelu", "div", "_softmax"))


def test_the_papers_selective_recomputation_is_named_and_fails_this_budget():
    """Korthikanti et al. recompute only the attention core and keep the rest: 68% here, so the message says that
    this budget also needs LayerNorm, GELU and the copies recomputed; the reference is not called the paper's."""
    fb = ex13.check_recompute_choice(lambda op: op not in CORE + ex13.VIEWS)
    assert fb.status == WRONG and "Korthikanti et al.'s selective recomputation" in fb.message, fb
    assert "LayerNorm, GELU and the copies" in fb.message and "held 6" in fb.message, fb
    fb = ex13.check_recompute_choice(lambda op: op in ("mm", "addmm", "gelu", "clone"))   # not the paper's scheme
    assert fb.status == WRONG and "Korthikanti" not in fb.message, fb


def test_a_view_of_bsh_tensors_is_not_blamed_on_the_scores():
    """Keeping transpose pins the head-split q, k, v (1 MiB a block), not an s² tensor: the hint says so."""
    fb = ex13.check_recompute_choice(lambda op: op in ("mm", "addmm", "transpose"))
    assert fb.status == WRONG and "makes no new memory" in fb.message, fb
    assert "the scores and the softmax output" not in fb.message and "head-split q, k, v" in fb.message, fb
    fb = ex13.check_recompute_choice(lambda op: op in ("mm", "addmm", "expand"))      # expand views the probabilities
    assert fb.status == WRONG and "here the scores and the softmax output" in fb.message, fb
