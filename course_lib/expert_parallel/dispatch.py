"""Dispatch and combine: the token-slots travel to the ranks that hold their experts, and come back.

On every rank, for its token-slots ``x`` (one row per slot), the expert each goes to and each one's gate:

1. sort the slots by expert: rank ``r``'s experts are contiguous, so the slots for rank 0 come first, then rank 1's;
2. count the slots for each expert and exchange the counts (an all-to-all of ``num_experts`` integers): now every
   rank knows how many rows it will receive from each rank, and for which of its experts;
3. dispatch: an all-to-all of the sorted rows;
4. run the local experts on what arrived (each source's rows are sorted by expert, so the counts say which is which);
5. combine: the reverse all-to-all brings each result back to the rank its slot came from, in the order it was sent;
6. undo the sort, and weight each result by its gate.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.alltoall import all_to_all


def dispatch_combine(x, expert, gate, num_experts, local_experts, group=None):
    """``gate[i] · expert_{expert[i]}(x[i])`` for every slot ``i``, the experts spread over the ranks of ``group``.

    ``local_experts(tokens, local)`` runs this rank's experts (``local``: 0 .. num_experts / world − 1).
    """
    world = dist.get_world_size(group)
    per_rank = num_experts // world
    order = torch.argsort(expert, stable=True)                     # 1. grouped by expert, hence by rank
    send_counts = torch.bincount(expert, minlength=num_experts)    # 2. slots for each expert
    recv_counts = torch.empty_like(send_counts)                    # [s * per_rank + j]: from rank s, for my expert j
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send = send_counts.view(world, per_rank).sum(1).tolist()       # rows to each rank
    recv = recv_counts.view(world, per_rank).sum(1).tolist()       # rows from each rank
    received = all_to_all(x[order], recv, send, group)             # 3. dispatch
    local = torch.arange(per_rank, device=x.device).repeat(world).repeat_interleave(recv_counts)
    done = local_experts(received, local)                          # 4. the experts
    back = all_to_all(done, send, recv, group)                     # 5. combine: in the order we sent
    out = torch.empty_like(back).index_copy(0, order, back)       # 6. undo the sort
    return out * gate.unsqueeze(1)
