"""Why tensor parallelism stays inside a node: its communication per layer, priced by the α-β model.

Per transformer layer and training step, Megatron-style tensor parallelism over t ranks runs **four
all-reduces** of one activation (batch × seq × hidden values): one after attention and one after the MLP in the
forward pass, one at the entry of each in the backward pass (:func:`layer_collectives`; the notebook counts them).
Written plainly, as here, they sit on the critical path: the next layer cannot start before the sum arrives.
Production code hides part of them: Megatron-LM runs ``f``'s backward all-reduce while it computes the weight
gradient, and overlaps sequence parallelism's collectives with the matrix products (``--tp-comm-overlap``);
PyTorch's async tensor parallelism (``torch.compile`` with symmetric memory) splits the matrix products into
pieces that overlap the all-gather and reduce-scatter; it decomposes only that form, not an all-reduce, so it
needs sequence parallelism. :func:`layer_time` counts no overlap: an upper bound.

The layer's matrix products cost about 2·(4h² + 2·m·h²) FLOPs per token forward (q, k, v, out; up, down with
an MLP m times wider), plus 4·s·h for the attention scores and their use, and twice that backward
(:func:`layer_flops`); each of the t ranks does 1/t of it.

The prices come from :mod:`course_lib.comm.costmodel` (notebook 02): a ring inside one NVLink domain, the
two-level all-reduce (NVLink inside each node, the network between) once t spans nodes.
"""
from __future__ import annotations

from ..comm.costmodel import predict, predict_two_level

# Published figures, not measured here; α values are assumptions (as in notebook 02). Sources:
# * NVIDIA H100 Tensor Core GPU data sheet, H100 SXM column: BF16 Tensor Core 1,979 TFLOPS *with sparsity*,
#   so 989 dense; NVLink 900 GB/s per GPU (both directions together).
# * NVIDIA DGX H100 data sheet: 8 H100 GPUs joined by NVLink/NVSwitch (one NVLink domain per node), and
#   8 single-port ConnectX-7 adapters, 400 Gb/s InfiniBand NDR each: one port per GPU.
# The NVLink domain is hardware-specific: 8 GPUs in an HGX/DGX H100 node, 72 in a GB200 NVL72 rack (NVLink 5,
# other figures): there "inside a node" means inside the rack. This module prices the H100 node only.
H100_BF16_DENSE_FLOPS = 989e12          # H100 SXM, bf16 tensor cores, dense
GPUS_PER_NODE = 8                       # one NVLink domain: the 8 GPUs of an HGX/DGX H100 node
NVLINK = (2e-6, 1 / 450e9)              # NVLink 4: 900 GB/s per GPU both ways, 450 GB/s per direction; α assumed
INFINIBAND = (5e-6, 1 / 50e9)           # one 400 Gb/s NDR port per GPU: 400/8 = 50 GB/s per direction; α assumed


def layer_collectives(batch: int, seq: int, hidden: int, value_bytes: int = 2) -> list[tuple[str, int, str]]:
    """The collectives of one layer's forward and backward under tensor parallelism: (kind, bytes, phase)."""
    act = batch * seq * hidden * value_bytes
    return [("all-reduce", act, "forward")] * 2 + [("all-reduce", act, "backward")] * 2


def layer_flops(batch: int, seq: int, hidden: int, mlp_ratio: int = 4) -> float:
    """FLOPs of one layer's forward and backward (matrix products only; backward = 2 × forward)."""
    tokens = batch * seq
    forward = 2 * tokens * (4 * hidden**2 + 2 * mlp_ratio * hidden**2) + 4 * tokens * seq * hidden
    return 3 * forward


def allreduce_seconds(nbytes: float, tp: int, gpus_per_node: int = GPUS_PER_NODE, intra=NVLINK,
                      inter=INFINIBAND) -> float:
    """One all-reduce over ``tp`` GPUs: a ring over NVLink inside a node, two levels across nodes."""
    if tp <= gpus_per_node:
        return float(predict("ring", nbytes, tp, *intra))
    if tp % gpus_per_node:
        raise ValueError(f"tp={tp} across nodes must be a multiple of {gpus_per_node} GPUs per node")
    return float(predict_two_level(nbytes, gpus_per_node, tp // gpus_per_node, intra, inter))


def layer_time(batch: int, seq: int, hidden: int, tp: int, flops_per_s: float = H100_BF16_DENSE_FLOPS,
               value_bytes: int = 2, **links) -> dict:
    """Seconds of compute and of communication for one layer's step on each of ``tp`` GPUs, and the efficiency
    compute / (compute + communication), counting no overlap between them and compute at the peak rate."""
    compute = layer_flops(batch, seq, hidden) / tp / flops_per_s
    comm = sum(allreduce_seconds(nbytes, tp, **links) for _, nbytes, _ in layer_collectives(batch, seq, hidden,
                                                                                             value_bytes))
    return {"compute": compute, "comm": comm if tp > 1 else 0.0,
            "efficiency": compute / (compute + (comm if tp > 1 else 0.0))}


def comm_over_compute(tp: int, hidden: int, flops_per_s: float = H100_BF16_DENSE_FLOPS,
                      bytes_per_s: float = 1 / NVLINK[1]) -> float:
    """Communication over compute for one layer on ``tp`` ranks, in closed form: (2/9)·(t−1)·F/(h·B).

    Four ring all-reduces of 2·s·b·h bytes (bf16) send 4·2(t−1)/t·2sbh bytes per rank; the matrix products do
    72·s·b·h²/t FLOPs per rank (:func:`layer_flops` without the attention scores). Their ratio leaves out α and
    the scores, and no longer depends on the sequence or the batch: only the degree t, the width h, and the ratio
    of the GPU's FLOP rate F to the link's bandwidth B.
    """
    return 2 / 9 * (tp - 1) * flops_per_s / (hidden * bytes_per_s)
