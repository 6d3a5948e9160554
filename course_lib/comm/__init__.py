"""Communication between ranks: what each collective means, all-reduce written by hand, and its cost.

* :mod:`.collectives`: every collective's meaning in plain Python, and the real ``torch.distributed`` call
  on each rank (notebook 01).
* :mod:`.allreduce`: naive, ring and recursive-doubling all-reduce from point-to-point messages (notebook 02).
* :mod:`.costmodel`: algorithm and bus bandwidth, the α-β model fitted to measurements (notebook 02).
* :mod:`.sweep`: notebook 02's all-reduce sweep over sizes and world sizes, and the ring's α-β fit.
* :mod:`.record`: the collectives that run, recorded with their size (``CollectiveLog``; notebooks 10-12 and 14).
* :mod:`.alltoall`: a differentiable all-to-all and ``AllToAllLog``, the all-to-alls that ran (notebooks 15, 16).
"""
