"""The two inputs of every layout question: the model's shape and the cluster's hardware, with their sources.

A :class:`Model` is a Llama-style decoder (the shape most 2024–2026 models share): RMSNorm before attention and
before the MLP, grouped-query attention (``kv_heads`` key/value heads shared by ``heads`` query heads), a SwiGLU
MLP with three matrices (``gate``, ``up``: h → f; ``down``: f → h), rotary positions (no parameters) and an untied
LM head. Its parameters, per layer::

    q, o: 2·h²     k, v: 2·h·(kv_heads·head_dim)     gate, up, down: 3·h·f     two RMSNorm weights: 2·h

plus the embedding and the LM head (``vocab·h`` each) and the final norm (``h``).

**Model FLOPs** (the numerator of MFU, :meth:`Model.flops_per_token`) follow PaLM's definition (Chowdhery et al.
2022, appendix B): ``6·N + 12·L·h·s`` per token for a forward and a backward, ``N`` the parameters that take part
in a matrix product (every block matrix and the LM head; the embedding is a lookup), ``12·L·h·s`` the attention's
``q·kᵀ`` and ``probs·v`` (counted whole, as PaLM does, although a causal kernel skips half). Recomputation's
extra forward is *not* model FLOPs: it is work the hardware does (hardware FLOPs), not work the model needs.

A :class:`Cluster` is nodes of GPUs: inside a node the GPUs share NVLink (one NVLink domain), between nodes each
GPU has its own network port. Bandwidths are per GPU and per direction; latencies (α) are assumptions, as in
notebook 02 (the α-β model), and matter only for small messages.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..tensor_parallel.cost import H100_BF16_DENSE_FLOPS, INFINIBAND, NVLINK

ATTENTION = ("fused", "eager")
H100_TOTAL_MIB = 81559        # nvidia-smi's "Total" memory of an H100 80GB HBM3 (SXM): 79.6 GiB
CUDA_RESERVE_GIB = 1.5        # assumed: CUDA context (~0.5 GiB), cuBLAS workspace, NCCL buffers (~1 GiB)
FRAGMENTATION = 0.05          # assumed: share of the rest the caching allocator loses to fragmentation
H100_HBM_BANDWIDTH = 3.35e12  # H100 SXM data sheet: HBM3, 3.35 TB/s


@dataclass(frozen=True)
class Model:
    """A Llama-style decoder's shape (module docstring). ``attention``: ``"fused"`` (FlashAttention / SDPA, which
    saves no s² scores) or ``"eager"`` (softmax(q·kᵀ)·v written out, which saves them)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    ffn: int
    attention: str = "fused"

    def __post_init__(self):
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.seq, self.vocab, self.ffn) < 1:
            raise ValueError(f"every size must be positive, got {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"need hidden divisible by heads and heads by kv_heads, got {self}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): the key/value heads times the head dimension."""
        return self.kv_heads * self.head_dim

    def layer_matrix_params(self) -> int:
        """Parameters of one layer's matrices (q, k, v, o, gate, up, down): the part tensor parallelism splits."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn

    def layer_params(self) -> int:
        """One layer's parameters: its matrices and its two RMSNorm weights."""
        return self.layer_matrix_params() + 2 * self.hidden

    def params(self) -> int:
        """All parameters: the layers, the embedding, the final norm and the (untied) LM head."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden

    def flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward: PaLM's ``6·N + 12·L·h·s`` (module docstring)."""
        matmul_params = self.layers * self.layer_matrix_params() + self.vocab * self.hidden
        return 6 * matmul_params + 12 * self.layers * self.hidden * self.seq

    def with_(self, **changes) -> Model:
        return replace(self, **changes)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs. Bandwidths in bytes/s per GPU per direction, latencies in s;
    ``peak_flops``: the data sheet's dense bf16 rate of one GPU; ``gib_per_gpu``: the memory the driver reports
    (GiB, 2³⁰ bytes); ``reserve_gib``: what training cannot use (:attr:`limit_gib`); ``hbm_bandwidth``: the
    GPU's memory bandwidth, bytes/s (what memory-bound work such as the optimizer's step runs at)."""

    name: str
    gpus_per_node: int
    nodes: int
    gib_per_gpu: float
    peak_flops: float
    nvlink_bandwidth: float
    nvlink_latency: float
    network_bandwidth: float
    network_latency: float
    reserve_gib: float = 0.0
    hbm_bandwidth: float = 3.35e12

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def limit_gib(self) -> float:
        """GiB a layout may use on one GPU: the memory the driver reports, less ``reserve_gib`` (the CUDA context,
        cuBLAS's workspace, NCCL's buffers), less the allocator's :data:`FRAGMENTATION` share of the rest."""
        return (self.gib_per_gpu - self.reserve_gib) * (1 - FRAGMENTATION)

    def link(self, inside_node: bool) -> tuple[float, float]:
        """(α, β) of the link a group uses: NVLink inside a node, the GPU's network port between nodes."""
        if inside_node:
            return self.nvlink_latency, 1 / self.nvlink_bandwidth
        return self.network_latency, 1 / self.network_bandwidth

    def with_(self, **changes) -> Cluster:
        return replace(self, **changes)


def h100_cluster(nodes: int = 8) -> Cluster:
    """Nodes of 8 H100 SXM 80 GB (an HGX/DGX H100), the figures :mod:`course_lib.tensor_parallel.cost` cites:

    * NVIDIA H100 data sheet, SXM column: bf16 Tensor Core 1,979 TFLOP/s *with sparsity*, so 989 dense; "80 GB"
      of HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s per GPU both ways, 450 GB/s per direction;
    * memory: ``nvidia-smi`` reports a total of :data:`H100_TOTAL_MIB` = 81,559 MiB (79.6 GiB: the 80 GiB of HBM3
      less what the driver keeps for ECC and its own use), not 80·10⁹ bytes (74.5 GiB). Of that,
      :data:`CUDA_RESERVE_GIB` goes to the CUDA context, cuBLAS's workspace and NCCL's buffers, and
      :data:`FRAGMENTATION` of the rest to the caching allocator's fragmentation (both assumed, stated):
      :attr:`Cluster.limit_gib` = (79.6 − 1.5) × 0.95 = 74.2 GiB a layout may use;
    * NVIDIA DGX H100 data sheet: one 400 Gb/s InfiniBand NDR port (ConnectX-7) per GPU: 50 GB/s per direction;
    * α: 2 µs on NVLink, 5 µs on the network, assumed (notebook 02 fits them to a real machine).
    """
    return Cluster(f"{nodes} x 8 H100 SXM 80 GB", 8, nodes, H100_TOTAL_MIB / 1024, H100_BF16_DENSE_FLOPS,
                   1 / NVLINK[1], NVLINK[0], 1 / INFINIBAND[1], INFINIBAND[0], CUDA_RESERVE_GIB, H100_HBM_BANDWIDTH)


# Shapes from the models' published config.json files (Meta's Llama 3 release, Hugging Face hub:
# meta-llama/Meta-Llama-3-8B and -70B): layers, hidden_size, attention heads, key_value heads, intermediate_size,
# vocab_size 128256. Sequence 4096 here (the models were trained at 8192; the course's 70 B case uses 4096).
PRESETS = {
    "llama-3-8b": Model("Llama-3-8B shape", 32, 4096, 32, 8, 4096, 128256, 14336),
    "llama-3-70b": Model("Llama-3-70B shape", 80, 8192, 64, 8, 4096, 128256, 28672),
    "tiny": Model("tiny (tests, CPU)", 2, 64, 4, 2, 32, 128, 160),
}
