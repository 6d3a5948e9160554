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
matrix product recomputes nothing but keeps the scores. The reference keeps only the Linear layers' products and
recomputes everything else. Korthikanti et al.'s *selective recomputation* recomputes only the attention core and
keeps the rest: here it holds 68% (it keeps LayerNorm's and GELU's outputs and the copies), so this budget asks
for the paper's scheme plus recomputing the cheap pointwise operators; the check names that case.

**Views.** ``view``, ``transpose``, ``expand``, ``_unsafe_view`` make no new memory, yet keeping one keeps its
*base* alive: ``expand`` and ``view`` of the softmax output pin the ``b·a·s²`` scores. So the feedback ranks
the operators you keep by the bytes each keeps alive (:func:`kept_alive`: one block, that operator kept alone,
less whole-layer checkpointing), not by the bytes it creates.
"""
from __future__ import annotations

import functools

import torch

from ..memory.activations import held_bytes
from ..memory.recompute import Recomputed, forward_ops, measure_policy
from ..models.transformer import Block, TransformerConfig, transformer
from . import NOT_ATTEMPTED, Feedback, passed, wrong

CFG = TransformerConfig(seq_len=256)
BATCH = 4
MEMORY_BUDGET = 0.36   # of the bytes no checkpointing holds (reference: 33.6%; + LayerNorm: 39.7%, + GELU: 45.5%)
FLOPS_BUDGET = 0.42    # of the forward's matrix-product FLOPs, recomputed (reference: 39.5%; addmm alone: 44.4%)
LINEAR = ("mm", "addmm")   # the Linear layers' products: where the FLOPs the budget needs are
VIEWS = ("view", "_unsafe_view", "transpose", "expand", "t", "detach", "as_strided", "slice", "select",
         "permute", "unsqueeze", "reshape")


def keep_linear_layers(op_name: str) -> bool:
    """Reference: keep the Linear layers' products (``addmm`` with a bias, ``mm`` without: ``k`` has none);
    recompute the attention (its ``bmm`` and softmax) and every cheap operator."""
    return op_name in ("mm", "addmm")


def _block_input() -> torch.Tensor:
    return torch.randn(BATCH, CFG.seq_len, CFG.dim, generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=1)
def block_ops() -> dict[str, dict]:
    """The operators one block runs at the check's sizes (the table the learner reads): calls, new bytes, FLOPs,
    and ``kept_alive`` (bytes this operator's outputs keep alive if it alone is kept, :func:`kept_alive`) with
    ``note``: ``"view"`` (no new memory: it pins the storage it views) or ``"partly held anyway"`` (part of its
    output stays alive even when recomputed: the block's output, held by whoever called the block)."""
    table = forward_ops(Block(CFG), _block_input())
    alive = kept_alive(tuple(table))
    for op, row in table.items():
        row["kept_alive"] = alive[op]
        row["note"] = ("view" if op in VIEWS or not row["new_bytes"] else
                       "partly held anyway" if alive[op] < row["new_bytes"] else "")
    return table


def kept_alive(ops: tuple[str, ...]) -> dict[str, int]:
    """For each operator name: the bytes one block at the check's sizes holds from forward to backward when that
    operator alone is kept, less what whole-layer checkpointing holds. A view's figure is its base's bytes."""
    block, x = Block(CFG), _block_input().requires_grad_()
    full = held_bytes(Recomputed(block, None), x)[1].total
    return {op: held_bytes(Recomputed(block, lambda name, op=op: name == op), x)[1].total - full for op in ops}


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


def _too_much_kept(kept: list[str], ops: dict) -> str:
    """Name the kept operators that hold the most bytes alive, the Linear products (which the FLOPs budget needs)
    aside; say which are views, and what a kept ``bmm``, ``div`` or ``masked_fill`` holds."""
    suspects = sorted((op for op in kept if op not in LINEAR and ops[op]["kept_alive"]),
                      key=lambda op: -ops[op]["kept_alive"])
    if "bmm" in suspects:
        return (f"you keep bmm: its outputs are the attention scores, b·a·s² = {BATCH}·{CFG.heads}·{CFG.seq_len}² "
                "values per layer, the biggest activation at this length.")
    if not suspects:
        return "too much is kept, though only Linear products: keep fewer operators."
    scores = BATCH * CFG.heads * CFG.seq_len ** 2 * 4        # one block's s² tensor, fp32
    named = []
    for op in suspects[:4]:
        what = ("a view" if ops[op]["note"] == "view" else
                "an s² tensor: the scores, scaled or masked" if op in ("div", "masked_fill", "_softmax") else
                "the residual sum after attention (the block's output is held anyway)" if op == "add" else
                "its own output")
        named.append(f"{op} ({ops[op]['kept_alive'] / 2**20:.2f} MiB a block, {what})")
    views = [op for op in suspects if ops[op]["note"] == "view"]
    of_scores = [op for op in views if ops[op]["kept_alive"] >= scores]
    base = ("here the scores and the softmax output" if of_scores == views else
            f"for {', '.join(of_scores)} the scores and the softmax output" if of_scores else
            "here bsh-sized tensors such as the head-split q, k, v")
    hint = (f" A view ({', '.join(views)}) makes no new memory, but keeping it keeps alive the tensor it views, "
            f"{base}: return False for views too." if views else "")
    return ("too much is kept. The Linear products (mm, addmm) are worth their bytes: they hold the FLOPs. Of "
            f"the rest, ranked by the bytes each keeps alive: {'; '.join(named)}.{hint}")


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
            return wrong("you keep every output, which holds more than no checkpointing: autograd saves only what "
                         f"backward needs, and keeping every output keeps more. {said}")
        paper = (set(LINEAR) | {"native_layer_norm", "gelu"}) <= set(kept) and not {"bmm", "_softmax"} & set(kept)
        intro = ("This is Korthikanti et al.'s selective recomputation (recompute the attention core, keep the "
                 "rest). This budget also needs the cheap operators recomputed: LayerNorm, GELU and the copies. "
                 if paper else "")
        return wrong(intro + _too_much_kept(kept, ops) + f" {said}")
    if flops > FLOPS_BUDGET:
        if not any(ops[op]["flops"] for op in kept):
            return wrong("you keep no matrix product (the operators with FLOPs in the table: mm, addmm, bmm), so "
                         "backward recomputes them all. Names come without `aten.`, as in the table. "
                         f"{said}")
        if "addmm" in kept and "mm" not in kept:
            return wrong(f"the key projection k has no bias: its Linear runs as mm, which you recompute. {said}")
        if "mm" in kept and "addmm" not in kept:
            return wrong(f"Linear layers with a bias run as addmm, which you recompute. {said}")
        return wrong(f"too much is recomputed: keep the outputs of the products that cost the most FLOPs. {said}")
    return passed(f"{said}; the gradients are identical to no checkpointing's. You keep: {', '.join(kept)}")
