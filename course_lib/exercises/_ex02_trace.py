"""Notebook 02's check, its recorder: the order of each rank's point-to-point operations and collectives, and
NCCL's rule replayed on those orders (see :mod:`course_lib.exercises.ex02`, whose docstring says why)."""
from __future__ import annotations

import contextlib

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "all_reduce_coalesced")
# the process group's own methods, below every alias of torch.distributed's functions
_PG_SENDS, _PG_RECVS = ("send",), ("recv", "recv_anysource")
_PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
                   "allgather_into_tensor_coalesced", "all_gather_single", "reduce_scatter", "_reduce_scatter_base",
                   "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
                   "all_to_all_single", "gather", "scatter")


def _global(group, group_rank):
    """The global rank of ``group_rank`` in ``group`` (the default group when ``None``); ``None`` if unknown."""
    if group_rank is None:
        return None
    try:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)
    except Exception:  # noqa: BLE001 (a rank the group does not have: unknown, the backend will say why)
        return None


@contextlib.contextmanager
def recording_p2p(trace: list, seen: dict | None = None):
    """Record the point-to-point operations this process issues, in order, into ``trace``.

    Each entry is one unit the backend gets at once: a list of ``(kind, peer)`` with kind ``"send"`` or
    ``"recv"`` (peer ``None``: a receive from any source, or a peer the recorder could not resolve).
    ``send``/``recv``/``isend``/``irecv`` give one-op units; a ``batch_isend_irecv`` gives one unit with all its
    operations. Peers given as ``group_dst``/``group_src``/``group_peer`` are turned into global ranks.
    ``torch.distributed``'s names are wrapped while the block runs; ``P2POp`` is wrapped so that it accepts the
    wrapped ``isend``/``irecv``. (``distributed_c10d``'s own globals stay: its ``P2POp`` checks ``op`` against them.)

    Below every alias (``from torch.distributed import isend`` made before the block), the process group's own
    methods count into ``seen``: ``"sends"`` (point-to-point sends the backend got) and ``"collectives"`` (names of
    collectives called). A send counted there but missing from ``trace`` went through an unwrapped name.
    """
    from torch.distributed import distributed_c10d as c10d
    seen = {} if seen is None else seen
    seen.update(sends=0, collectives=[])
    names = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp")
    real = {name: getattr(c10d, name) for name in names}
    saved = [(dist, name, getattr(dist, name)) for name in names]

    def peer(args, kwargs, key):
        if args and args[0] is not None:
            return args[0]
        if kwargs.get(key) is not None:
            return kwargs[key]
        group = args[1] if len(args) > 1 else kwargs.get("group")
        return _global(group, args[3] if len(args) > 3 else kwargs.get("group_" + key))

    def one(kind, name, key):
        def wrapped(tensor, *args, **kwargs):
            trace.append([(kind, peer(args, kwargs, key))])
            return real[name](tensor, *args, **kwargs)
        wrapped.real = real[name]
        return wrapped

    wrapped = {"send": one("send", "send", "dst"), "recv": one("recv", "recv", "src"),
               "isend": one("send", "isend", "dst"), "irecv": one("recv", "irecv", "src")}
    real_ops = {real["isend"], real["send"], wrapped["isend"], wrapped["send"]}

    def p2p_op(op, tensor, *args, **kwargs):
        return real["P2POp"](getattr(op, "real", op), tensor, *args, **kwargs)

    def op_peer(op):
        if getattr(op, "peer", None) is not None:
            return op.peer
        return _global(getattr(op, "group", None), getattr(op, "group_peer", None))

    def batch_isend_irecv(ops):
        trace.append([("send" if op.op in real_ops else "recv", op_peer(op)) for op in ops])
        return real["batch_isend_irecv"](ops)

    wrapped.update(batch_isend_irecv=batch_isend_irecv, P2POp=p2p_op)
    pg = c10d.ProcessGroup
    pg_saved = {name: pg.__dict__[name] for name in _PG_SENDS + _PG_COLLECTIVES if name in pg.__dict__}  # unbound

    def counting(name, method):
        def wrapped_method(self, *args, **kwargs):
            if name in _PG_SENDS:
                seen["sends"] += 1
            else:
                seen["collectives"].append(name)
            return method.__get__(self)(*args, **kwargs)
        return wrapped_method

    for m, name, _ in saved:
        setattr(m, name, wrapped[name])
    for name, method in pg_saved.items():
        setattr(pg, name, counting(name, method))
    try:
        yield trace
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        for name, method in pg_saved.items():
            setattr(pg, name, method)


def nccl_deadlock(traces: list[list[list[tuple]]]) -> list[tuple] | None:
    """Replay every rank's issued units with NCCL's rule; the stuck ranks' pending operations, or ``None``.

    The rule: a rank runs its units in issue order, one at a time; an operation of the running unit
    finishes when the peer's matching operation (the next send ``a -> b`` with the next receive of ``b``
    from ``a``) is in the peer's running unit. A unit is done when all its operations are. If no
    operation can finish and a rank has units left, NCCL would hang: the answer is, for each stuck rank,
    ``(rank, [(kind, peer), ...])`` of its running unit's unfinished operations.

    A send whose peer is unknown (``None``, or not a rank) makes the replay unknown too: the answer is then
    ``None``, never a deadlock the recorder cannot prove.
    """
    n = len(traces)
    if any(kind == "send" and not (isinstance(peer, int) and 0 <= peer < n)
           for trace in traces for unit in trace for kind, peer in unit):
        return None
    position = [0] * n                     # the running unit of each rank
    done = [set() for _ in range(n)]       # finished operation indices of the running unit

    def running(r):
        return traces[r][position[r]] if position[r] < len(traces[r]) else []

    def advance(r):
        while position[r] < len(traces[r]) and len(done[r]) == len(traces[r][position[r]]):
            position[r] += 1
            done[r] = set()

    for r in range(n):
        advance(r)
    progress = True
    while progress:
        progress = False
        for a in range(n):
            for i, (kind, b) in enumerate(running(a)):
                if kind != "send" or i in done[a]:
                    continue
                for j, (kind_b, src) in enumerate(running(b)):
                    if kind_b == "recv" and j not in done[b] and src in (a, None):
                        done[a].add(i)
                        done[b].add(j)
                        progress = True
                        break
            for r in range(n):
                advance(r)
    stuck = [(r, [op for i, op in enumerate(running(r)) if i not in done[r]]) for r in range(n)
             if position[r] < len(traces[r])]
    return stuck or None


def _deadlock_message(stuck, n) -> str:
    waits = "; ".join(f"rank {r} " + " and ".join(f"{k} {'to' if k == 'send' else 'from'} {p}" for k, p in ops)
                      for r, ops in stuck[:4])
    return (f"on {n} ranks the sums are right on Gloo, but on NCCL this order of messages would deadlock: "
            f"each of these ranks waits for a peer that is waiting too ({waits}). NCCL's documented contract is "
            "that a send may block until the matching receive is posted, so operations that must progress "
            "together go in one group. Hand a step's send and receive to the backend together: "
            "dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), dist.P2POp(dist.irecv, ...)]) "
            "(one NCCL group), as allreduce.exchange does.")
