"""The 3-D mesh: which rank sits where, and which ranks talk to each other.

Eight ranks as a 2×2×2 grid with the dimensions ``("pp", "dp", "tp")``, numbered **row-major**, ``tp`` the fastest::

    rank = (pp_coord * dp + dp_coord) * tp + tp_coord

    rank:    0  1  2  3  4  5  6  7
    pp:      0  0  0  0  1  1  1  1      pipeline stage (blocks 0-1 | blocks 2-3)
    dp:      0  0  1  1  0  0  1  1      data-parallel replica (which half of the batch)
    tp:      0  1  0  1  0  1  0  1      tensor-parallel shard (which heads, which slice of the sequence)

A **group** of one dimension is the ranks whose other two coordinates agree: they differ only along that
dimension, and every collective of that dimension runs among them alone.

* ``tp`` groups ``[0, 1] [2, 3] [4, 5] [6, 7]``: neighbours in the numbering. They talk the most (four
  collectives per block, forward and backward, for every micro-batch), so on a real cluster they are the GPUs of
  one node, joined by NVLink.
* ``dp`` groups ``[0, 2] [1, 3] [4, 6] [5, 7]``: FSDP2's all-gathers and reduce-scatters, once per unit and step.
* ``pp`` groups ``[0, 4] [1, 5] [2, 6] [3, 7]``: point-to-point sends of activations and gradients between
  consecutive stages, the smallest messages: they can cross the slowest links (between nodes).

``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=DIMS)`` numbers ranks the same way (:func:`device_mesh`
checks it on every rank), so :func:`coords` and :func:`groups` are the mesh, on paper.
"""
from __future__ import annotations

DIMS = ("pp", "dp", "tp")
_MESHES: dict = {}   # (pp, dp, tp, device type) -> the mesh this process built: see device_mesh


def check_sizes(world_size: int, pp: int, dp: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``world_size == pp * dp * tp`` with every size at least 1."""
    if min(pp, dp, tp) < 1:
        raise ValueError(f"every mesh dimension needs at least 1 rank, got pp={pp}, dp={dp}, tp={tp}")
    if pp * dp * tp != world_size:
        raise ValueError(f"a mesh of pp={pp} × dp={dp} × tp={tp} needs {pp * dp * tp} ranks, not {world_size}: "
                         f"choose sizes whose product is the number of ranks")


def coords(rank: int, pp: int, dp: int, tp: int) -> dict[str, int]:
    """Rank ``rank``'s place on the mesh: ``{"pp": stage, "dp": replica, "tp": shard}`` (row-major, tp fastest)."""
    if not 0 <= rank < pp * dp * tp:
        raise ValueError(f"rank {rank} is not on a mesh of {pp * dp * tp} ranks")
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


def rank_at(at: dict[str, int], pp: int, dp: int, tp: int) -> int:
    """The rank at coordinates ``at`` (``{"pp": p, "dp": d, "tp": t}``): the inverse of :func:`coords`."""
    return (at["pp"] * dp + at["dp"]) * tp + at["tp"]


def groups(pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """For each dimension, its groups: lists of the ranks that differ only along that dimension."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    out: dict[str, list[list[int]]] = {}
    for dim in DIMS:
        a, b = (d for d in DIMS if d != dim)      # the two coordinates a group of `dim` shares
        out[dim] = sorted([rank_at({a: i, b: j, dim: k}, pp, dp, tp) for k in range(sizes[dim])]
                          for i in range(sizes[a]) for j in range(sizes[b]))
    return out


def peers(rank: int, pp: int, dp: int, tp: int) -> dict[str, list[int]]:
    """The ranks of each of ``rank``'s groups (itself included): who it talks to in each dimension."""
    return {dim: next(g for g in gs if rank in g) for dim, gs in groups(pp, dp, tp).items()}


def device_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu"):
    """The (pp, dp, tp) ``DeviceMesh`` over every rank; checks that it places this rank where :func:`coords` does.

    ``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]`` are this rank's 1-D sub-meshes (``.get_group()``: its process
    group in that dimension). Every rank must call it: building the mesh creates every group (a collective).

    A process builds each mesh once and hands it back on later calls. A second, equal mesh would get new process
    groups, yet DTensor's cache of sharding decisions (which compares meshes by their ranks, torch 2.13) would
    keep sending some collectives over the first mesh's groups: right results, counted in an unknown group. (On a
    second mesh's ``x``, ``(x * 2).redistribute(...)`` all-gathers over the first mesh's group.)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    check_sizes(dist.get_world_size(), pp, dp, tp)
    key = (pp, dp, tp, device_type)
    if key in _MESHES:
        return _MESHES[key]
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=DIMS)
    rank = dist.get_rank()
    placed = {dim: mesh[dim].get_local_rank() for dim in DIMS}
    if placed != coords(rank, pp, dp, tp):
        raise RuntimeError(f"rank {rank}: the mesh placed it at {placed}, coords() says {coords(rank, pp, dp, tp)}")
    for dim, ranks in peers(rank, pp, dp, tp).items():
        if dist.get_process_group_ranks(mesh[dim].get_group()) != ranks:
            raise RuntimeError(f"rank {rank}: its {dim} group is not {ranks}")
    _MESHES[key] = mesh
    return mesh
