"""Notebook 13's exercise: choose what to recompute so that memory falls under a budget, cheaply.

The learner writes ``keep(op_name) -> bool``: for each operator the transformer's blocks run (``"mm"``,
``"addmm"``, ``"bmm"``, ``"_softmax"``, ``"gelu"``, ``"native_layer_norm"``...), whether selective
checkpointing keeps its output (``True``) or recomputes it in backward (``False``). The check runs the small
transformer at sequence length 256 (where the attention scores, ``b·a·s²`` per layer, are the biggest
activation) under that policy and measures:

* the bytes held between forward and backward: at most :data:`MEMORY_BUDGET` of no checkpointing's;
* the matrix-product FLOPs recomputed in backward: at most :data:`FLOPS_BUDGET` of the forward's;
* the gradients: identical to no checkpointing's.

Keeping nothing (whole-layer checkpointing) meets the memory budget but recomputes too much; keeping every
matrix product recomputes nothing but keeps the scores. The reference keeps the Linear layers' products.
"""
from __future__ import annotations

import functools

import torch

from ..memory.recompute import forward_ops, measure_policy
from ..models.transformer import Block, TransformerConfig, transformer
from . import NOT_ATTEMPTED, Feedback, passed, wrong

CFG = TransformerConfig(seq_len=256)
BATCH = 4
MEMORY_BUDGET = 0.40   # of the bytes no checkpointing holds
FLOPS_BUDGET = 0.42    # of the forward's matrix-product FLOPs, recomputed


def keep_linear_layers(op_name: str) -> bool:
    """Reference: keep the Linear layers' products (``addmm`` with a bias, ``mm`` without: ``k`` has none);
    recompute the attention (its ``bmm`` and softmax) and every cheap operator."""
    return op_name in ("mm", "addmm")


def block_ops() -> dict[str, dict]:
    """The operators one block runs at the check's sizes: calls, new bytes, FLOPs (the table the learner reads)."""
    x = torch.randn(BATCH, CFG.seq_len, CFG.dim, generator=torch.Generator().manual_seed(0))
    return forward_ops(Block(CFG), x)


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(CFG.vocab, (BATCH, CFG.seq_len), generator=g),
            torch.randint(CFG.vocab, (BATCH, CFG.seq_len), generator=g))


@functools.lru_cache(maxsize=1)
def _baseline() -> dict:
    """No checkpointing: measured once per process (every check compares with it)."""
    return measure_policy(transformer(CFG), "none", *_data())


def measure(keep) -> dict:
    """``keep``'s policy on the check's model: fraction of the bytes held and of the forward's FLOPs recomputed
    (as :func:`course_lib.memory.recompute.compare_policies` reports them), and whether the gradients are equal."""
    base, r = _baseline(), measure_policy(transformer(CFG), keep, *_data())
    return {"held_fraction": r["held"] / base["held"],
            "recomputed_fraction": (r["backward_flops"] - base["backward_flops"]) / base["forward_flops"],
            "grads_identical": all(torch.equal(a, b) for a, b in zip(r["grads"], base["grads"]))}


def _ask(keep, ops) -> tuple[dict | None, Feedback | None]:
    """``keep``'s answer for every operator name, or the feedback that says why there is none."""
    if not callable(keep):
        return None, wrong(f"pass your function itself (without calling it), got {keep!r}")
    answers = {}
    for op in ops:
        try:
            answer = keep(op)
        except NotImplementedError:
            return None, Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then run "
                                                 "this cell again")
        except Exception as e:      # noqa: BLE001 - the learner's error, reported to the learner
            return None, wrong(f"keep({op!r}) raised {type(e).__name__}: {e}")
        if not isinstance(answer, bool):
            return None, wrong(f"keep({op!r}) returned {answer!r}: return True (keep the output) or False "
                               "(recompute it)")
        answers[op] = answer
    return answers, None


def check_recompute_choice(keep) -> Feedback:
    """Run the small transformer under ``keep``'s policy; pass when memory and recomputation are within budget."""
    ops = block_ops()
    answers, feedback = _ask(keep, ops)
    if feedback is not None:
        return feedback
    kept = sorted(op for op, yes in answers.items() if yes)
    r = measure(lambda op: bool(keep(op)))
    memory, flops = r["held_fraction"], r["recomputed_fraction"]
    said = f"held {memory:.0%} of the bytes (budget {MEMORY_BUDGET:.0%}), recomputed {flops:.0%} of the forward's " \
           f"matrix-product FLOPs (budget {FLOPS_BUDGET:.0%})"
    if not r["grads_identical"]:
        return wrong(f"the gradients differ from no checkpointing's: {said}")
    if memory > MEMORY_BUDGET:
        if all(answers.values()):
            return wrong(f"you keep every output: that is no checkpointing at all. {said}")
        if "bmm" in kept:
            return wrong(f"you keep bmm: its outputs are the attention scores, b·a·s² = {BATCH}·{CFG.heads}·"
                         f"{CFG.seq_len}² values per layer, the biggest activation at this length. {said}")
        biggest = sorted(kept, key=lambda op: -ops[op]["new_bytes"])[:3]
        return wrong(f"too much is kept ({', '.join(biggest)} make the most bytes). {said}")
    if flops > FLOPS_BUDGET:
        if not any(ops[op]["flops"] for op in kept):
            return wrong("you keep no matrix product (the operators with FLOPs in the table: mm, addmm, bmm), so "
                         f"backward recomputes them all. {said}")
        if "addmm" in kept and "mm" not in kept:
            return wrong(f"the key projection k has no bias: its Linear runs as mm, which you recompute. {said}")
        if "mm" in kept and "addmm" not in kept:
            return wrong(f"Linear layers with a bias run as addmm, which you recompute. {said}")
        return wrong(f"too much is recomputed: keep the outputs of the products that cost the most FLOPs. {said}")
    return passed(f"{said}; the gradients are identical to no checkpointing's. You keep: {', '.join(kept)}")
