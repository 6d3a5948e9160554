"""Choosing a layout for a real cluster: every DP × TP × PP × CP layout, its memory per GPU, its predicted step
time and MFU, ranked by time (notebook 17, being written; issue 28's parts 2 and 3).

The question a practitioner faces: a model, a cluster, a global batch; which of the thousands of layouts trains
fastest without running out of memory? The modules answer it one idea at a time:

* :mod:`.shapes`: the inputs. :class:`Model` (a Llama-style decoder's shape, its parameters and model FLOPs) and
  :class:`Cluster` (GPUs a node, nodes, memory, peak FLOP/s, NVLink and network), with presets and their sources.
* :mod:`.space`: :class:`Layout` and :func:`enumerate_layouts`, the rules of the search space and where each
  group's GPUs sit (NVLink or the network).
* :mod:`.memory`: the bytes of the fullest GPU, part by part (states by ZeRO stage, activations under 1F1B,
  recomputation, fused or eager attention).
* :mod:`.timing`: the step's seconds, term by term (compute, the slowest stage's extra, recomputation,
  element-wise work, TP, CP, DP, the optimizer's step, pipeline sends, bubble), and MFU.
* :mod:`.ranking`: :func:`predict` one layout, :func:`rank` them all by time, :func:`explain` the winner, and
  :func:`what_breaks_first` when one steps away from it (memory, communication or the bubble, and the knob).
* :mod:`.mfu`: MFU measured on the machine at hand, against its measured matmul peak.
* :mod:`.reference` and :mod:`.fake`: the model as real modules, and what one rank of a stage holds, measured in one
  process with the fake process group and meta tensors.

The planner's parameters come from data sheets (:func:`.shapes.h100_cluster`) and one stated assumption (the
share of the peak a large matrix product sustains, :data:`.timing.EFFICIENCY`); nothing is fitted to a table.
"""
from .ranking import explain, find, other_degrees, predict, rank, table, what_breaks_first
from .shapes import PRESETS, Cluster, Model, h100_cluster
from .space import Layout, enumerate_layouts

__all__ = ["Cluster", "Layout", "Model", "PRESETS", "enumerate_layouts", "explain", "find", "h100_cluster",
           "other_degrees", "predict", "rank", "table", "what_breaks_first"]
