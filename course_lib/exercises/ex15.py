"""Notebook 15's exercises: the log-sum-exp merge, then the ring loop of ring attention.

1. ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)``: attention over the keys of two blocks from attention over each
   (:func:`check_merge`, in this process). Probed with every score near 1000 (where exp(lse) overflows), with two
   blocks 800 apart either way, with the empty state (lse = −inf, out = 0) on either side, on copies of the
   inputs; a wrong answer is recognised by what it equals (a plain sum, a plain mean, swapped weights...).
2. ``fn(q, k, v, causal) -> out``: this rank's part of attention over the whole sequence, contiguous layout
   (:func:`check_ring`, on 2 and 4 ranks, causal or not). Every rank also computes, in the worker, what the
   usual mistakes would give (the causal mask on every block or on none, future blocks not skipped, the source
   of a block counted the wrong way round the ring, blocks not passed on); an answer equal to one of them is
   named. The learner's point-to-point calls and collectives are recorded, and the course's own context-parallel
   functions refuse to run: an answer that gathers the keys, or calls the library, is not a ring. Blocking sends
   on every rank hang (Gloo as NCCL): the run's timeout then names them.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..context_parallel.blocks import block_attention  # noqa: F401 (the reference)
from ..context_parallel.blocks import merge as reference_merge
from . import NOT_ATTEMPTED, Feedback, passed, run_attempt, wrong

WORLD_SIZES = (2, 4)


def reference_ring(q, k, v, causal):
    """The ring loop: rank r starts with its own block; at each step it passes on the block it holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = block_attention(q, k, v, diagonal=causal)          # its own keys first
    kv = torch.stack([k, v])
    for step in range(1, world):
        incoming = torch.empty_like(kv)
        ops = [dist.P2POp(dist.isend, kv, (rank + 1) % world), dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        kv, source = incoming, (rank - step) % world              # the block that came from `step` ranks back
        if causal and source > rank:
            continue                                              # keys in the future: nothing to add
        out, lse = reference_merge(out, lse, *block_attention(q, kv[0], kv[1]))
    return out


# --- 1. the merge -------------------------------------------------------------------------------------------

def _blocks():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k_a, v_a = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k_b, v_b = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return q, (k_a, v_a), (k_b, v_b)


def _close(a, b):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-9, atol=1e-9))


def _what_out_is(out, out_a, lse_a, out_b, lse_b, lse, where):
    """The name of a wrong ``out``, when it is one of the usual ones."""
    w_a, w_b = torch.exp(lse_a - lse)[..., None], torch.exp(lse_b - lse)[..., None]
    if _close(out, out_a + out_b):
        return (f"out is out_a + out_b{where}: each block's output is already a weighted mean over its own keys; "
                "rescale each by its share of the total, exp(lse_x − lse), before adding")
    if _close(out, (out_a + out_b) / 2):
        return (f"out is the plain mean of out_a and out_b{where}: the blocks weigh by their softmax mass, "
                "exp(lse_a − lse) and exp(lse_b − lse), not ½ each")
    if _close(out, out_a * w_b + out_b * w_a):
        return f"the two weights are swapped{where}: out_a weighs exp(lse_a − lse), out_b exp(lse_b − lse)"
    return None


PROBES = ((0.0, 0.0, ""), (1000.0, 1000.0, " (every score near 1000, where exp(lse) overflows)"),
          (0.0, 800.0, " (block B's scores 800 above A's)"), (800.0, 0.0, " (block A's scores 800 above B's)"))


def check_merge(fn) -> Feedback:
    """``fn`` must merge two partial attention results exactly: where exp(lse) overflows, where the two blocks'
    scores lie far apart, and from the empty state on either side."""
    if not callable(fn):
        return wrong(f"pass your function itself (without calling it), got {fn!r}")
    q, (k_a, v_a), (k_b, v_b) = _blocks()
    for shift_a, shift_b, where in PROBES:
        # adding a constant to a block's scores leaves its output alone and adds the constant to its lse
        (out_a, lse_a), (out_b, lse_b) = block_attention(q, k_a, v_a), block_attention(q, k_b, v_b)
        lse_a, lse_b = lse_a + shift_a, lse_b + shift_b
        want_lse = torch.logaddexp(lse_a, lse_b)
        want = out_a * torch.exp(lse_a - want_lse)[..., None] + out_b * torch.exp(lse_b - want_lse)[..., None]
        try:
            got = fn(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        except NotImplementedError:
            return Feedback(NOT_ATTEMPTED,
                            "replace `raise NotImplementedError` with your code, then run this cell again")
        except RuntimeError as e:
            hint = (" lse is (batch, heads, queries) and out (batch, heads, queries, head_dim): weigh out by "
                    "exp(lse_a − lse).unsqueeze(-1)." if "size of tensor" in str(e) else "")
            return wrong(f"your merge raised RuntimeError: {e}.{hint}")
        if not (isinstance(got, tuple) and len(got) == 2):
            return wrong(f"return a pair (out, lse), got {type(got).__name__}")
        out, lse = got
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            return wrong(f"out must have the shape of out_a, {tuple(want.shape)}")
        if not (torch.isfinite(out).all() and (not isinstance(lse, torch.Tensor) or torch.isfinite(lse).all())):
            return wrong(f"your out or lse holds inf or nan{where}: an exp overflowed. Never form exp(lse) or "
                         "exp(lse_a − lse_b) itself: weigh each block by exp(lse_x − lse), with lse = "
                         "torch.logaddexp(lse_a, lse_b), whose exponents are never positive")
        if not _close(out, want):
            return wrong(_what_out_is(out, out_a, lse_a, out_b, lse_b, want_lse, where)
                         or f"out differs from attention over both blocks{where} (by up to "
                            f"{(out - want).abs().max():.2e}): out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)")
        if not isinstance(lse, torch.Tensor) or lse.shape != want_lse.shape:
            return wrong(f"lse must have the shape of lse_a, {tuple(want_lse.shape)}")
        if not _close(lse, want_lse):
            if _close(lse, torch.maximum(lse_a, lse_b)):
                return wrong("out is right but lse is max(lse_a, lse_b): the merged lse is log(exp(lse_a) + "
                             "exp(lse_b)), torch.logaddexp(lse_a, lse_b); the next merge needs it exactly")
            if _close(lse, lse_a + lse_b):
                return wrong("out is right but lse is lse_a + lse_b: the sums of exponentials add, so the logs combine "
                             "as log(exp(lse_a) + exp(lse_b)), torch.logaddexp")
            return wrong("out is right but lse is not the log-sum-exp of both blocks: torch.logaddexp(lse_a, lse_b)")
    empty = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    for side, args in (("first", (*empty, out_b, lse_b)), ("second", (out_b, lse_b, *empty))):
        out, lse = fn(*(t.clone() for t in args))
        if not (_close(out, out_b) and _close(lse, lse_b)):
            return wrong(f"with the empty state (out = 0, lse = −inf: no keys seen yet) as the {side} argument, the "
                         "merge must give the other block unchanged; yours gives "
                         + ("nan" if torch.isnan(out).any() or torch.isnan(lse).any() else "something else")
                         + ". torch.logaddexp and exp(−inf) = 0 handle it")
    return passed("your merge equals attention over both blocks, keeps lse exact for the next merge, survives scores "
                  "whose exp overflows or lie far apart, and handles the empty state on either side")


# --- 2. the ring --------------------------------------------------------------------------------------------

def _simulate(q, ks, vs, rank, world_size, causal, *, actual=None, label=None, keep=None, diagonal=None,
              steps=None):
    """What a ring computes, in this process: at each step it holds the block of rank ``actual(step)``, believes
    it is rank ``label(step)``'s, and merges it when ``keep(label)``, masked when ``diagonal(label)``. The defaults
    are the right ring; each mistake changes one of them."""
    actual = actual or (lambda step: (rank - step) % world_size)
    label = label or actual
    keep = keep or (lambda source: not causal or source <= rank)
    diagonal = diagonal or (lambda source: causal and source == rank)
    out = lse = None
    for step in range(steps or world_size):
        j, source = actual(step), label(step)
        if keep(source):
            o, s = block_attention(q, ks[j], vs[j], diagonal(source))
            out, lse = (o, s) if out is None else reference_merge(out, lse, o, s)
    return out


P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "broadcast", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter")
LIBRARY = {"": ("ring_attention", "allgather_attention", "ulysses_attention"), "ring": ("ring_forward",),
           "allgather": ("allgather_attention",), "ulysses": ("ulysses_attention",)}


@contextmanager
def _recorded(calls: list):
    """While active: every point-to-point call and collective is appended to ``calls``, and the library's own
    context-parallel attention raises (the exercise is to write the ring, not to call it)."""
    from .. import context_parallel as cp
    c10d = dist.distributed_c10d
    saved = [(m, name, getattr(m, name)) for name in P2P + COLLECTIVES for m in (dist, c10d) if hasattr(m, name)]
    saved += [(getattr(cp, sub) if sub else cp, name, getattr(getattr(cp, sub) if sub else cp, name))
              for sub, names in LIBRARY.items() for name in names]

    def refuse(*args, **kwargs):
        raise RuntimeError("write the ring yourself: the course's context-parallel functions are off for this check")

    wrappers = {}
    for module, name, original in saved:
        if name in P2P + COLLECTIVES:
            wrappers.setdefault(name, lambda *a, _n=name, _f=original, **kw: (calls.append(_n), _f(*a, **kw))[1])
            setattr(module, name, wrappers[name])       # the same wrapper in both namespaces: P2POp accepts it
        else:
            setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def ring_trial(rank, world_size, fn, *, causal):
    """Worker: the learner's output for this rank, full attention's slice, and what the usual mistakes give."""
    calls = []
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 3 * world_size, 4, generator=g, dtype=torch.float64) for _ in range(3))
    parts = [t.chunk(world_size, dim=2) for t in (q, k, v)]
    with _recorded(calls):
        got = fn(parts[0][rank].clone(), parts[1][rank].clone(), parts[2][rank].clone(), causal)
    ring = functools.partial(_simulate, parts[0][rank], parts[1], parts[2], rank, world_size, causal)
    wrong_answers = {"own": ring(steps=1),
                     "not passed on": ring(actual=lambda step: rank if step == 0 else (rank - 1) % world_size)}
    if causal:
        wrong_answers |= {"own block unmasked": ring(diagonal=lambda source: False),
                          "every block masked": ring(diagonal=lambda source: True),
                          "future kept": ring(keep=lambda source: True),
                          "no mask": ring(keep=lambda source: True, diagonal=lambda source: False),
                          "wrong way round": ring(label=lambda step: (rank + step) % world_size)}
    return {"got": got.detach().clone() if isinstance(got, torch.Tensor) else type(got).__name__,
            "want": F.scaled_dot_product_attention(q, k, v, is_causal=causal).chunk(world_size, dim=2)[rank],
            "wrong": wrong_answers, "calls": calls}


MISTAKES = {
    "own block unmasked": "the rank's own block (source == rank) was attended to without the causal triangle: pass "
                          "diagonal=True (a bool) for it, so that query i sees only keys 0..i of its own block",
    "every block masked": "the causal triangle is applied to every block: only the block of the rank's own "
                          "positions (source == rank) needs it; earlier blocks are seen whole",
    "future kept": "blocks from ranks after this one (source > rank) are in the future under a causal mask: skip them",
    "no mask": "causal=True but no mask was applied: mask the own block's triangle, skip the blocks from later ranks",
    "wrong way round": "the blocks are attributed to the wrong ranks: when you send to rank + 1 and receive from "
                       "rank − 1, after `step` passes you hold the block of rank (rank − step) % world",
    "own": "only the rank's own block was attended to: the others' keys must come round the ring and be merged in",
    "not passed on": "each rank saw its own block and its neighbour's only: at each step, pass on the block you just "
                     "received, not your own",
}


def check_ring(fn) -> Feedback:
    """``fn(q, k, v, causal)`` must return this rank's part of full attention, on 2 and 4 ranks."""
    hint = ("If every rank calls a blocking dist.send first, each waits for a receive that no rank has posted yet: "
            "post the send and the receive together (dist.batch_isend_irecv, or dist.isend then dist.recv).")
    for n in WORLD_SIZES:
        for causal in (False, True):
            results, feedback = run_attempt(functools.partial(ring_trial, causal=causal), n, fn, timeout=20,
                                            timeout_hint=hint)
            if feedback is not None:
                return feedback
            where = f"on {n} ranks, causal={causal}"
            used = sorted({c for r in results for c in r["calls"] if c in COLLECTIVES})
            if used:
                return wrong(f"{where}: your function calls dist.{used[0]}: ring attention passes the blocks round "
                             "the ring, point to point (isend/irecv), with no collective")
            sends = min(sum(c in ("send", "isend") for c in r["calls"]) for r in results)
            for rank, r in enumerate(results):
                if isinstance(r["got"], str):
                    return wrong(f"{where}: rank {rank} returned a {r['got']}, not a tensor")
                if r["got"].shape != r["want"].shape:
                    return wrong(f"{where}: rank {rank} returned shape {tuple(r['got'].shape)}, expected this rank's "
                                 f"part, {tuple(r['want'].shape)}")
                if _close(r["got"], r["want"]):
                    if sends < n - 1:
                        return wrong(f"{where}: the output is right, but a rank sent only {sends} block(s): the ring "
                                     f"passes each block on, W − 1 = {n - 1} sends a rank")
                    continue
                named = next((m for m, value in r["wrong"].items() if _close(r["got"], value)), None)
                if named:
                    return wrong(f"{where}, rank {rank}: {MISTAKES[named]}")
                return wrong(f"{where}: rank {rank}'s output is up to {(r['got'] - r['want']).abs().max():.2e} from "
                             "full attention's; merge each block with cp.merge, starting from your own block")
    return passed("your ring gives every rank its part of full attention, causal or not, on 2 and 4 ranks")
