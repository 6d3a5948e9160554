"""All-reduce from scratch, with point-to-point messages only (``send``/``recv`` and paired ``isend``/``irecv``).

Three algorithms, each a drop-in for ``dist.all_reduce(tensor)`` (in place, on every rank):

* :func:`naive_all_reduce`: everyone sends to rank 0, rank 0 adds and sends the sum back.  Rank 0's
  link carries 2(N-1) full copies of the data: it does not scale.
* :func:`ring_all_reduce`: the tensor is cut into N chunks; a **reduce-scatter** passes chunks round
  the ring for N-1 steps, adding as they go, until each rank owns one fully reduced chunk; an
  **all-gather** passes the reduced chunks round for N-1 more steps.  Every rank sends 2(N-1)/N of the
  data, whatever N is: bandwidth-optimal, but 2(N-1) steps of latency.
* :func:`recursive_doubling_all_reduce`: in step k each rank swaps its whole tensor with the rank
  whose number differs in bit k and adds: log2(N) steps, each carrying all the data. Few steps: the
  winner for small messages on many ranks (MPI uses it there; NCCL's trees serve the same purpose).

``op="avg"`` divides the sum by the world size at the end (floor division for integer tensors).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

OPS = ("sum", "avg")


def _finish(tensor: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    if op == "avg":
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world_size)
        else:
            tensor.copy_(torch.div(tensor, world_size, rounding_mode="floor"))
    return tensor


def all_reduce_algorithm(sum_in_place):
    """Turn ``sum_in_place(tensor)``, an algorithm that sums a contiguous tensor across ranks in place,
    into a drop-in for ``dist.all_reduce``: any tensor (a non-contiguous view is summed through a
    contiguous copy), ``op="sum"`` or ``"avg"``, the tensor returned."""
    @functools.wraps(sum_in_place)
    def all_reduce(tensor: torch.Tensor, op: str = "sum", **kwargs) -> torch.Tensor:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        sum_in_place(work, **kwargs)
        if work is not tensor:
            tensor.copy_(work)
        return _finish(tensor, op, dist.get_world_size())
    return all_reduce


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``; return when both are done.

    Both are handed to the backend together, with ``dist.batch_isend_irecv``, before waiting on either:
    that is what keeps a ring from deadlocking. Posting a lone ``isend`` first is not enough on every
    backend: NCCL may hold a large send until the peer has posted the matching receive, and if every
    rank of a ring sends first, each waits for the other. ``batch_isend_irecv`` issues the pair as one
    NCCL group (``ncclGroupStart``/``ncclGroupEnd``), so they progress together; on Gloo it posts both.
    Empty chunks (a tensor smaller than the world) are skipped; both sides skip alike, since they agree
    on every chunk's size.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


@all_reduce_algorithm
def naive_all_reduce(tensor: torch.Tensor) -> None:
    """Gather everything on rank 0, reduce there, send the result back to everyone."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(incoming, src=src)
            tensor += incoming
        for dst in range(1, n):
            dist.send(tensor, dst=dst)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)


@all_reduce_algorithm
def ring_all_reduce(tensor: torch.Tensor, on_step=None) -> None:
    """Reduce-scatter then all-gather round a ring: 2(N-1) steps, each moving 1/N of the data.

    ``on_step(step, chunks)``, if given, is called after each of the 2(N-1) steps with the rank's
    chunks (the ring stepper and its test use it to watch the algorithm run).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(n))    # N views, sizes differ by at most one
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(chunks[0])             # chunk 0 is the largest
    for step in range(n - 1):                          # reduce-scatter
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        buf = incoming[: chunks[recv_i].numel()]
        exchange(chunks[send_i], right, buf, left)
        chunks[recv_i] += buf                          # add the left neighbour's partial sum
        if on_step:
            on_step(step + 1, chunks)
    # rank now holds the complete sum of chunk (rank + 1) % n
    for step in range(n - 1):                          # all-gather
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        exchange(chunks[send_i], right, chunks[recv_i], left)   # overwrite with a finished chunk
        if on_step:
            on_step(n + step, chunks)


@all_reduce_algorithm
def recursive_doubling_all_reduce(tensor: torch.Tensor) -> None:
    """Swap-and-add with partner ``rank XOR 2^k`` for k = 0, 1, ...: log2(N) steps of the full tensor.

    When N is not a power of two, the ranks beyond the largest power of two P first hand their data
    to rank - P, wait outside, and get the result back at the end (two extra steps).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    p = 1 << (n.bit_length() - 1)                      # largest power of two <= n
    if rank >= p:                                      # an extra rank: fold in, wait, receive
        dist.send(tensor, dst=rank - p)
        dist.recv(tensor, src=rank - p)
        return
    incoming = torch.empty_like(tensor)
    if rank + p < n:
        dist.recv(incoming, src=rank + p)
        tensor += incoming
    mask = 1
    while mask < p:
        partner = rank ^ mask
        exchange(tensor, partner, incoming, partner)
        tensor += incoming                             # a + b == b + a exactly: ranks stay identical
        mask <<= 1
    if rank + p < n:
        dist.send(tensor, dst=rank + p)


@all_reduce_algorithm
def library_all_reduce(tensor: torch.Tensor) -> None:
    """``dist.all_reduce`` of whatever backend runs (Gloo's or NCCL's), with the hand-written ones' signature."""
    dist.all_reduce(tensor)


IMPLEMENTATIONS = {"naive": naive_all_reduce, "ring": ring_all_reduce,
                   "recursive doubling": recursive_doubling_all_reduce, "dist.all_reduce": library_all_reduce}


def ring_state(world_size: int, step: int) -> list[list[frozenset[int]]]:
    """Which ranks' contributions each rank's chunk holds after ``step`` steps of the ring.

    ``state[rank][chunk]`` is a set of ranks; the set of all ranks means that chunk is fully reduced.
    Steps 1..N-1 are the reduce-scatter, N..2(N-1) the all-gather.  Pure Python: this is what the ring
    stepper draws, and the tests check it against :func:`ring_all_reduce` running for real.
    """
    n = world_size
    if n < 1 or not 0 <= step <= 2 * (n - 1):
        raise ValueError(f"step must be between 0 and 2*(world_size-1) = {2 * (n - 1)}, got {step}")
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    for s in range(step):
        sent = []
        for r in range(n):
            i = (r - s) % n if s < n - 1 else (r + 1 - (s - n + 1)) % n
            sent.append((i, state[r][i]))
        for r in range(n):
            i, data = sent[(r - 1) % n]                # what the left neighbour sent
            state[r][i] = state[r][i] | data if s < n - 1 else data
    return state


def ring_sends(world_size: int, step: int) -> list[int]:
    """The chunk each rank sends in step ``step + 1`` (what the stepper highlights)."""
    n = world_size
    if step < n - 1:
        return [(r - step) % n for r in range(n)]
    return [(r + 1 - (step - n + 1)) % n for r in range(n)]


def bytes_sent(rank, world_size, name: str, numel: int) -> int:
    """Worker: run implementation ``name`` once on ``numel`` float32 elements and count the bytes this
    rank sends (by wrapping ``dist.send`` and ``dist.batch_isend_irecv`` in this process only)."""
    sent = [0]
    real_send, real_batch = dist.send, dist.batch_isend_irecv

    def send(tensor, dst, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return real_send(tensor, dst, *args, **kwargs)

    def batch_isend_irecv(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    dist.send, dist.batch_isend_irecv = send, batch_isend_irecv
    try:
        IMPLEMENTATIONS[name](torch.zeros(numel))
    finally:
        dist.send, dist.batch_isend_irecv = real_send, real_batch
    return sent[0]
