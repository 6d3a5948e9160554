"""The calculator against measurements: the bytes the course's small transformer really holds and sends.

:func:`measure_worker` runs on N ranks (Gloo on the CPU, in fp32) and measures, on the course transformer:

* ZeRO stages 1, 2 and 3 from scratch (notebook 09): the bytes behind each rank's parameters, gradients and
  optimizer states after a step (``zero.rank_bytes``), and the collectives a step issues (``count_traffic``);
* DDP: the bytes its gradient all-reduce carries (counted by notebook 11's
  :class:`~course_lib.comm.record.CollectiveLog`);
* one rank's unsplit model: the activations saved for backward, and the matrix-product FLOPs of a step, with
  and without whole-layer recomputation (notebook 13);
* tensor parallelism (notebook 11's split transformer): the parameters a rank holds, the activations it saves
  for backward (saved-tensor hooks), and the collectives of a step, with and without whole-layer recomputation.

:func:`compare` sets each measurement beside :func:`.planner.predict`'s figure for the same layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .planner import collectives, param_count, predict


def _data(cfg, batch: int, rank: int):
    from ..data import make_token_dataset
    x, y = make_token_dataset(batch * (rank + 1), cfg.seq_len, cfg.vocab, seed=3).tensors
    return x[-batch:].clone(), y[-batch:].clone()   # own storage: a slice would be counted with its whole data set


def _step(model, opt, x, y):
    from ..models.transformer import lm_loss
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    opt.step()


def measure_worker(rank: int, world_size: int, cfg, batch: int = 2) -> dict:
    """Everything :func:`compare` needs, measured on this rank (module docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..comm.record import CollectiveLog
    from ..models.transformer import lm_loss, transformer
    from ..tensor_parallel import tensor_parallel_transformer
    from ..zero import rank_bytes, shard
    from ..zero.flat import count_traffic
    from .recompute import measure_policy, with_recomputation
    from .saved import saved_bytes

    x, y = _data(cfg, batch, rank)
    out = {"zero": {}, "traffic": {}}
    for recompute in ("none", "full"):
        model = with_recomputation(transformer(cfg), recompute)
        out[f"saved_{recompute}"] = saved_bytes(lambda m=model: lm_loss(m(x), y), exclude=list(model.parameters()))
        flops = measure_policy(transformer(cfg), recompute, x, y)
        out[f"flops_{recompute}"] = flops["forward_flops"] + flops["backward_flops"]
    for stage in (1, 2, 3):
        model, opt = shard(transformer(cfg), stage, torch.optim.AdamW, lr=1e-3)
        _step(model, opt, x, y)
        with count_traffic() as log:
            _step(model, opt, x, y)
        out["zero"][stage] = rank_bytes(model, opt)
        out["traffic"][stage] = log

    ddp = DDP(transformer(cfg))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    log = CollectiveLog()
    with log:
        lm_loss(ddp(x), y).backward()
    out["ddp"] = [(r.kind, r.nbytes) for r in log.records]

    tp = tensor_parallel_transformer(transformer(cfg))
    out["tp_params"] = sum(p.numel() for p in tp.parameters())
    out["tp_saved"] = saved_bytes(lambda: lm_loss(tp(x), y), exclude=list(tp.parameters()))
    for recompute in ("none", "full"):
        model = with_recomputation(tp, recompute)
        log = CollectiveLog()
        with log:
            loss = lm_loss(model(x), y)
            with log.during("backward"):
                loss.backward()
        out[f"tp_{recompute}"] = [(r.kind, r.nbytes, r.phase) for r in log.records]
    dist.barrier()
    return out


def _by_kind(records) -> dict:
    total: dict = {}
    for r in records:
        total[r[0]] = total.get(r[0], 0) + r[1]
    return total


def compare(measured: dict, cfg, batch: int, world_size: int) -> list[dict]:
    """Rows ``{"what", "predicted", "measured"}``: the calculator (fp32, CPU conventions) beside one rank's
    measurements from :func:`measure_worker`. ZeRO's reduce-scatter runs as an all-reduce on Gloo (notebook
    09), so its traffic is compared as the bytes of the buffers, whatever the collective's name."""
    n, s = world_size, cfg.seq_len
    rows = []
    for recompute in ("none", "full"):
        p = predict(cfg, s, batch, recompute=recompute, dtype="fp32", device="cpu", attention="eager")
        rows.append({"what": f"activations saved, recompute {recompute}", "predicted": p["memory"]["activations"],
                     "measured": measured[f"saved_{recompute}"]})
    extra = measured["flops_full"] / measured["flops_none"] - 1
    rows.append({"what": "extra compute of recomputation (matmul FLOPs)",
                 "predicted": round(predict(cfg, s, batch, recompute="full")["extra_compute"], 9),
                 "measured": round(extra, 9)})
    for stage in (1, 2, 3):
        mem = predict(cfg, s, batch, dp=n, zero=stage, dtype="fp32", device="cpu", attention="eager")["memory"]
        got = measured["zero"][stage]
        for part, key in (("weights", "parameters"), ("gradients", "gradients"),
                          ("optimizer states", "optimizer states")):
            rows.append({"what": f"ZeRO-{stage} {part} per rank", "predicted": mem[part], "measured": got[key]})
        coll = collectives(cfg, s, batch, dp=n, zero=stage, dtype="fp32")
        rows.append({"what": f"ZeRO-{stage} bytes of the buffers collected per step",
                     "predicted": sum(nbytes * count for _, _, nbytes, count in coll),
                     "measured": sum(nbytes for _, nbytes in measured["traffic"][stage])})
    ddp = collectives(cfg, s, batch, dp=n, zero=0, dtype="fp32")
    rows.append({"what": "DDP all-reduced bytes per step", "predicted": _by_kind([c[1:3] for c in ddp]),
                 "measured": _by_kind(measured["ddp"])})
    rows.append({"what": f"TP {n}: parameters per rank", "predicted": param_count(cfg, n),
                 "measured": measured["tp_params"]})
    acts = predict(cfg, s, batch, tp=n, dtype="fp32", device="cpu", attention="eager")["memory"]["activations"]
    rows.append({"what": f"TP {n}: activations saved per rank", "predicted": acts, "measured": measured["tp_saved"]})
    for recompute in ("none", "full"):
        coll = collectives(cfg, s, batch, tp=n, recompute=recompute, dtype="fp32")
        predicted = {"all-reduce": sum(nbytes * count for _, _, nbytes, count in coll)}
        rows.append({"what": f"TP {n}, recompute {recompute}: all-reduced bytes per step", "predicted": predicted,
                     "measured": _by_kind(measured[f"tp_{recompute}"])})
    return rows
