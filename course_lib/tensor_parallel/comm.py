"""What tensor parallelism sends: every collective of a forward and a backward, recorded with its size by
:class:`course_lib.comm.record.CollectiveLog` (a ``TorchDispatchMode`` that sees the collectives that run through
PyTorch's dispatcher, the from-scratch layers' and ``parallelize_module``'s alike; imported here, where notebook 11
introduces it).

Bytes each rank sends, for a collective over N ranks of a tensor of n bytes (the whole tensor: the all-gather's
output, the reduce-scatter's input), done as a ring as in notebook 02
(:func:`course_lib.comm.costmodel.ring_steps_and_bytes`):

* all-reduce: 2(N-1)/N · n in 2(N-1) steps;
* all-gather, reduce-scatter: each is one half of the ring all-reduce, (N-1)/N · n in N-1 steps.

The α-β model of notebook 02 then prices each one (:func:`course_lib.comm.costmodel.predict`). These are the
bytes of the ring algorithm, not what a backend sends: Gloo, for one, runs a reduce-scatter as an all-reduce
(notebook 09 shows it).

That is why sequence parallelism's all-gather + reduce-scatter costs what tensor parallelism's all-reduce did.
"""
from __future__ import annotations

import torch

from ..comm.costmodel import ring_steps_and_bytes  # noqa: F401  (notebook 11 counts with comm.ring_steps_and_bytes)
from ..comm.record import CollectiveLog  # notebook 11 records with comm.CollectiveLog


def collectives_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]], cfg=None,
                       batch: int = 2, seed: int = 0, recompute: tuple = ()) -> dict:
    """For each ``(kind, layout, sequence_parallel)`` (see :mod:`.check`): the collectives of one forward, one
    backward and the gradients' synchronisation of the split block, as ``[(kind, bytes, phase), ...]``.

    The last phase, ``"gradient sync"``, is sequence parallelism's all-reduce of the partial gradients: the
    from-scratch layers' :func:`~.sequence.sync_sequence_parallel_grads`; DTensor's deferred reduction of its
    ``Partial`` gradients, asked for by :func:`.dtensor.local_grad` (as an optimizer's step would).

    ``recompute``: more cases, each ``(kind, layout, sequence_parallel, mode)``, run under activation
    recomputation (``torch.utils.checkpoint``, non-reentrant): the backward pass runs the forward again, and with
    it the forward's collectives. ``mode="full"`` recomputes the whole forward, as Megatron-LM's full recomputation
    does; ``mode="early stop"`` is PyTorch's default, which stops recomputing once every saved tensor is back, so
    it skips the block's last all-reduce (nothing saved depends on it).
    """
    from .. import hardware
    from ..models.transformer import TransformerConfig
    from . import dtensor as D
    from .check import split, unsplit
    from .sequence import sync_sequence_parallel_grads

    cfg = cfg or TransformerConfig()
    device = hardware.rank_device()
    mesh = None
    if any(layout != "scratch" for _, layout, _ in cases):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    for kind, layout, sp, *mode in [*cases, *recompute]:
        part = split(kind, unsplit(kind, cfg, seed).to(device), layout, sp, mesh)
        x = torch.randn(batch, cfg.seq_len // (world_size if sp else 1), cfg.dim, device=device, requires_grad=True)
        log = CollectiveLog()
        with log:
            if mode:
                with set_checkpoint_early_stop(mode[0] == "early stop"):
                    y = D.local(checkpoint(part, x, use_reentrant=False))
            else:
                y = D.local(part(x))
            with log.during("backward"):
                y.sum().backward()
            with log.during("gradient sync"):
                if layout == "scratch":
                    sync_sequence_parallel_grads(part)
                else:
                    for p in part.parameters():
                        D.local_grad(p)
        out[(kind, layout, sp, *mode)] = [(r.kind, r.nbytes, r.phase) for r in log.records]
    return out
