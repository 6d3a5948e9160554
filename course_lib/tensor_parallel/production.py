"""The plan a production trainer gives a whole transformer (torchtitan's, on this course's model).

Everything between the embeddings and the loss runs on sequence slices or split heads, and the logits are never
gathered:

* ``tok_emb``: a **vocabulary-parallel embedding**, ``RowwiseParallel(input_layouts=Replicate(),
  output_layouts=Shard(1))``: each rank holds ``vocab/N`` rows of the table, looks up the tokens in its range (zeros
  elsewhere), and a reduce-scatter both sums the ranks' parts and hands each rank its sequence slice;
* ``pos_emb``: the same, its ``(seq, dim)`` output cut along the sequence (``Shard(0)``);
* every block: :func:`.dtensor.block_plan` with sequence parallelism;
* ``ln_f``: ``SequenceParallel()``;
* ``head``: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``: the
  logits stay a DTensor cut along the vocabulary;
* the loss under ``torch.distributed.tensor.parallel.loss_parallel()``: cross-entropy on vocabulary-sharded logits,
  with small all-reduces of per-position maxima and sums instead of an all-gather of ``(batch, seq, vocab)``.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from .dtensor import block_plan


def production_plan(layers: int) -> dict:
    """The plan of a whole :class:`~course_lib.models.transformer.Transformer`: sequence parallel everywhere,
    vocabulary-parallel embedding and head."""
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        plan.update(block_plan(f"blocks.{i}.", sequence_parallel=True))
    return plan


def production_worker(rank: int, world_size: int, cfg=None, batch: int = 2, seed: int = 0) -> dict:
    """One forward, loss and backward of the model split by :func:`production_plan`, against one process: the
    largest differences of the loss and of every gradient, the logits' placement, and the collectives of the
    forward and loss with their sizes in bytes (``collectives``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from .. import hardware
    from ..comm.record import CollectiveLog
    from ..models import TransformerConfig
    from ..models.transformer import lm_loss, transformer
    from .check import _dtensor_slice
    from .dtensor import local_grad, parallelize

    cfg = cfg or TransformerConfig(vocab=64, seq_len=8, dim=32, heads=4, layers=2, hidden=64)
    device = hardware.rank_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(seed + 5)
    tokens = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=g).to(device)
    targets = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=g).to(device)
    full = transformer(cfg, seed).to(device)
    loss_full = lm_loss(full(tokens), targets)
    loss_full.backward()
    part = parallelize(transformer(cfg, seed).to(device), mesh, production_plan(cfg.layers))
    with CollectiveLog() as log:
        logits = part(tokens)
        with loss_parallel():
            loss = lm_loss(logits, targets)
            with log.during("backward"):
                loss.backward()
    fulls = dict(full.named_parameters())
    grads = {k: (local_grad(p) - _dtensor_slice(fulls[k].grad, p)).abs().max().item()
             for k, p in part.named_parameters()}
    return {"loss": abs(loss.full_tensor().item() - loss_full.item()), "grads": grads,
            "logits": (str(logits.placements), tuple(logits.to_local().shape)),
            "logits bytes": batch * cfg.seq_len * cfg.vocab * 4,
            "collectives": [(r.kind, r.nbytes, r.phase) for r in log.records]}
