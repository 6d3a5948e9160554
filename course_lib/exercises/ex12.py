"""Notebook 12's exercise: write the DTensor plan that splits a transformer block, with and without sequence
parallelism.

The learner writes ``fn(sequence_parallel)`` (called with one positional argument, whatever its name), returning
a plan for ``parallelize_module``: a dict from a submodule's name in :class:`~course_lib.models.transformer.Block`
(``attn.q``, ``mlp.up``, ``ln1``, ``attn``...) to a ``ParallelStyle``. The check runs it without the library's plan:

1. it reads the plan: the four layers that widen (``attn.q``, ``attn.k``, ``attn.v``, ``mlp.up``) must be
   ``ColwiseParallel``, the two that narrow (``attn.out``, ``mlp.down``) ``RowwiseParallel``; a swap, a layer
   left out, a name the block does not have, or sequence layouts asked for with ``sequence_parallel=False`` are
   named from the plan alone;
2. it splits the block on 2 ranks with the plan, for both values of ``sequence_parallel``, and compares the
   output, the input's gradient and every parameter's gradient with the unsplit block's, counting the
   collectives of the forward and the backward pass (:class:`~course_lib.comm.record.CollectiveLog`): an
   output left whole, a sequence slice taken for the whole sequence, LayerNorms left out of the sequence-parallel
   region (their gradients partial sums), or the ``PrepareModuleInput`` left out (three all-reduces where one
   does) each get their own message.
"""
from __future__ import annotations

import copy
from collections import Counter

import torch

from ..models import TransformerConfig
from ..tensor_parallel.dtensor import block_plan
from . import NOT_ATTEMPTED, Feedback, passed, run_attempt, wrong

CFG = TransformerConfig(vocab=16, seq_len=8, dim=16, heads=2, layers=1, hidden=32)
WIDEN, NARROW = ("attn.q", "attn.k", "attn.v", "mlp.up"), ("attn.out", "mlp.down")
NAMES = ("ln1", "attn", "ln2", "mlp", *WIDEN, *NARROW)
EXPECTED = {False: Counter({"all-reduce": 2}),                      # per phase (forward, backward)
            True: Counter({"all-gather": 2, "reduce-scatter": 2})}
SP_INPUT = ("with sequence_parallel=True each rank holds a slice of the sequence, (batch, seq/N, dim): say so where "
            "the slice enters a split region (attention's input, and mlp.up's), with input_layouts saying Shard(1) "
            "arrives and, for attention, desired_input_layouts saying what the module needs, so that DTensor "
            "all-gathers it")

WHOLE_OUT = ("under sequence parallelism the residual stream holds this rank's slice, so attn.out and mlp.down must "
             "hand back a slice: a RowwiseParallel whose output_layouts says Shard(1), a reduce-scatter, not an "
             "all-reduce")


def reference(sequence_parallel: bool) -> dict:
    """The reference solution: the library's plan of one block (``dtensor.block_plan``, its prefix empty)."""
    return block_plan(sequence_parallel=sequence_parallel)


def _layouts(style) -> list:
    return [p for name in ("input_layouts", "output_layouts", "sequence_sharding")
            for p in (getattr(style, name, None) or ()) if p is not None]


def _sharded_seq(style) -> bool:
    from torch.distributed.tensor import Shard
    return any(isinstance(p, Shard) and p.dim == 1 for p in _layouts(style)) or type(style).__name__ == \
        "SequenceParallel"


def _read(plan, sp: bool) -> Feedback | None:
    """What is wrong with ``plan`` from its styles alone, or ``None``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel.style import ParallelStyle

    if not isinstance(plan, dict):
        return wrong(f"return a plan: a dict from submodule names to ParallelStyles, got {type(plan).__name__}")
    unknown = [k for k in plan if k not in NAMES]
    if unknown:
        return wrong(f"the block has no submodule {unknown[0]!r}: its names are {', '.join(NAMES)}")
    styles = [k for k, v in plan.items() if not isinstance(v, ParallelStyle)]
    if styles:
        return wrong(f"{styles[0]!r} maps to {plan[styles[0]]!r}: each value is a ParallelStyle, "
                     "such as ColwiseParallel()")
    missing = [k for k in (*WIDEN, *NARROW) if k not in plan]
    if missing:
        return wrong(f"{missing[0]!r} is not in your plan: it would stay whole on every rank, and its input is "
                     "split or partial there; split all six linear layers")
    kind = {k: type(plan[k]) for k in (*WIDEN, *NARROW)}
    if all(kind[k] is RowwiseParallel for k in WIDEN) and all(kind[k] is ColwiseParallel for k in NARROW):
        return wrong("ColwiseParallel and RowwiseParallel are swapped: q, k, v and mlp.up widen the activation "
                     "(cut their outputs: ColwiseParallel, whole heads per rank), attn.out and mlp.down narrow it "
                     "back (cut their inputs: RowwiseParallel, then one reduction)")
    for k in WIDEN:
        if kind[k] is not ColwiseParallel:
            return wrong(f"{k!r} widens the activation: ColwiseParallel (each rank its columns of the output, "
                         f"whole heads), got {kind[k].__name__}")
    for k in NARROW:
        if kind[k] is not RowwiseParallel:
            return wrong(f"{k!r} takes the split activation back to dim: RowwiseParallel (each rank its rows "
                         f"of the input, the outputs summed), got {kind[k].__name__}")
    if not sp:
        seq = [k for k, v in plan.items() if _sharded_seq(v)]
        if seq:
            return wrong(f"with sequence_parallel=False every rank holds the whole sequence, but {seq[0]!r} "
                         "expects or hands back a sequence slice (Shard(1) or SequenceParallel): build the "
                         "sequence-parallel layouts only when sequence_parallel is True")
    return None


def worker(rank: int, world_size: int, fn) -> dict:
    """Worker: for each ``sequence_parallel``, the block split by ``fn``'s plan against the unsplit one."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..comm.record import CollectiveLog
    from ..tensor_parallel.check import _dtensor_slice, unsplit
    from ..tensor_parallel.dtensor import local, local_grad, parallelize

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, CFG.seq_len, CFG.dim, generator=g)
    grad_y = torch.randn(2, CFG.seq_len, CFG.dim, generator=g)
    out = {}
    for sp in (False, True):
        full = unsplit("block", CFG, seed=3)
        x_full = x.clone().requires_grad_()
        y_full = full(x_full)
        y_full.backward(grad_y)
        part = parallelize(copy.deepcopy(full), mesh, fn(sp))
        mine = (lambda t: t.chunk(world_size, 1)[rank]) if sp else (lambda t: t)   # noqa: E731
        x_part = mine(x).clone().requires_grad_()
        with CollectiveLog() as log:
            y = local(part(x_part))
            r = {"shape": tuple(y.shape), "expected shape": tuple(mine(y_full).shape)}
            if r["shape"] == r["expected shape"]:
                with log.during("backward"):
                    y.backward(mine(grad_y))
        r["collectives"] = {ph: Counter(c.kind for c in log.records if c.phase == ph) for ph in ("forward", "backward")}
        if r["shape"] == r["expected shape"]:
            fulls = dict(full.named_parameters())
            err = lambda a, b: (a.detach() - b.detach()).abs().max().item()   # noqa: E731
            r["output"], r["input grad"] = err(y, mine(y_full)), err(x_part.grad, mine(x_full.grad))
            r["grads"] = {k: err(local_grad(p), _dtensor_slice(fulls[k].grad, p)) for k, p in part.named_parameters()}
        out[sp] = r
    return out


def _gathers(plan: dict) -> bool:
    """Does the plan declare the sequence slice where it enters attention and the MLP?"""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    attn = isinstance(plan.get("attn"), PrepareModuleInput) and any(
        isinstance(p, Shard) and p.dim == 1 for p in plan["attn"].input_layouts or ())
    return attn and _sharded_seq(plan["mlp.up"])


def _diagnose(plan: dict, sp: bool, r: dict) -> Feedback | None:
    where = f"sequence_parallel={sp}"
    if r["shape"] != r["expected shape"]:
        if sp and r["shape"][1] != r["expected shape"][1]:
            return wrong(f"{where}: the block hands back {r['shape']}, not this rank's slice {r['expected shape']}: "
                         "under sequence parallelism attn.out and mlp.down leave with a reduce-scatter (their "
                         "output_layouts say Shard(1)), not an all-reduce")
        return wrong(f"{where}: the block's output has shape {r['shape']}, the input's is {r['expected shape']}")
    tol = 1e-5
    if sp and not _gathers(plan):
        if r["output"] > tol or r["input grad"] > tol:
            return wrong(f"{where}: outputs differ from the unsplit block's by {r['output']:.1e}. " + SP_INPUT)
    if r["output"] > tol or r["input grad"] > tol:
        return wrong(f"{where}: the output differs from the unsplit block's by {r['output']:.1e} and the input's "
                     f"gradient by {r['input grad']:.1e}")
    bad = [k for k, d in r["grads"].items() if d > tol]
    if bad:
        if sp and any(k.startswith(("ln1", "ln2")) for k in bad):
            return wrong(f"{where}: the output is right but {bad[0]}'s gradient is off by {r['grads'][bad[0]]:.1e}: "
                         "each rank's LayerNorm saw only its positions, so its gradient is a partial sum that "
                         "nothing reduces. Put the LayerNorms in the sequence-parallel region: the SequenceParallel "
                         "style on 'ln1' and 'ln2' (DTensor then marks their gradients Partial)")
        return wrong(f"{where}: {bad[0]}'s gradient differs from the unsplit block's by {r['grads'][bad[0]]:.1e}")
    for phase in ("forward", "backward"):
        got = r["collectives"][phase]
        if got != EXPECTED[sp]:
            said = ", ".join(f"{n} {k}" for k, n in sorted(got.items())) or "none"
            hint = ""
            if sp and not _gathers(plan):
                hint = " " + SP_INPUT + " once, from Shard(1); declared Replicate, the slice is gathered again"
            if not sp and got["all-reduce"] > 2 and "attn" not in plan:
                hint = (" q, k and v each made the shared input a DTensor, so each reduces its gradient: "
                        "a PrepareModuleInput on 'attn' makes it one DTensor, one all-reduce")
            want = ", ".join(f"{n} {k}" for k, n in sorted(EXPECTED[sp].items()))
            return wrong(f"{where}: right values, but the {phase} pass ran {said}, where one per split region "
                         f"does ({want}).{hint}")
    return None


def _takes_one(fn) -> bool:
    """Can ``fn`` be called with one positional argument? (True where Python cannot tell.)"""
    import inspect
    try:
        inspect.signature(fn).bind(True)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def check_block_plan(fn) -> Feedback:
    """Is ``fn(sequence_parallel)`` a plan that splits a transformer block exactly, with the fewest collectives?"""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    plans = {}
    for sp in (False, True):
        try:
            plans[sp] = fn(sp)
        except NotImplementedError:
            return Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your plan, then run this cell "
                                           "again")
        except TypeError as e:
            if not _takes_one(fn):
                return wrong(f"the check calls your function with one argument, fn(True) or fn(False), but it "
                             f"takes another number: {e}")
            hint = (" (PrepareModuleInput takes input_layouts and desired_input_layouts; SequenceParallel takes "
                    "neither)" if "layouts" in str(e) else "")
            return wrong(f"with sequence_parallel={sp} your function raised TypeError: {e}{hint}")
        read = _read(plans[sp], sp)
        if read is not None:
            return wrong(f"sequence_parallel={sp}: {read.message}")
    results, feedback = run_attempt(worker, 2, fn, timeout=60,
                                    error_hints={"must match the size": WHOLE_OUT, "Shard(dim=1)": SP_INPUT})
    if feedback is not None:
        return feedback
    for sp in (False, True):
        for rank_result in results:
            said = _diagnose(plans[sp], sp, rank_result[sp])
            if said is not None:
                return said
    return passed("your plan splits the block exactly, with and without sequence parallelism: output and every "
                  "gradient equal to the unsplit block's, one all-reduce (or one all-gather and one reduce-scatter) "
                  "per split region and pass")
