"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks (notebook 16).

* :mod:`.routing`: the router's top-k choice, capacity and dropped slots, the load-balancing loss.
* :mod:`.experts`: the experts (small MLPs), each rank's block of them, built the same from one seed.
* :mod:`course_lib.comm.alltoall` (shared with Ulysses): a differentiable all-to-all; :class:`AllToAllLog`.
* :mod:`.dispatch`: dispatch and combine, the algorithm: tokens to their experts' ranks and back.
* :mod:`.moe`: :class:`MoE`, the one-process reference or, given a group, expert-parallel.
* :mod:`.balance`: the router trained with and without the load-balancing loss.
* :mod:`.check`: workers that prove the expert-parallel layer equals the reference, alone and with data
  parallelism; the bytes an all-to-all moves.
"""
from ..comm import alltoall
from ..comm.alltoall import AllToAll, AllToAllLog, all_to_all
from . import balance, check, dispatch, experts, moe, routing
from .dispatch import dispatch_combine
from .experts import LocalExperts
from .moe import MoE, owned_block
from .routing import balance_loss, capacity, imbalance, route

__all__ = ["MoE", "owned_block", "LocalExperts", "dispatch_combine", "AllToAll", "all_to_all", "AllToAllLog",
           "route", "capacity", "balance_loss", "imbalance", "alltoall", "balance", "check", "dispatch", "experts",
           "moe", "routing"]
