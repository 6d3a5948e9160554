"""Three dimensions at once: data (FSDP2) × tensor (with sequence parallelism) × pipeline parallelism on one
device mesh, proved equal to one process (notebook 17: putting it together).

Eight ranks form a 2×2×2 mesh ``("pp", "dp", "tp")``. Each rank holds one pipeline stage (half the blocks), of
which it keeps half the heads and columns (tp), and of those half the rows (dp, FSDP2): an eighth of the split
weights. Three kinds of traffic follow, each in its own group of two ranks:

* **tp** (ranks ``r`` and ``r ^ 1``): sequence parallelism's all-gathers and reduce-scatters, in every block, for
  every micro-batch, forward and backward: by far the most messages;
* **dp** (``r`` and ``r ^ 2``): FSDP2 gathers each unit once a step and reduce-scatters its gradients once;
* **pp** (``r`` and ``r ^ 4``): the schedule's point-to-point sends of activations forward and gradients back.

* :mod:`.mesh`: rank → (pp, dp, tp) coordinates, the groups, the ``DeviceMesh``;
* :mod:`.stages`: one rank's model: its pipeline stage, split by the tp plan, sharded by FSDP2;
* :mod:`.count`: every message of a step, by group (:class:`~.count.GroupLog`, point-to-point included);
* :mod:`.training`: the 3-D training step, and the comparison with one process on the global batch.

``launch.run(composed.train_3d_worker, 8, backend="gloo")`` returns, per rank, its coordinates, the losses and
the reference's, the largest weight difference from one process, and the messages of one step per group.
"""
from .count import GroupLog, message_kind
from .mesh import DIMS, check_sizes, coords, device_mesh, groups, peers, rank_at
from .stages import Stage, build_stage, shard_stage, split_stage, stage_blocks, stage_plan
from .training import (
    MISTAKES,
    SMALL,
    TOLERANCE,
    check_layout,
    full_weights,
    reference,
    train_3d_runs,
    train_3d_worker,
)

__all__ = ["DIMS", "GroupLog", "MISTAKES", "SMALL", "Stage", "TOLERANCE", "build_stage", "check_layout",
           "check_sizes", "coords", "device_mesh", "full_weights", "groups", "message_kind", "peers", "rank_at",
           "reference", "shard_stage", "split_stage", "stage_blocks", "stage_plan", "train_3d_runs",
           "train_3d_worker"]
